"""research/profile_round.py on the tiny checkpoint: every phase of a round gets a row, and the
phases account for the round."""
import json
from pathlib import Path

import pytest

import profile_round


@pytest.mark.parametrize("speculate, extra", [("eagle2", []), ("eagle3", ["--draft_dtype", "bfloat16"])])
def test_profile_round_tiny(tiny_checkpoint, tmp_path, speculate, extra):
    checkpoint, _ = tiny_checkpoint
    out = tmp_path / "profile"
    profile_round.main(["--checkpoint_path", str(checkpoint), "--speculate", speculate, "--dtype", "float32",
                        "--tree_top_k", "4", "--tree_depth", "3", "--tree_tokens", "8", "--rounds", "4",
                        "--out", str(out), *extra])
    report = json.loads(Path(str(out) + ".json").read_text())
    rows = {r["part"].split(":")[0].split(" (")[0]: r["ms"] for r in report["eager"]["rows"]}
    assert {"catch-up", "tree level 1", "tree level 2", "tree growth, total", "verify", "accept"} <= set(rows)
    assert all(ms >= 0 for part, ms in rows.items() if part != "between the phases")
    assert rows["tree growth, total"] >= rows["tree level 1"] + rows["tree level 2"]
    assert report["draft_dtype"] == ("bfloat16" if extra else "float32")
    assert "tree growth, total" in Path(str(out) + ".md").read_text()


def test_draft_dtype_is_for_eagle3_heads(tiny_checkpoint, tmp_path):
    checkpoint, _ = tiny_checkpoint
    with pytest.raises(SystemExit):
        profile_round.main(["--checkpoint_path", str(checkpoint), "--speculate", "eagle2", "--draft_dtype",
                            "bfloat16", "--out", str(tmp_path / "p")])
