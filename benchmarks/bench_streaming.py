"""Streaming surgery on a synthetic Llama-shaped checkpoint larger than a few GB.

Writes the checkpoint tensor by tensor (no model), then times, in one run: a plain copy of the
shards, plain and with fsync (each once before and once after the rest; the faster is the
baseline), `prune --streaming` (one query head of every KV group removed in every layer) and
`convert-gqa --streaming --merge mean` (8 -> 2 KV heads), each in a fresh subprocess whose
peak RSS is read from the kernel (the child's VmHWM). Prints a table, writes JSON.

    python benchmarks/bench_streaming.py --gb 3.2 --work /tmp/headtool-stream
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_checkpoint import write_synthetic  # noqa: E402


_WRAPPER = """
import atexit, runpy, sys
def _hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            sys.stderr.write('VMHWM_KB ' + line.split()[1] + chr(10))
atexit.register(_hwm)
sys.argv = ['headtool', *sys.argv[1:]]
runpy.run_module('headtool', run_name='__main__')
"""


def run_child(args: list[str]) -> tuple[float, float]:
    """Seconds and peak RSS (MiB) of a fresh `python -m headtool ...` process.

    The peak is the child's own VmHWM read at exit (rusage's maxrss would include the memory
    of this parent process at fork time)."""
    os.sync()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(out.stderr)
    kb = [int(line.split()[1]) for line in out.stderr.splitlines() if line.startswith("VMHWM_KB ")]
    return dt, kb[-1] / 1024


def copy_shards(src: Path, dst: Path, durable: bool) -> float:
    """Seconds to copy the shards; `durable` also fsyncs each copy, as headtool does its output.

    Dirty pages are flushed first (os.sync) so that no run pays for the writeback of the one
    before it: on a VM disk that, not the work, decides who looks fast."""
    os.sync()
    dst.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        shutil.copyfile(f, dst / f.name)
        if durable:
            fd = os.open(dst / f.name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    dt = time.perf_counter() - t0
    shutil.rmtree(dst)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=3.2)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/headtool-stream"))
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "streaming.json")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    src = args.work / "synthetic"
    t0 = time.perf_counter()
    cfg = write_synthetic(src, int(args.gb * 1e9), int(args.shard_gb * 1e9))
    write_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
    plain = [copy_shards(src, args.work / "copy", durable=False)]
    durable = [copy_shards(src, args.work / "copy", durable=True)]
    groups = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    heads = ";".join(f"{i}:" + ",".join(str(g * groups) for g in range(cfg["num_key_value_heads"]))
                     for i in range(cfg["num_hidden_layers"]))
    shard = f"{int(args.shard_gb * 1e9)}"
    prune_s, prune_rss = run_child(["prune", str(src), "--heads", heads, "--streaming", "-o",
                                    str(args.work / "pruned"), "--shard-size", shard])
    shutil.rmtree(args.work / "pruned")
    conv_s, conv_rss = run_child(["convert-gqa", str(src), "--kv-heads", "2", "--merge", "mean", "--streaming",
                                  "-o", str(args.work / "converted"), "--shard-size", shard])
    shutil.rmtree(args.work / "converted")
    base_s, base_rss = run_child(["--version"])
    plain.append(copy_shards(src, args.work / "copy", durable=False))
    durable.append(copy_shards(src, args.work / "copy", durable=True))
    copy_s, durable_s = min(plain), min(durable)  # the faster of two: the conservative baseline
    result = {
        "checkpoint_bytes": size, "largest_shard_bytes": largest, "layers": cfg["num_hidden_layers"],
        "synthetic_write_s": round(write_s, 1), "copy_s": round(copy_s, 2),
        "copy_runs_s": [round(c, 2) for c in plain], "durable_copy_s": round(durable_s, 2),
        "durable_copy_runs_s": [round(c, 2) for c in durable],
        "prune": {"seconds": round(prune_s, 2), "time_vs_copy": round(prune_s / copy_s, 2),
                  "time_vs_durable_copy": round(prune_s / durable_s, 2),
                  "peak_rss_mib": round(prune_rss, 1), "rss_fraction_of_checkpoint": round(prune_rss * 2**20 / size, 3)},
        "convert_mean": {"seconds": round(conv_s, 2), "time_vs_copy": round(conv_s / copy_s, 2),
                         "time_vs_durable_copy": round(conv_s / durable_s, 2),
                         "peak_rss_mib": round(conv_rss, 1),
                         "rss_fraction_of_checkpoint": round(conv_rss * 2**20 / size, 3)},
        "python_import_rss_mib": round(base_rss, 1),
        "command": "python benchmarks/bench_streaming.py " + " ".join(sys.argv[1:]),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpoint {size / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards, "
          f"{cfg['num_hidden_layers']} layers; plain copy {copy_s:.1f} s, copy + fsync {durable_s:.1f} s")
    print(f"{'operation':<16}{'seconds':>10}{'vs copy':>10}{'vs copy+fsync':>15}{'peak RSS MiB':>15}{'RSS/ckpt':>10}")
    for name in ("prune", "convert_mean"):
        r = result[name]
        print(f"{name:<16}{r['seconds']:>10.1f}{r['time_vs_copy']:>9.2f}x{r['time_vs_durable_copy']:>14.2f}x"
              f"{r['peak_rss_mib']:>15.0f}{100 * r['rss_fraction_of_checkpoint']:>9.1f}%")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
