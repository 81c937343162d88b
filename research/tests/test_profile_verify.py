"""research/profile_verify.py on the tiny checkpoint: a row per T with its time in plain steps, the
GEMMs' FLOPs growing with T, and kernels that account for the profiled time."""
import json
from pathlib import Path

import pytest

import profile_verify


def test_profile_verify_tiny(tiny_checkpoint, tmp_path):
    checkpoint, _ = tiny_checkpoint
    out = tmp_path / "verify"
    profile_verify.main(["--checkpoint_path", str(checkpoint), "--dtype", "float32", "--no-batch_invariant",
                         "--tokens", "1", "3", "--prefix", "20", "--context", "64", "--repeats", "2", "--out", str(out)])
    report = json.loads(Path(str(out) + ".json").read_text())
    one, three = report["rows"]
    assert (one["tokens"], three["tokens"]) == (1, 3) and report["step_ms"] == one["ms"] > 0
    assert three["gemm_gflop"] == pytest.approx(3 * one["gemm_gflop"]) and three["weight_gb"] == one["weight_gb"]
    for row in report["rows"]:
        assert row["kernels"] and sum(row["groups_ms"].values()) == pytest.approx(row["profiled_ms"])
    assert "| 3 |" in Path(str(out) + ".md").read_text()


def test_bad_arguments_are_refused(tmp_path):
    for bad in (["--tokens", "0"], ["--prefix", "500"]):
        with pytest.raises(SystemExit):
            profile_verify.parse_args([*bad, "--out", str(tmp_path / "p")])
