"""Files that headtool copies into output folders (self-contained: they never import headtool)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

MODELING_TEMPLATE = Path(__file__).with_name("modeling_headtool.py")


def modeling_file_source(class_names: Mapping[str, str]) -> str:
    """Text of the self-contained modeling file for an output folder.

    `class_names` maps the exported name (e.g. 'HeadtoolLlamaForCausalLM') to the
    transformers class it resizes (e.g. 'LlamaForCausalLM').
    """
    text = MODELING_TEMPLATE.read_text()
    lines = ["import transformers as _transformers", ""]
    for exported, base in class_names.items():
        lines.append(f"{exported} = headtool_class(_transformers.{base})")
    return text + "\n".join(lines) + "\n"
