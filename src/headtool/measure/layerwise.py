"""Run a model one transformer layer at a time on cached hidden states.

Why: sequential calibration (compensation, data-aware merging) fits layer l on the inputs
that the already changed layers 0..l-1 produce. Replaying the layers one by one on cached
hidden states costs one pass per layer instead of a forward up to every layer (O(L), not
O(L²)), and only the layer being processed has to be on the execution device: the model
can stay on CPU (`--sequential`), the hidden states too, and one layer at a time moves over.

The inputs each layer receives besides the hidden states (attention masks, rotary position
embeddings, per-layer-type masks of sliding-window models, ...) are recorded once, in a
forward pass where every layer is replaced by a recorder that passes the hidden states
through unchanged; they depend only on the tokens, so they serve every later replay and
every model with the same inputs (the original and its pruned or merged copy alike).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..arch import Adapter
from ..data.batches import to_device


class _Stop(Exception):
    """Ends the recording forward once the last layer's inputs are recorded."""


@dataclass
class LayerCall:
    """What one layer received besides the hidden states, for one batch."""

    args: tuple
    kwargs: dict


@dataclass
class LayerInputs:
    """Recorded layer inputs of a list of batches; `hidden` is the stream that flows through layers."""

    hidden: list[torch.Tensor]
    calls: list[list[LayerCall]]  # [batch][layer]
    masks: list[torch.Tensor | None]  # the token attention mask of each batch (real tokens)

    @property
    def num_batches(self) -> int:
        return len(self.hidden)


def _split_hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    if args:
        return args[0], tuple(args[1:]), dict(kwargs)
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), (), kwargs


def _no_cache(kwargs: dict) -> dict:
    """Replays must never read or grow a KV cache."""
    out = dict(kwargs)
    for key in ("past_key_value", "past_key_values", "layer_past"):
        if key in out:
            out[key] = None
    if "use_cache" in out:
        out["use_cache"] = False
    return out


@torch.no_grad()
def record_inputs(model: nn.Module, adapter: Adapter, batches: Sequence[dict],
                  store: torch.device | str | None = None) -> LayerInputs:
    """Record the hidden states entering layer 0 and every layer's other inputs, per batch.

    The layers do no work during the recording (each returns its input), so this costs the
    embeddings only. `store` is where the hidden states are kept (default: where they are made).
    """
    n_layers = adapter.num_layers(model.config)
    layers = [adapter.layer_module(model, i) for i in range(n_layers)]
    device = _input_device(model)
    hidden: list[torch.Tensor] = []
    calls: list[list[LayerCall]] = []
    masks: list[torch.Tensor | None] = []
    kinds: dict[type, Any] = {}  # output structure per layer class: None (a tensor) or tuple length
    current: list[LayerCall] = []

    def recorder(i: int, real: Callable):
        def forward(*args, **kwargs):
            h, rest, kw = _split_hidden(args, kwargs)
            kw = _no_cache(kw)
            if i == 0:
                hidden.append(h.detach().to(store) if store is not None else h.detach())
            current.append(LayerCall(rest, kw))
            cls = type(layers[i])
            if cls not in kinds:  # the output structure, learned once per layer class from a real call
                out = real(h, *rest, **kw)
                kinds[cls] = len(out) if isinstance(out, tuple) else None
            if i == n_layers - 1:
                raise _Stop
            return h if kinds[cls] is None else (h,) + (None,) * (kinds[cls] - 1)
        return forward

    with patched_forwards(layers, recorder):
        for batch in batches:
            b = to_device(batch, device)
            current = []
            try:
                model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"), use_cache=False)
            except _Stop:
                pass
            calls.append(current)
            m = b.get("attention_mask")
            masks.append(None if m is None else m.detach().to(store) if store is not None else m.detach())
    return LayerInputs(hidden, calls, masks)


@contextlib.contextmanager
def patched_forwards(layers: Sequence[nn.Module], make: Callable[[int, Callable], Callable]) -> Iterator[None]:
    """Replace each layer's forward (an instance attribute, as accelerate's hooks also do) for a while."""
    saved = []
    try:
        for i, layer in enumerate(layers):
            saved.append((layer, "forward" in layer.__dict__, layer.__dict__.get("forward")))
            layer.forward = make(i, layer.forward)
        yield
    finally:
        for layer, had, fwd in saved:
            if had:
                layer.forward = fwd
            else:
                del layer.forward


