"""Look up the adapter of a config: by `architectures`, then by `model_type`."""
from __future__ import annotations

from ..errors import UsageError
from .base import Adapter
from .families import ALL_ADAPTERS

_BY_MODEL_TYPE: dict[str, Adapter] = {mt: a for a in ALL_ADAPTERS for mt in a.model_types}

# Architecture class-name stems -> model_type (for configs whose model_type is custom, e.g. a
# fine-tune that kept the class name; headtool's own outputs keep the family's model_type).
_BY_ARCH_STEM: dict[str, str] = {
    "Bert": "bert", "Roberta": "roberta", "XLMRoberta": "xlm-roberta", "Electra": "electra",
    "GPT2": "gpt2", "GPTNeoX": "gpt_neox", "OPT": "opt", "Llama": "llama", "Mistral": "mistral",
    "Qwen2": "qwen2", "Qwen3": "qwen3", "Gemma": "gemma", "Gemma2": "gemma2",
    "Gemma3": "gemma3_text", "Phi3": "phi3",
}
_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForSequenceClassification",
          "ForTokenClassification", "ForQuestionAnswering", "Model", "ForPreTraining")


def supported_families() -> list[str]:
    return sorted({mt for a in ALL_ADAPTERS for mt in a.model_types})


def kv_head_families() -> list[str]:
    """Model types whose config sets the KV heads (ConfigSupport.kv_heads): convert-gqa writes a stock
    GQA/MQA config for them, MHA checkpoints of these families included."""
    return sorted({mt for a in ALL_ADAPTERS if a.support.kv_heads for mt in a.model_types})


def latent_families() -> list[str]:
    """Model types whose attention convert-mla rebuilds exactly (Adapter.latent)."""
    return sorted({mt for a in ALL_ADAPTERS if a.latent for mt in a.model_types})


def _stem(arch: str) -> str | None:
    for suffix in sorted(_HEADS, key=len, reverse=True):
        if arch.endswith(suffix):
            return arch[: -len(suffix)]
    return None


def adapter_for(config) -> Adapter:
    """The adapter for `config`; unsupported families are a usage error naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    for arch in getattr(config, "architectures", None) or []:
        stem = _stem(arch)
        if stem in _BY_ARCH_STEM:
            return _BY_MODEL_TYPE[_BY_ARCH_STEM[stem]]
    raise UsageError(
        f"unsupported model family {model_type!r}; supported: {', '.join(supported_families())}"
    )
