"""research/gpu_train_eagle3.sh on a CPU and a tiny checkpoint: its arguments, and the whole run (--prepare
writing the features a later call reads, the probe, continuation epochs each from the head the one
before wrote, the stop when an epoch finds no better head, the heads packed in parts that join into
loadable heads)."""
import json
import os
import re
import subprocess
import sys
import tarfile

import torch

import checkpoint
import train_eagle as te
from conftest import ROOT
from test_train_eagle import eagle3_argv, tiny_eagle3_checkpoint

SCRIPT = ROOT / "research" / "gpu_train_eagle3.sh"


def gpu_train(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable, **env})


def test_syntax_and_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    for bad in ([], ["--help"], ["out", "ten"], ["out", "60", "--lr"], ["--prepare"], ["--prepare", "--prepare"]):
        usage = gpu_train(*bad)
        assert usage.returncode == 2 and "gpu_train_eagle3.sh OUT_DIR [SECONDS]" in usage.stderr


def unpack(parts, into):
    """Parts of a tar file, joined and unpacked."""
    into.mkdir()
    joined = into.with_suffix(".tar")
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        tar.extractall(into, filter="data")
    return into


def test_continuation_epochs_on_a_tiny_checkpoint(tiny_hf_checkpoint, tmp_path, monkeypatch):
    model_path = tiny_eagle3_checkpoint(tiny_hf_checkpoint)
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()))
    head = tmp_path / "head"  # the "shipped" head and its three data shards
    te.main(eagle3_argv(model_path, head, "--tau_prompts", "0", "--epochs", "1"))
    env = dict(SMOLLM2_CHECKPOINT=str(model_path), HEAD=str(head), DATA_DIR=str(tmp_path / "head.work" / "conversations"),
               PRESET="tiny", N_SHARDS="3", PROBE_STEPS="2", MAX_EPOCHS="3", TAU_PROMPTS="1", WORK=str(tmp_path / "work"))
    # --prepare (the call that brings the last GGUF part, where heads/ stays behind): the features,
    # the probe, no epoch
    prepared = gpu_train("--prepare", tmp_path / "prepared", 3000, **{**env, "HEAD": str(tmp_path / "absent")})
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    log = (tmp_path / "prepared" / "train.log").read_text()
    assert "prepared: the features are cached" in log and "epoch 1 from" not in log
    features = sorted((tmp_path / "work" / "features").glob("*.npy"))
    assert len(features) == 3 * 3  # three shards, three arrays each
    written = [f.stat().st_mtime_ns for f in features]
    out = tmp_path / "out"
    run = gpu_train(out, 3000, "--", "--lr", "3e-3", "--warmup_steps", "2", **env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert [f.stat().st_mtime_ns for f in features] == written  # read from the cache, not written again
    log = (out / "train.log").read_text()
    spe = int(re.search(r"probe: (\d+) steps an epoch", log).group(1))
    assert spe > 2
    epochs = re.findall(r"epoch (\d+) from", log)
    assert epochs == [str(e) for e in range(1, len(epochs) + 1)] and 1 <= len(epochs) <= 3
    if len(epochs) < 3:  # it stops early only when an epoch found no better head
        assert f"epoch {len(epochs)}: no better head; stopping" in log
    wrote = "wrote" in log
    assert (out / "head.tar.part-00").is_file() == wrote
    # the last epoch's head, whatever it scored, comes back in parts under 15 MB that join into a head
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    last = unpack(sorted(out.glob("last_epoch.tar.part-*")), tmp_path / "last")
    assert checkpoint.load_draft(last, target.config).draft_vocab_size == 256
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == spe and record["settings"]["lr"] == 3e-3  # the arguments after -- won
    if wrote:
        best = unpack(sorted(out.glob("head.tar.part-*")), tmp_path / "best")
        info = json.loads((best / "training.json").read_text())
        assert info["shipped_step"] is not None
        assert info["init_from"]["dir"] == str(tmp_path / "work" / "init")  # each epoch from the one before
        assert not torch.equal(checkpoint.load_draft(best, target.config).fc.weight,
                               checkpoint.load_draft(head, target.config).fc.weight)
    # The one-cosine form of docs/training.md's GPU recipe: a single run of two epochs,
    # validated at their two ends only, from the cached features.
    cosine = gpu_train(tmp_path / "cosine", 3000, "--", "--epochs", "2", "--eval_every", "0", **{**env, "MAX_EPOCHS": "1"})
    assert cosine.returncode == 0, cosine.stdout + cosine.stderr
    assert len(re.findall(r"epoch \d+ from", (tmp_path / "cosine" / "train.log").read_text())) == 1
    record = json.loads((tmp_path / "cosine" / "training.json").read_text())
    assert record["steps"] == 2 * spe and record["settings"]["epochs"] == 2
    assert [h["step"] for h in record["history"]] == [spe, 2 * spe]
    assert [f.stat().st_mtime_ns for f in features] == written
