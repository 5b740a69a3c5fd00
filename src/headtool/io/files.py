"""Output files and plot folders (score documents, heatmaps, inspect's pictures): where an option may
write and how a file is written, so that nothing the user owns is modified by accident.

A file option may replace a file of its own (as a shell redirection does), but never a file inside an
input model folder, never an input file itself (a --data file), and never a folder. Writing goes
through a symlink to its target (the link stays) and straight into a device or pipe (/dev/null,
/dev/stdout), which a rename over them would replace; a regular file is written beside its place and
renamed over it, keeping the mode the file had.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from ..errors import UsageError


def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(str(path))).resolve()


#: the file in a folder that headtool converted from another format (a .gguf dequantized into the cache)
#: that names the file it was made from: {"gguf": resolved path}
CONVERTED_FROM = "headtool_source.json"


def converted_from(folder: Path | None) -> Path | None:
    """The input file a converted folder was made from (a .gguf MODEL), None for any other folder."""
    try:
        named = json.loads((folder / CONVERTED_FROM).read_text()).get("gguf") if folder is not None else None
    except (OSError, ValueError, AttributeError):
        return None
    return Path(named).resolve() if isinstance(named, str) else None


def inside(child: Path, parent: Path) -> bool:
    """Is `child` the folder `parent` or a path under it (both resolved)?"""
    return child == parent or parent in child.parents


def check_output_path(path: str | os.PathLike, opt: str, inputs: Iterable[str | os.PathLike | None] = (),
                      *, folder: bool = False) -> Path:
    """The path `opt` names, or a UsageError naming what is wrong (call it before any work): not inside
    an input model folder nor an input file of `inputs` (those that are local paths), a folder for a
    folder option and none for a file option, in a folder that exists and can be written."""
    target = Path(os.path.expanduser(str(path)))
    real = target.resolve()
    for given in inputs:
        if not given or not Path(os.path.expanduser(str(given))).exists():
            continue
        src = _resolved(given)
        if src.is_dir() and inside(real, src):
            raise UsageError(f"{opt} {path}: lies inside the input model folder {src}; choose a place outside "
                             "it (the input is never modified)")
        if not src.is_dir() and real == src:
            raise UsageError(f"{opt} {path}: is an input of this command ({given}); choose another file")
    if folder:
        if target.exists() and not target.is_dir():
            raise UsageError(f"{opt} {path}: exists and is not a folder")
        return target
    if target.is_dir():
        raise UsageError(f"{opt} {path}: is a folder; give a file name")
    parent = real.parent
    if not parent.exists():
        raise UsageError(f"{opt} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{opt} {path}: {parent} is not a folder")
    if not real.exists() or real.is_file():  # a device or pipe is written into, not beside
        probe_writable(parent, f"{opt} {path}")
    return target


def probe_writable(folder: Path, what: str) -> None:
    """A UsageError unless a file can be made in `folder`: tried for real, since as root os.access
    passes on read-only and virtual file systems (/proc), where the write would fail after the work."""
    try:
        fd, name = tempfile.mkstemp(prefix=".headtool-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        reason = "permission denied" if e.errno in (errno.EACCES, errno.EPERM) else (e.strerror or str(e))
        raise UsageError(f"{what}: cannot write into {folder} ({reason})") from None


@contextlib.contextmanager
def safetensors_os_errors(where: str | os.PathLike | None = None):
    """A write that safetensors failed for the machine's reason (disk full, quota, read-only) raised as the
    OSError it is (its errno named, `where` as the file), which the CLI tells in one line: safetensors
    reports it as a SafetensorError ('Error while serializing: I/O error: ... (os error 28)'), which read
    as an internal error to report."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))),
                      None if where is None else str(where)) from e


def default_mode(folder: bool = False) -> int:
    """The mode a new file (or folder) gets from the umask, as `open` / `mkdir` would give it: a temporary
    file or folder renamed into place is private (0600 / 0700) until set to this."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def open_up(folder: Path) -> None:
    """Give a folder written privately (mkdtemp), and everything in it, the modes the umask gives new
    files and folders, so that the output can be read as any other (a 0700 model folder and a 0600
    weights file kept other users of a shared machine from loading it)."""
    files, folders = default_mode(), default_mode(folder=True)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, folders if path.is_dir() else files)


def write_file(path: str | os.PathLike, write: Callable[[str], None], suffix: str = ".tmp") -> None:
    """Call `write(name)` to make the file at `path`: into a temporary file beside it (named with
    `suffix`, which a writer may read the format from) that then replaces it, or, where `path` is a
    device or a pipe, into `path` itself. A symlink is followed; the file keeps its mode."""
    real = Path(os.path.realpath(os.path.expanduser(str(path))))
    if real.exists() and not real.is_file():  # a character device or a FIFO: nothing to replace
        write(str(real))
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=suffix, dir=real.parent)
    except OSError as e:
        raise UsageError(f"{path}: cannot write into {real.parent} ({e.strerror or e})") from None
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, stat.S_IMODE(real.stat().st_mode) if real.exists() else default_mode())
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` (UTF-8) to `path` as `write_file` writes."""
    def write(name: str) -> None:
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)

    write_file(path, write)
