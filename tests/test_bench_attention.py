"""scripts/bench_attention.py on the tiny checkpoint (GQA: 4 query heads, 2 KV heads): both ways
of attention are timed, compute the same logits, and model.attention is left as it was."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_attention  # noqa: E402
import model  # noqa: E402


def test_bench_attention_tiny(tiny_checkpoint, tmp_path, monkeypatch):
    checkpoint, _ = tiny_checkpoint
    called = []
    monkeypatch.setitem(bench_attention.WAYS, "gqa", lambda *a: called.append(1) or bench_attention.gqa_sdpa(*a))
    grouped = model._grouped_sdpa
    out = tmp_path / "attention"
    report = bench_attention.main(["--checkpoint_path", str(checkpoint), "--dtype", "float32", "--no-compile",
                                   "--slots", "32", "--tokens", "1", "5", "--steps", "2", "--out", str(out)])
    assert model._grouped_sdpa is grouped and called  # the gqa way ran, and the model is as it was
    assert [(r["slots"], r["tokens"]) for r in report["rows"]] == [(32, 1), (32, 5)]
    for r in report["rows"]:
        assert r["grouped_ms"] > 0 and r["gqa_ms"] > 0 and r["max_logit_diff"] < 1e-4
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == report["rows"]
    assert "| 32 | 5 |" in out.with_suffix(".md").read_text()


def test_bench_attention_bad_flags_are_clear_errors(tiny_checkpoint, tmp_path):
    checkpoint, _ = tiny_checkpoint
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--checkpoint_path", str(checkpoint), "--slots", "8", "--tokens", "8",
                                    "--out", str(tmp_path / "x")])
