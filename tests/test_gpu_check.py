"""scripts/gpu_check.sh, as far as a machine without a GPU can check it: its syntax and arguments,
the GGUF's trip in parts (split here, join there, a damaged part refused), and a dry run in which
every stage's command parses its arguments."""
import json
import os
import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gpu_check(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "SPLIT_PYTHON": sys.executable, **env})


def test_syntax_and_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    usage = gpu_check()
    assert usage.returncode == 2 and "gpu_check.sh OUT_DIR" in usage.stderr
    assert gpu_check("--help").returncode == 0
    unknown = gpu_check("--fast", "out")
    assert unknown.returncode == 2 and "unknown option --fast" in unknown.stderr
    assert gpu_check("--split", "a", "b").returncode == 2
    assert gpu_check("--checkpoint", "a").returncode == 2


def test_split_and_join_a_file_in_parts(tmp_path):
    original = tmp_path / "src" / GGUF_NAME
    original.parent.mkdir()
    original.write_bytes(os.urandom(2_500_000))
    env = dict(GPU_CHECK_PARTS=str(tmp_path / "dl" / "parts"), GPU_CHECK_PART_SIZE="1M")
    split = gpu_check("--split", str(original), **env)
    assert split.returncode == 0, split.stderr
    parts = tmp_path / "dl" / "parts"
    assert sorted(p.name for p in parts.glob("*.part-*")) == [f"{GGUF_NAME}.part-0{i}" for i in range(3)]
    assert (parts / "python" / "gguf" / "__init__.py").is_file()  # the converter's reader travels along
    joined = gpu_check("--join", **env)
    assert joined.returncode == 0, joined.stderr
    assert (tmp_path / "dl" / GGUF_NAME).read_bytes() == original.read_bytes()
    # a part cut short: refused, nothing left behind that a rerun could take for the file
    (tmp_path / "dl" / GGUF_NAME).unlink()
    last = parts / f"{GGUF_NAME}.part-02"
    last.write_bytes(last.read_bytes()[:-1])
    broken = gpu_check("--join", **env)
    assert broken.returncode != 0 and "checksum differs" in broken.stderr
    assert not list((tmp_path / "dl").glob(GGUF_NAME + "*"))


def test_dry_run_parses_every_stage(tiny_hf_checkpoint, tmp_path):
    from convert_hf_checkpoint import convert_hf

    checkpoint = convert_hf(tiny_hf_checkpoint("qwen2"))
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi.", "Again."]}) + "\n")
    out = tmp_path / "out"
    run = gpu_check("--dry_run", str(out), SMOLLM2_CHECKPOINT=str(checkpoint), MT_BENCH_QUESTIONS=str(questions))
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["details.tar.gz", "gpu_check.log", "summary.md"]
    log = (out / "gpu_check.log").read_text()
    for name in ("stage1-pytest", "random-llama-2-7b-bf16", "random-llama-3.1-8b-bf16", "random-llama-2-7b-int8",
                 "random-llama-2-7b-int4-g32", "mt_bench-smollm2-bf16-invariant", "mt_bench-smollm2-fp32-eager"):
        assert f"{name}: done" in log, name
    assert "FAILED" not in log
    assert "tests collected" in log  # stage 1 found the CUDA tests