def _input_device(model: nn.Module) -> torch.device:
    """Where the model wants its input ids (its embedding's device, accelerate-aware)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    mod = emb if emb is not None else model
    return _module_device(mod)


def _module_device(module: nn.Module) -> torch.device:
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


class _Moved:
    """Tensors (nested in tuples/lists/dicts) moved to a device once and reused (masks are shared)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cache: dict[int, Any] = {}

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device == self.device:
                return obj
            key = id(obj)
            if key not in self.cache:
                self.cache[key] = (obj, obj.to(self.device))
            return self.cache[key][1]
        if isinstance(obj, tuple):
            return tuple(self(o) for o in obj)
        if isinstance(obj, list):
            return [self(o) for o in obj]
        if isinstance(obj, dict):
            return {k: self(v) for k, v in obj.items()}
        return obj


@contextlib.contextmanager
def on_device(layer: nn.Module, device: torch.device | str | None) -> Iterator[torch.device]:
    """Layer `layer` on `device` for a while (None: where it is); yields the device its inputs go to."""
    if device is None or getattr(layer, "_hf_hook", None) is not None:
        yield _module_device(layer)
        return
    device = torch.device(device)
    home = _module_device(layer)
    layer.to(device)
    try:
        yield device
    finally:
        layer.to(home)


class Replayer:
    """Runs layers of any model with the same inputs as the recording, batch by batch."""

    def __init__(self, inputs: LayerInputs, device: torch.device | str | None = None):
        self.inputs = inputs
        self.device = None if device is None else torch.device(device)
        self._moved: dict[torch.device, list[_Moved]] = {}

    def _mover(self, device: torch.device, b: int) -> _Moved:
        movers = self._moved.setdefault(device, [_Moved(device) for _ in range(self.inputs.num_batches)])
        return movers[b]

    def mask(self, b: int, device: torch.device) -> torch.Tensor | None:
        m = self.inputs.masks[b]
        return None if m is None else self._mover(device, b)(m)

    @torch.no_grad()
    def run(self, layer: nn.Module, index: int, hidden: Sequence[torch.Tensor],
            before_batch: Callable[[int, torch.device], None] | None = None) -> list[torch.Tensor]:
        """Layer `index` (of this or a same-shaped model) on every batch of `hidden`; the outputs.

        Outputs are kept where the inputs were. `before_batch(b, device)` runs before batch b
        (hooks use it to know which tokens are real).
        """
        outs = []
        with on_device(layer, self.device) as dev:
            for b, h in enumerate(hidden):
                call = self.inputs.calls[b][index]
                move = self._mover(dev, b)
                if before_batch is not None:
                    before_batch(b, dev)
                out = layer(h.to(dev), *move(call.args), **move(call.kwargs))
                out = out[0] if isinstance(out, tuple) else out
                outs.append(out.to(h.device))
        return outs

    @torch.no_grad()
    def inputs_of(self, layer: nn.Module, index: int, hidden: Sequence[torch.Tensor], module: nn.Module,
                  take: Callable[[int, torch.Tensor], None]) -> None:
        """`take(b, x)` with the input x of `module` (a submodule of `layer`) on every batch.

        The layer runs only until it calls `module`: the rest of it (the module itself, the MLP
        after an attention block's output projection) is skipped, so capturing an output
        projection's input costs the attention block alone, not a whole layer.
        """
        state: dict = {}

        def stop(mod: nn.Module, args: tuple) -> None:
            take(state["b"], args[0])
            raise _Stop

        handle = module.register_forward_pre_hook(stop)
        try:
            with on_device(layer, self.device) as dev:
                for b, h in enumerate(hidden):
                    call = self.inputs.calls[b][index]
                    move = self._mover(dev, b)
                    state["b"] = b
                    try:
                        layer(h.to(dev), *move(call.args), **move(call.kwargs))
                    except _Stop:
                        continue
                    raise RuntimeError(f"layer {index} never called the module whose input was wanted")
        finally:
            handle.remove()


def real_tokens(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[N_real, features] from [batch, seq, features]: the tokens the attention mask keeps."""
    t = t.reshape(-1, t.shape[-1])
    if mask is None:
        return t
    return t[mask.reshape(-1).to(t.device).bool()]
