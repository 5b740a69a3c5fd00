"""Interrupted writes: SIGINT / SIGKILL in the middle of writing leave the output complete or absent.

`headtool prune` and `headtool convert-gqa` run in real subprocesses, started through a small
launcher that wraps the writer: the shard writer (transformers' safetensors save for in-memory
models, headtool's own for --streaming) and the metadata step that follows the weights. At the
chosen call the wrapper drops a marker file and sleeps; the test sends the signal only once the
marker is there, so the signal always lands inside the write, never before it starts or after it
ends. After SIGINT the wrapper's own marker proves that the KeyboardInterrupt was raised inside the
write. Afterwards the output folder is absent; after SIGINT no temporary folder remains; after
SIGKILL exactly one remains, hidden (`.out.tmp-*`), never under the output's name. The input's
files are byte-identical in every case.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from test_reliability import strays, tree_hashes
from tiny_models import save_tiny

LAYERS = 6
PRUNE_HEADS = ";".join(f"{i}:0,2" for i in range(LAYERS))  # uniform: a standard config
WAIT_S = 180  # for the launcher to reach the write on a loaded machine

LAUNCHER = '''\
"""headtool with its writers wrapped: HOOK_AT=KIND:N pauses at the N-th call of KIND."""
import os
import signal
import sys
import time
from pathlib import Path

marks = Path(os.environ["HOOK_DIR"])
kind_at, n_at = os.environ["HOOK_AT"].split(":")
calls = {"shard": 0, "metadata": 0}


def pause(kind):
    calls[kind] += 1
    (marks / f"{kind}-calls").write_text(str(calls[kind]))
    if kind != kind_at or calls[kind] != int(n_at):
        return
    (marks / "paused").write_text(str(os.getpid()))
    try:
        # short slices: the kernel may hand a process-directed SIGINT to any thread (torch's
        # workers included); a single long sleep in the main thread would then see the pending
        # KeyboardInterrupt only when it ends, a slice sees it within 0.05 s
        for _ in range(2400):
            time.sleep(0.05)
    except KeyboardInterrupt:
        (marks / "interrupted-in-write").write_text("")
        raise
    (marks / "not-interrupted").write_text("")


def wrap(module, name, kind):
    real = getattr(module, name)

    def hooked(*args, **kwargs):
        pause(kind)
        return real(*args, **kwargs)

    setattr(module, name, hooked)


import transformers.modeling_utils as modeling_utils  # noqa: E402

import headtool.io.output as output  # noqa: E402
import headtool.io.safetensors_stream as safetensors_stream  # noqa: E402

wrap(modeling_utils, "safe_save_file", "shard")  # one call per shard of save_pretrained
wrap(safetensors_stream, "write_streaming", "shard")  # one call per shard of --streaming
wrap(output, "_fix_config", "metadata")  # every shard written, before headtool.json and the rename

from headtool.cli.app import main  # noqa: E402

# the launcher stands for a run in a terminal, where Ctrl-C raises KeyboardInterrupt: a suite
# started in the background without job control (`sh -c 'pytest' &`) hands its children SIGINT
# ignored, and Python then installs no handler, so the signal would do nothing
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv = ["headtool", *sys.argv[1:]]
main()
'''


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """~10 MB of fp32 weights: with --shard-size 200KB the write produces dozens of shards."""
    d = tmp_path_factory.mktemp("interrupt") / "llama"
    save_tiny("llama", d, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS)
    return d


@pytest.fixture(scope="module")
def launcher(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("launcher") / "launch_headtool.py"
    p.write_text(LAUNCHER)
    return p


def _env(marks: Path, hook_at: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HEADTOOL_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1",
           "HOOK_DIR": str(marks), "HOOK_AT": hook_at}
    env.pop("HEADTOOL_DEBUG", None)
    return env


def _run_and_signal(launcher: Path, args: list[str], marks: Path, hook_at: str, sig: int) -> tuple[int, str]:
    """Start headtool, wait until the writer pauses at `hook_at`, send `sig`; (return code, stderr)."""
    marks.mkdir()
    p = subprocess.Popen([sys.executable, str(launcher), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=_env(marks, hook_at))
    try:
        start = time.monotonic()
        while not (marks / "paused").exists():
            if p.poll() is not None:
                pytest.fail(f"headtool ended before its write reached {hook_at}: rc={p.returncode} "
                            f"{p.stderr.read().decode(errors='replace')[-2000:]}")
            if time.monotonic() - start > WAIT_S:
                pytest.fail(f"the write did not reach {hook_at} within {WAIT_S} s")
            time.sleep(0.01)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err.decode(errors="replace")


def _assert_interrupted_in_write(sig: int, rc: int, err: str, marks: Path, parent: Path) -> None:
    """The signal landed inside the write, and what it leaves behind is right for that signal."""
    assert not (marks / "not-interrupted").exists(), "the signal arrived after the paused write went on"
    left = strays(parent, "out")
    if sig == signal.SIGINT:
        assert (marks / "interrupted-in-write").exists(), ("the KeyboardInterrupt was not raised inside the write",
                                                           rc, err)
        assert rc == 130 and "interrupted" in err and "Traceback" not in err, (rc, err)
        assert left == [], left
    else:
        assert rc == -signal.SIGKILL, (rc, err)
        assert len(left) == 1 and left[0].startswith(".out.tmp-"), left  # the write under way, hidden
    assert not (parent / "out").exists()  # the rename never happened: no output at all


MOMENTS = [("shard:1", "before-first-shard"), ("shard:4", "mid-shards"), ("metadata:1", "before-rename")]
CASES = [(sig, at) for at, _ in MOMENTS for sig in (signal.SIGINT, signal.SIGKILL)]


@pytest.mark.parametrize("sig,hook_at", CASES,
                         ids=[f"{s.name}-{dict(MOMENTS)[a]}" for s, a in CASES])
def test_prune_interrupted(sig, hook_at, model: Path, launcher: Path, tmp_path: Path) -> None:
    before = tree_hashes(model)
    rc, err = _run_and_signal(launcher, ["prune", str(model), "--heads", PRUNE_HEADS, "--shard-size", "200KB",
                                         "-o", str(tmp_path / "out")], tmp_path / "marks", hook_at, sig)
    _assert_interrupted_in_write(sig, rc, err, tmp_path / "marks", tmp_path)
    if hook_at == "shard:4":
        assert (tmp_path / "marks" / "shard-calls").read_text() == "4"  # 3 shards written, more to come
    assert tree_hashes(model) == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
@pytest.mark.parametrize("command", [
    ["convert-gqa", "--kv-heads", "1", "--merge", "mean", "--no-refit"],
    ["prune", "--streaming", "--heads", PRUNE_HEADS],
], ids=["convert-gqa", "prune-streaming"])
def test_other_writers_interrupted_mid_shards(command, sig, model: Path, launcher: Path, tmp_path: Path) -> None:
    before = tree_hashes(model)
    rc, err = _run_and_signal(launcher, [command[0], str(model), *command[1:], "--shard-size", "200KB",
                                         "-o", str(tmp_path / "out")], tmp_path / "marks", "shard:4", sig)
    _assert_interrupted_in_write(sig, rc, err, tmp_path / "marks", tmp_path)
    assert tree_hashes(model) == before


@pytest.mark.parametrize("command", [["prune", "--heads", PRUNE_HEADS], ["prune", "--streaming", "--heads",
                                                                         PRUNE_HEADS]], ids=["in-memory", "streaming"])
def test_uninterrupted_run_completes(command, model: Path, launcher: Path, tmp_path: Path) -> None:
    """The control: the same command through the launcher, never paused, writes a complete folder
    of more shards than the mid-write moment needs (so that moment is inside the write)."""
    out = tmp_path / "out"
    marks = tmp_path / "marks"
    marks.mkdir()
    p = subprocess.run([sys.executable, str(launcher), command[0], str(model), *command[1:], "--shard-size", "200KB",
                        "-o", str(out)], capture_output=True, text=True, env=_env(marks, "shard:0"), timeout=300)
    assert p.returncode == 0, p.stderr
    assert {"config.json", "headtool.json"} <= {q.name for q in out.iterdir()}
    shards = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert shards <= {q.name for q in out.iterdir()}
    assert int((marks / "shard-calls").read_text()) == len(shards) >= 6
    assert (marks / "metadata-calls").read_text() == "1"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.num_attention_heads == 2
    assert strays(tmp_path, "out") == []


# --------------------------------------------------------------------------- the folder's own windows
@pytest.fixture()
def ctrl_c_after_mkdtemp(monkeypatch):
    """tempfile.mkdtemp that is hit by Ctrl-C the moment its folder exists (before the caller has
    even received the name), with Python's own SIGINT handler in place."""
    from headtool.io import output

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return made

    monkeypatch.setattr(output.tempfile, "mkdtemp", mkdtemp)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_as_the_temporary_folder_is_made_leaves_nothing(ctrl_c_after_mkdtemp, tmp_path: Path) -> None:
    from headtool.io.output import temp_folder

    entered = []
    with pytest.raises(KeyboardInterrupt), temp_folder(tmp_path / "out") as tmp:
        entered.append(tmp)
    assert strays(tmp_path, "out") == [] and not (tmp_path / "out").exists()
    assert entered == []  # the interrupt is delivered before the caller starts writing


def test_ctrl_c_while_an_old_output_is_swapped_out_leaves_the_new_one(ctrl_c_after_mkdtemp, tmp_path: Path) -> None:
    """--overwrite parks the old folder in a hidden `.out.old-*` folder for the swap: Ctrl-C there
    must neither leave that folder behind nor lose the output."""
    from headtool.io.output import _replace

    new, target = tmp_path / "new", tmp_path / "out"
    new.mkdir()
    (new / "config.json").write_text("new")
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        _replace(new, target)
    assert (target / "config.json").read_text() == "new"
    assert strays(tmp_path, "out") == [] and not new.exists()
