"""Measured inference speed and memory of models side by side: what a smaller attention buys.

Per model: prefill tokens/s (one forward over `batch x context` tokens, filling the KV cache),
decode tokens/s (`new_tokens` greedy single-token steps reading that cache), the KV-cache bytes
summed over the cache's own tensors after decoding, and the process's peak memory growth
during one untimed prefill+decode.

Fairness on a shared machine: all models are loaded first, then the repetitions are
interleaved (round r measures every model, in an order rotated each round), so background
load hits every model alike; medians are reported with the ratio to the first model.
"""
from __future__ import annotations

import ctypes
import gc
import inspect as _inspect
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..data.batches import make_batches
from ..data.sources import DataSpec
from ..errors import UsageError
from ..model.placement import input_device
from .speed_spec import SpeedSpec

FORMAT = "headtool.speed/1"

MEMORY_METHOD = {
    "kv_cache_bytes": "sum of the nbytes of every key and value tensor in the KV cache after prefill + decode "
                      "(batch x (context + new_tokens) tokens)",
    "peak_memory_delta_bytes": "CPU: process resident set size sampled every 1 ms during one untimed "
                               "prefill + decode, maximum minus the value just before it (glibc told to "
                               "return large blocks to the OS for that run, so the RSS follows live memory); "
                               "free heap pages released first (malloc_trim); "
                               "CUDA: torch.cuda.max_memory_allocated minus memory allocated before it",
}


# --------------------------------------------------------------------------- memory


def cache_bytes(cache: Any) -> tuple[int, int]:
    """(bytes of every key/value tensor, cached sequence length) of a transformers cache."""
    layers = getattr(cache, "layers", None)
    total = 0
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    else:  # legacy tuple of (k, v) per layer
        for kv in cache or ():
            for t in kv:
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    length = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
    return total, length


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _return_freed_memory_to_os() -> bool:
    """Make glibc unmap large freed blocks (fixed mmap threshold), so RSS tracks live memory."""
    libc = _libc()
    if libc is None:
        return False
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 128 * 1024) and libc.mallopt(m_trim_threshold, 128 * 1024))
    except AttributeError:
        return False


def _trim() -> None:
    """Release free heap pages, so memory reused by the next run shows up in the RSS again."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class _PeakSampler:
    """Samples the RSS in a thread; `peak - start` is the growth during the block."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = _rss_bytes()
            if r is not None and self.peak is not None and r > self.peak:
                self.peak = r
            time.sleep(self.interval_s)

    def __enter__(self) -> "_PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        r = _rss_bytes()
        if r is not None and self.peak is not None:
            self.peak = max(self.peak, r)

    @property
    def delta(self) -> int | None:
        return None if self.start is None or self.peak is None else self.peak - self.start


# --------------------------------------------------------------------------- one model


