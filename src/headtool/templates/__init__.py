"""Files that headtool copies into output folders (self-contained: they never import headtool)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

MODELING_TEMPLATE = Path(__file__).with_name("modeling_headtool.py")
# latent attention (convert-mla): written into output folders under the same file name
LATENT_TEMPLATE = Path(__file__).with_name("modeling_headtool_mla.py")


def modeling_file_source(class_names: Mapping[str, str], latent: bool = False) -> str:
    """Text of the self-contained modeling file for an output folder.

    `class_names` maps the exported name (e.g. 'HeadtoolLlamaForCausalLM') to the
    transformers class it resizes (e.g. 'LlamaForCausalLM'), or with `latent` whose attention
    layers it replaces by latent attention. Each class is exported under both names: a model loaded
    from the folder and saved again (fine-tuned, pushed) names its own class in auto_map.
    """
    text = (LATENT_TEMPLATE if latent else MODELING_TEMPLATE).read_text()
    factory = "headtool_mla_class" if latent else "headtool_class"
    lines = ["import transformers as _transformers", ""]
    for exported, base in class_names.items():
        lines.append(f"{exported} = {factory}(_transformers.{base})")
    # each class also under its own name (the family's: see headtool_class), which is what
    # transformers writes into auto_map when a model loaded from this folder is saved again
    lines += ["", *(f"{base} = {exported}" for exported, base in class_names.items())]
    return text + "\n".join(lines) + "\n"
