"""scripts/check_auto.py end to end on the tiny checkpoint: auto measures, every shape of the
sweep decodes the held-out prompts, and the report says how the choice compares."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import check_auto  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--speculate", "eagle3", "--draft_dtype", "bfloat16"]], ids=["eagle2", "eagle3"])
def test_check_auto_end_to_end(tiny_checkpoint, tmp_path, monkeypatch, extra):
    checkpoint, questions = tiny_checkpoint
    monkeypatch.setenv("EAGLE_AUTO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "check"
    check_auto.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions),
                     "--benchmark_questions", "1", "--max_new_tokens", "8", "--passes", "1", "--out", str(out), *extra])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["prompts"] == ["coding", "writing"]  # the two questions outside a 1-question subset
    shapes = {(r["top_k"], r["depth"], r["tokens"]) for r in report["rows"]}
    assert set(check_auto.GRID) <= shapes
    assert report["all_equal"] and all(r["equal"] for r in report["rows"])
    if report["choice"] is not None:
        assert [r for r in report["rows"] if r["chosen"]] and 0 < report["chosen_over_best"]
    assert "chosen / best" in out.with_suffix(".md").read_text()


def test_check_auto_needs_held_out_questions(tiny_checkpoint, tmp_path, capsys):
    checkpoint, questions = tiny_checkpoint
    with pytest.raises(SystemExit, match="no question outside the first 16"):
        check_auto.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions),
                         "--max_new_tokens", "4", "--passes", "1"])
