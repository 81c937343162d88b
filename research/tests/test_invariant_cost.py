"""research/invariant_cost.py on the tiny checkpoint (eager, float32, to keep it quick): both targets
are timed, the second really in batch-invariant mode, and the cost is the ratio of their medians."""
import json
from pathlib import Path

import pytest

import invariant
import invariant_cost


def test_invariant_cost_tiny(tiny_checkpoint, tmp_path, monkeypatch):
    checkpoint, _ = tiny_checkpoint
    made = []
    make_target = invariant_cost.make_target
    monkeypatch.setattr(invariant_cost, "make_target", lambda args, batch_invariant: made.append(
        make_target(args, batch_invariant)) or made[-1])
    out = tmp_path / "cost"
    report = invariant_cost.main(["--checkpoint_path", str(checkpoint), "--dtype", "float32", "--tree_top_k", "2",
                                  "--tree_depth", "2", "--tree_tokens", "3", "--turns", "2", "--steps", "3",
                                  "--rounds", "3", "--out", str(out)])
    assert [getattr(t["model"], "invariant_window", None) for t in made] == [None, invariant.WINDOW]
    assert [len(t["ms"]["step"]) for t in made] == [2, 2] and [len(t["ms"]["round"]) for t in made] == [2, 2]
    ms = report["ms"]
    assert report["cost"]["step"] == pytest.approx(ms["batch-invariant"]["step"] / ms["plain"]["step"] - 1)
    assert report["cost"]["round"] == pytest.approx(ms["batch-invariant"]["round"] / ms["plain"]["round"] - 1)
    assert json.loads(Path(str(out) + ".json").read_text())["tree"] == dict(top_k=2, depth=2, tokens=3)
    assert "| decode step |" in Path(str(out) + ".md").read_text()
