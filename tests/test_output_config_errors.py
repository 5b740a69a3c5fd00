"""A headtool output whose config.json was edited by hand is bad input: one clear line, exit 2,
for the per-layer head table of prune/convert-gqa outputs and the latent table of convert-mla."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from headtool.arch import LAYOUT_KEY
from headtool.cli.app import app
from headtool.model.latent import MLA_KEY
from tiny_models import save_tiny

runner = CliRunner()
_CAL = ["--data", "builtin:pydoc", "--max-samples", "2", "--seq-len", "16"]


def _output(kind: str, tmp_path: Path) -> Path:
    src = save_tiny("llama", tmp_path / "src")
    out = tmp_path / kind
    if kind == "pruned":  # a non-uniform head table: the remote-code kind with its head table
        args = ["prune", str(src), "--heads", "0:0,2", "-o", str(out)]  # (reads no text)
    else:
        args = ["convert-mla", str(src), "--kv-rank", "6", "--rope-dim", "4", "--no-refit", *_CAL, "-o", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.stderr
    return out


def _edit(out: Path, change) -> None:
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def _unknown_family(cfg: dict) -> None:
    cfg["model_type"] = "not-a-family"


def _short_table(cfg: dict) -> None:
    table = cfg[LAYOUT_KEY] if LAYOUT_KEY in cfg else cfg[MLA_KEY]
    for k in ("num_heads", "num_kv_heads", "kv_rank", "rope_planes"):
        if isinstance(table.get(k), list):
            table[k] = table[k][:-1]


@pytest.mark.parametrize("kind", ["pruned", "latent"])
@pytest.mark.parametrize("change,words", [(_unknown_family, "model_type"), (_short_table, "layers")],
                         ids=["unknown-family", "table-too-short"])
def test_hand_edited_config_is_one_line_exit_2(kind, change, words, tmp_path):
    out = _output(kind, tmp_path)
    ok = runner.invoke(app, ["info", str(out), "--json"])
    assert ok.exit_code == 0, ok.stderr
    _edit(out, change)
    r = runner.invoke(app, ["info", str(out)])
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0] and "config.json" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