def _cache_of(out) -> Any:
    """The KV cache a forward returned (`cache` in transformers >= 5.2x, `past_key_values` before)."""
    keys = out.keys() if hasattr(out, "keys") else ()
    if "cache" in keys:
        return out["cache"]
    return out["past_key_values"] if "past_key_values" in keys else getattr(out, "past_key_values", None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """Prefill and decode of one model on fixed input ids."""

    def __init__(self, model, input_ids: torch.Tensor, decode: bool):
        self.model = model
        self.device = input_device(model)
        self.ids = input_ids.to(self.device)
        self.decode = decode
        params = _inspect.signature(model.forward).parameters
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        # transformers 5.2x renamed past_key_values to cache (the old name still works, with a warning)
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def prefill(self):
        mask = torch.ones_like(self.ids)
        out = self.model(input_ids=self.ids, attention_mask=mask, use_cache=self.decode, **self.extra)
        return out, mask

    @torch.no_grad()
    def run(self, new_tokens: int) -> tuple[float, float | None, Any]:
        """(prefill seconds, decode seconds or None, cache) of one prefill + decode."""
        _sync(self.device)
        t0 = time.perf_counter()
        out, mask = self.prefill()
        _sync(self.device)
        t1 = time.perf_counter()
        if not self.decode:
            return t1 - t0, None, None
        cache = _cache_of(out)
        tok = out.logits[:, -1:].argmax(-1)
        ones = torch.ones_like(tok)
        for _ in range(new_tokens):
            mask = torch.cat([mask, ones], dim=1)
            out = self.model(input_ids=tok, attention_mask=mask, use_cache=True, **{self.cache_arg: cache},
                             **self.extra)
            cache = _cache_of(out)
            tok = out.logits[:, -1:].argmax(-1)
        _sync(self.device)
        return t1 - t0, time.perf_counter() - t1, cache


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# --------------------------------------------------------------------------- comparison


def measure_models(models: Sequence[tuple[str, Any, bool]], input_ids: torch.Tensor, spec: SpeedSpec,
                   *, on_round: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Speed figures for (name, model, can_decode) triples on the same `input_ids` [batch, context].

    Warm-up runs first, then `repeats` interleaved rounds, then one untimed memory run each.
    """
    spec.check()
    runners = [_Runner(m, input_ids, dec) for _, m, dec in models]
    times: list[dict[str, list[float]]] = [{"prefill": [], "decode": []} for _ in runners]
    for _ in range(spec.warmup):
        for r in runners:
            r.run(spec.new_tokens)
    n = len(runners)
    for rnd in range(spec.repeats):
        for k in range(n):
            i = (rnd + k) % n  # rotate the order each round
            pre, dec, _ = runners[i].run(spec.new_tokens)
            times[i]["prefill"].append(pre)
            if dec is not None:
                times[i]["decode"].append(dec)
        if on_round:
            on_round(rnd)
    # memory last, so the allocator setting does not touch the timed runs
    returned = _return_freed_memory_to_os()
    results = []
    prompt_tokens = spec.batch * spec.context
    for (name, model, dec), r, t in zip(models, runners, times):
        _trim()
        if r.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(r.device)
            before = torch.cuda.memory_allocated(r.device)
            _, _, cache = r.run(spec.new_tokens)
            peak: int | None = torch.cuda.max_memory_allocated(r.device) - before
        else:
            with _PeakSampler() as sampler:
                _, _, cache = r.run(spec.new_tokens)
            peak = sampler.delta
        kv, kv_len = cache_bytes(cache) if cache is not None else (None, None)
        del cache
        pre_med = _median(t["prefill"])
        res: dict[str, Any] = {
            "model": name,
            "prefill_s": pre_med,
            "prefill_tokens_per_s": prompt_tokens / pre_med,
            "prefill_s_runs": [round(x, 6) for x in t["prefill"]],
            "decode_s": None, "decode_tokens_per_s": None, "decode_ms_per_step": None, "decode_s_runs": [],
            "kv_cache_bytes": kv, "kv_cache_tokens": kv_len,
            "peak_memory_delta_bytes": peak,
            "rss_follows_live_memory": returned if r.device.type != "cuda" else None,
        }
        if t["decode"]:
            dmed = _median(t["decode"])
            res.update(decode_s=dmed, decode_tokens_per_s=spec.batch * spec.new_tokens / dmed,
                       decode_ms_per_step=1000 * dmed / spec.new_tokens,
                       decode_s_runs=[round(x, 6) for x in t["decode"]])
        results.append(res)
    base = results[0]
    for res in results:
        res["ratio"] = {k: (res[k] / base[k] if res[k] and base[k] else None)
                        for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "kv_cache_bytes",
                                  "peak_memory_delta_bytes")}
    return results


def speed_input_ids(tokenizer, spec: SpeedSpec, source: str = "builtin:pydoc", seed: int = 0) -> torch.Tensor:
    """[batch, context] real text tokens from `source` (the content barely matters; real text is honest)."""
    ds = DataSpec(source=source, seq_len=spec.context, batch_size=spec.batch, max_samples=spec.batch, seed=seed)
    b = make_batches(ds, tokenizer, "plain")
    ids = torch.cat([x["input_ids"] for x in b.batches])
    if ids.shape[0] < spec.batch:
        raise UsageError(f"{source} has too few tokens for --batch {spec.batch} x --context {spec.context}")
    return ids[: spec.batch]


def max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


