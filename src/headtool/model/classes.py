"""Which task a checkpoint is for, and the transformers class that builds it."""
from __future__ import annotations

from ..errors import UsageError

TASKS = ("auto", "causal-lm", "masked-lm", "classification", "base")


def pick_task(config, task: str = "auto") -> str:
    if task != "auto":
        if task not in TASKS:
            raise UsageError(f"unknown task {task!r}; use one of {', '.join(TASKS)}")
        return task
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        if a.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal-lm"
        if a.endswith(("ForMaskedLM", "ForPreTraining")):
            return "masked-lm"
        if a.endswith("ForSequenceClassification"):
            return "classification"
    if archs:
        return "base"
    return "masked-lm" if getattr(config, "is_decoder", None) is False and config.model_type in (
        "bert", "roberta") else "causal-lm"


def auto_class(task: str):
    import transformers as tf

    return {
        "causal-lm": tf.AutoModelForCausalLM,
        "masked-lm": tf.AutoModelForMaskedLM,
        "classification": tf.AutoModelForSequenceClassification,
        "base": tf.AutoModel,
    }[task]


def model_class(config, task: str):
    """The transformers class for `task` of this config's family."""
    import transformers

    auto = auto_class(task)
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and type(config) in auto._model_mapping and \
                cls is auto._model_mapping[type(config)]:
            return cls
    try:
        return auto._model_mapping[type(config)]
    except KeyError as e:
        raise UsageError(f"{type(config).__name__} has no {task} model class") from e
