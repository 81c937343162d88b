"""scripts/benchmark.py end to end on a tiny checkpoint (MT-bench mode, with and without the
transformers peers, and random-weights mode), and generate.py's --tree_tokens auto: the pure decision rule on made-up cost curves, the
measurement it reads, and the fallback to vanilla decoding."""
import argparse
import importlib.util
import json
import sys

import pytest
import torch

import generate as gen
import speculative
from checkpoint import save_draft
from conftest import ROOT, mirrored_pair, torchrun

spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts/benchmark.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)



def test_mt_bench_end_to_end(tiny_checkpoint, tmp_path):
    checkpoint, questions = tiny_checkpoint
    out = tmp_path / "results" / "tiny"
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions),
                         "--num_questions", "2", "--max_new_tokens", "24", "--device", "cpu",
                         "--out", str(out), "--tree_tokens", "12"])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["records"] == json.loads(json.dumps(report["records"]))
    # --num_questions 2 takes one question from each category
    assert saved["questions"] == 2 and {a["question_id"] for a in saved["answers"]} == {1, 2}
    records = saved["records"]
    overall = {(r["method"], r["temperature"]): r for r in records if r["category"] == "overall"}
    assert set(overall) == {(m, T) for m in bench.METHODS for T in (0.0, 1.0)}
    for r in records:
        for field in ("hardware", "model", "method", "temperature", "tokens_per_s", "speedup", "mean_accepted",
                      "equal_to_vanilla", "peak_memory_gb", "rounds", "tokens", "seconds", "date", "command"):
            assert field in r, field
        assert r["model"] == checkpoint.parent.name and r["tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / overall["vanilla", r["temperature"]]["tokens_per_s"]) \
            if r["category"] == "overall" else r["speedup"] > 0
        if r["temperature"] == 0:
            assert r["equal_to_vanilla"] == 1.0  # lossless: every answer equals vanilla's
        else:
            assert r["equal_to_vanilla"] is None
    # every answer: 2 questions x 2 turns x 5 methods x 2 temperatures
    assert len(saved["answers"]) == 40
    assert {r["category"] for r in records} == {"overall", "writing", "coding"}
    # the mirrored draft is mostly right: rounds emit several tokens; vanilla's tau is 1 by definition
    assert overall["vanilla", 0.0]["mean_accepted"] == 1.0
    for method in ("chain", "eagle", "eagle2"):
        r = overall[method, 0.0]
        assert r["mean_accepted"] > 2 and r["rounds"] < r["tokens"]
    assert overall["eagle2", 0.0]["tree_tokens"] == 12 and overall["eagle", 0.0]["tree_tokens"] == 26
    assert overall["eagle3", 0.0]["tree_tokens"] == 12 and "depth 8" in saved["methods"]["eagle3"]
    markdown = out.with_suffix(".md").read_text()
    assert "| eagle2 | 0 |" in markdown and "| coding | 1 |" in markdown and saved["command"] in markdown
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mt_bench_tree_tokens_auto(tiny_checkpoint, tmp_path, monkeypatch):
    """eagle2 with --tree_tokens auto, per temperature: a tree where rounds are cheap, vanilla
    decoding where they are not (costs made up; the measurement itself is tested below)."""
    checkpoint, questions = tiny_checkpoint
    costs = {0.0: (1.0, {8: (1.2, 3.0), 16: (1.3, 4.0)}), 1.0: (1.0, {8: (5.0, 1.5)})}
    monkeypatch.setattr(speculative, "measure_tree_costs", lambda *a, temperature, **k: costs[temperature])
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--num_questions", "1",
                         "--max_new_tokens", "12", "--device", "cpu", "--methods", "eagle2", "--tree_tokens", "auto",
                         "--no_plot", "--out", str(tmp_path / "auto")])
    overall = {(r["method"], r["temperature"]): r for r in report["records"] if r["category"] == "overall"}
    assert set(overall) == {(m, T) for m in ("vanilla", "eagle2") for T in (0.0, 1.0)}
    assert overall["eagle2", 0.0]["tree_tokens"] == 16 and overall["eagle2", 0.0]["mean_accepted"] > 2
    assert overall["eagle2", 0.0]["equal_to_vanilla"] == 1.0
    assert overall["eagle2", 1.0]["tree_tokens"] is None and overall["eagle2", 1.0]["mean_accepted"] == 1.0
    assert "T=1: vanilla decoding" in report["methods"]["eagle2"]


def test_random_weights_mode(tmp_path):
    out = tmp_path / "random"
    common = ["--random_weights", "--model_name", "tiny-llama", "--device", "cpu", "--steps", "2", "--prompt_length", "8",
              "--tree_sizes", "32", "16", "--tree_tokens", "16", "--tau", "3", "4"]
    report = bench.main(common + ["--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text())["copy_gb_s"] == report["copy_gb_s"] > 0
    v = report["vanilla"]
    assert v["tokens_per_s"] > 0 and v["gb_s"] == pytest.approx(report["weight_bytes_per_token"] * v["tokens_per_s"] / 1e9)
    # every method, the headline size (--tree_tokens) first, then the other sizes; eager on a CPU
    assert [(r["method"], r["tree_tokens"]) for r in report["rounds"]] == [
        ("eagle2", 16), ("eagle3", 16), ("eagle", 26), ("eagle2", 32), ("eagle3", 32)]
    assert {r["timing"] for r in report["rounds"]} == {"eager"} and report["skipped"] == []
    assert len(report["predicted"]) == 2 * 5
    for p in report["predicted"]:
        r = next(r for r in report["rounds"] if (r["method"], r["tree_tokens"]) == (p["method"], p["tree_tokens"]))
        assert p["speedup"] == pytest.approx(p["tau"] / r["cost_vs_step"])
    assert "## (c) predicted speedup" in out.with_suffix(".md").read_text()
    # a quantized target, and a time budget that leaves the rounds out: they are listed as such
    small = bench.main(common + ["--out", str(tmp_path / "int8"), "--quantize", "int8", "--methods", "eagle2",
                                 "--time_budget", "0"])
    assert small["rounds"] == [] and [(r["method"], r["tree_tokens"]) for r in small["skipped"]] == [("eagle2", 16),
                                                                                                   ("eagle2", 32)]
    assert small["quantize"] == "int8" and small["weight_bytes_per_token"] < report["weight_bytes_per_token"] / 3
    assert "Left out by --time_budget: eagle2 16, eagle2 32" in (tmp_path / "int8.md").read_text()


def test_dry_run_checks_the_arguments_only(tmp_path, capsys):
    """scripts/gpu_check.sh --dry_run: every stage's command parses on a machine without a GPU."""
    assert bench.main(["--random_weights", "--model_name", "llama-3.1-8b", "--device", "cuda", "--compile",
                       "--quantize", "int4", "--time_budget", "90", "--out", str(tmp_path / "x"), "--dry_run"]) is None
    assert "rounds of eagle2 60, eagle3 60, eagle 26, eagle2 16" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing was written
    with pytest.raises(SystemExit):
        bench.main(["--random_weights", "--model_name", "llama-2-7b", "--tree_tokens", "auto", "--dry_run"])
    assert "give --tree_tokens a number" in capsys.readouterr().err


def test_random_weights_tensor_parallel_timing_runs(tmp_path):
    """--tp_timing under torchrun, two ranks: rank 0 writes the report, which records the tensor
    parallelism, each rank's weights and the step's breakdown (the code path only; the times
    themselves are for a quiet machine, benchmarks/README.md)."""
    out = tmp_path / "tp"
    result = torchrun(2, "scripts/benchmark.py", "--random_weights", "--model_name", "tiny-llama", "--device", "cpu",
                      "--steps", 2, "--prompt_length", 8, "--tree_sizes", 6, "--tree_tokens", 6, "--tree_top_k", 2,
                      "--tree_depth", 2, "--methods", "eagle2", "--tp_timing", "--out", out)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["tensor_parallel"] == 2 and 0 < report["weight_bytes_per_rank"]
    t = report["tp_timing"]
    assert t["all_reduces_per_step"] == 4 and t["all_reduce_bytes"] == 64 * 4  # 2 per layer, dim float32 values
    assert {"step_ms", "step_without_all_reduces_ms", "all_reduces_ms", "overhead_ms"} <= set(t)
    assert "## (d) where a tensor-parallel step's time goes (2 ranks" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--random_weights", "--model_name", "tiny-llama", "--tp_timing"], "--tp_timing times a tensor-parallel step"),
    (["--methods", "eagle2"], "need an EAGLE-1/2 head"),
    (["--random_weights"], "--random_weights needs --model_name"),
    (["--random_weights", "--model_name", "no-such-model"], "unknown model name"),
    (["--tree_tokens", "many"], "expected a number of tree nodes or 'auto'"),
    (["--temperatures", "-1"], "--temperatures must be >= 0"),
    (["--random_weights", "--model_name", "tiny-llama", "--peers"], "--peers adds rows to the MT-bench run"),
    (["--methods", "vanilla", "--peers", "--prompt_lookup_num_tokens", "0"], "--prompt_lookup_num_tokens must be >= 1"),
    (["--methods", "eagle3"], "need an EAGLE-3 head"),
    (["--time_budget", "-5"], "--time_budget must be >= 0"),
])
def test_bad_flags_are_clear_errors(tiny_checkpoint, tmp_path, capsys, args, message):
    checkpoint, questions = tiny_checkpoint
    for head in ("eagle", "eagle3"):  # no heads beside the checkpoint
        (checkpoint.parent / head).rename(tmp_path / f"moved-{head}")
    with pytest.raises(SystemExit) as e:
        bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--device", "cpu",
                    "--out", str(tmp_path / "x"), *args])
    assert e.value.code != 0 and message in capsys.readouterr().err


def test_mt_bench_time_budget_stops_asking(tiny_checkpoint, tmp_path):
    checkpoint, questions = tiny_checkpoint
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--methods", "vanilla",
                         "--num_questions", "2", "--max_new_tokens", "4", "--device", "cpu", "--no_plot",
                         "--time_budget", "0", "--out", str(tmp_path / "budget")])
    assert report["questions"] == 1 and report["questions_left_out"] == 1  # the first question is always asked
    assert {a["question_id"] for a in report["answers"]} == {1}
    assert "(1 more left out by --time_budget)" in (tmp_path / "budget.md").read_text()


def test_bad_question_file_is_a_clear_error(tiny_checkpoint, tmp_path, capsys):
    checkpoint, _ = tiny_checkpoint
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["fine"]}\n{"question_id": 2, "prompt": "no turns"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: expected a JSON object with a non-empty list of strings"):
        bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(bad), "--methods", "vanilla",
                    "--device", "cpu", "--no_plot", "--out", str(tmp_path / "x")])


def test_missing_matplotlib_is_a_clear_error_before_the_run(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    checkpoint, questions = tiny_checkpoint
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    argv = ["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--methods", "vanilla",
            "--device", "cpu", "--max_new_tokens", "4", "--out", str(tmp_path / "x")]
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert "the PNG plot needs matplotlib: pip install -r requirements-dev.txt" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    bench.main(argv + ["--no_plot"])  # runs without it
    assert (tmp_path / "x.json").exists() and not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------
# --peers: transformers on the same checkpoint and prompts
# ---------------------------------------------------------------------------------------------
def test_peers_end_to_end(tiny_checkpoint, tmp_path):
    """hf and hf_prompt_lookup rows beside vanilla at both temperatures; --methods vanilla needs
    no draft, with or without the peers."""
    import transformers

    checkpoint, questions = tiny_checkpoint
    (checkpoint.parent / "eagle").rename(tmp_path / "moved")
    out = tmp_path / "peers"
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--num_questions", "2",
                         "--max_new_tokens", "24", "--device", "cpu", "--methods", "vanilla", "--peers", "--out", str(out)])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["transformers"] == transformers.__version__
    overall = {(r["method"], r["temperature"]): r for r in saved["records"] if r["category"] == "overall"}
    assert set(overall) == {(m, T) for m in ("vanilla", *bench.PEERS) for T in (0.0, 1.0)}
    assert {r["category"] for r in saved["records"] if r["method"] == "hf"} == {"overall", "writing", "coding"}
    assert len(saved["answers"]) == 2 * 2 * 3 * 2  # questions x turns x methods x temperatures
    for (method, T), r in overall.items():
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["tree_tokens"] is None
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / overall["vanilla", T]["tokens_per_s"])
        # float32 on the same weights: transformers' greedy answers are ours, token for token
        assert r["equal_to_vanilla"] == (1.0 if T == 0 else None)
    # plain generate: one forward per token, counted, not assumed
    assert overall["hf", 0.0]["mean_accepted"] == overall["hf", 1.0]["mean_accepted"] == 1.0
    assert overall["hf_prompt_lookup", 0.0]["mean_accepted"] >= 1.0
    markdown = out.with_suffix(".md").read_text()
    assert f"transformers {transformers.__version__}" in markdown
    assert "| hf | 0 |" in markdown and "| hf_prompt_lookup | 1 |" in markdown and "prompt_lookup_num_tokens 10" in markdown
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["methods"].keys() == {"vanilla", *bench.PEERS}


@torch.no_grad()
def test_prompt_lookup_peer_counts_its_forwards(monkeypatch):
    """On a prompt that the tiny model continues by repeating it, prompt lookup's guesses are
    accepted: fewer forwards than tokens, each counted by a hook on the transformers model, and
    the answer is still greedy vanilla's."""
    import convert_hf_checkpoint

    target, _ = mirrored_pair()
    forwards, build = [], convert_hf_checkpoint.hf_model_from_ours

    def counted(model):
        hf = build(model)
        hf.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
        return hf

    monkeypatch.setattr(convert_hf_checkpoint, "hf_model_from_ours", counted)
    args = argparse.Namespace(device="cpu", temperatures=[0.0], prompt_lookup_num_tokens=10)
    decoders = bench.build_peers(args, target, stop_ids=())
    prompt = gen.generate(target, torch.tensor([[5, 7, 11]]), 24)[0]  # the greedy answer loops
    expected = gen.generate(target, torch.tensor([prompt]), 24)[0]
    ids, per_round = decoders["hf_prompt_lookup", 0.0](prompt, 24)
    assert ids == expected and len(forwards) == 1 + len(per_round) < len(ids)
    assert sum(per_round) < len(ids) and max(per_round) > 1
    forwards.clear()
    ids, per_round = decoders["hf", 0.0](prompt, 24)
    assert ids == expected and per_round == [1] * 23 and len(forwards) == 24


def test_missing_transformers_is_a_clear_error_before_the_run(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    checkpoint, questions = tiny_checkpoint
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(SystemExit):
        bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--methods", "vanilla",
                    "--peers", "--device", "cpu", "--no_plot", "--out", str(tmp_path / "x")])
    assert "--peers needs transformers: pip install -r requirements-dev.txt" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------------------------
# --tree_tokens auto
# ---------------------------------------------------------------------------------------------
def test_auto_rule_picks_vanilla_when_verify_is_expensive():
    # a CPU: the cost of a round grows with the tree; 3-4 tokens per round do not pay for it
    cpu = {8: (2.5, 2.2), 16: (4.0, 3.0), 32: (8.0, 3.5), 64: (16.0, 4.0)}
    choice, predicted = speculative.choose_tree_tokens(1.0, cpu)
    assert choice is None and max(predicted.values()) < 1
    # a close call is not worth it: 1.05x predicted is within the margin
    assert speculative.choose_tree_tokens(1.0, {16: (2.0, 2.1)})[0] is None
    assert speculative.choose_tree_tokens(1.0, {})[0] is None


def test_auto_rule_picks_the_fastest_tree_when_verify_is_cheap():
    # a GPU bound by reading the weights: verifying 64 tokens costs little more than one
    gpu = {16: (1.10, 3.0), 32: (1.15, 3.6), 64: (1.30, 4.2), 128: (2.00, 4.5)}
    choice, predicted = speculative.choose_tree_tokens(1.0, gpu)
    assert choice == 64 and predicted[64] == pytest.approx(4.2 / 1.3)
    # a slow GPU in between: only a small tree pays off
    slow = {4: (1.2, 1.9), 16: (3.0, 3.0), 64: (9.0, 4.0)}
    assert speculative.choose_tree_tokens(1.0, slow)[0] == 4
    # only the ratio of costs matters, not the unit
    assert speculative.choose_tree_tokens(1e-3, {T: (s * 1e-3, tau) for T, (s, tau) in gpu.items()})[0] == 64


@torch.no_grad()
def test_measure_tree_costs_reads_acceptance_and_stops_at_hopeless_sizes(monkeypatch):
    target, draft = mirrored_pair()
    prompt = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    step_s, rounds = speculative.measure_tree_costs(target, draft, prompt, sizes=(64, 8, 1000), tree_top_k=4, tree_depth=4)
    assert step_s > 0 and list(rounds) in ([8], [8, 64])  # smallest first; 1000 > 1 + 4 + 3 * 16 is skipped
    for seconds, tau in rounds.values():
        assert seconds > 0 and 1 <= tau <= 5
    assert rounds[8][1] > 2  # the mirrored draft's guesses are accepted
    # a round that costs more than tree_depth + 1 steps can never win: larger sizes are not measured
    clock = iter(range(0, 10 ** 6, 1))
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: next(clock))  # every timed call takes 1 tick
    step_s, rounds = speculative.measure_tree_costs(target, draft, prompt, sizes=(4, 8, 16), tree_top_k=4, tree_depth=2)
    assert list(rounds) == [4, 8, 16]  # 3 * 1 tick / 1 tick: each size might still win
    monkeypatch.setattr(speculative, "AUTO_MIN_SPEEDUP", 3.5)
    step_s, rounds = speculative.measure_tree_costs(target, draft, prompt, sizes=(4, 8, 16), tree_top_k=4, tree_depth=2)
    assert list(rounds) == [4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
def test_measure_tree_costs_on_cuda_graph_replays():
    """A compiled run on CUDA is measured on CUDA-graph replays of the eager step and rounds: the
    replays must run real rounds, which emit the mirrored draft's accepted guesses."""
    target, draft = (m.cuda() for m in mirrored_pair())
    prompt = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0)).cuda()
    step_s, rounds = speculative.measure_tree_costs(target, draft, prompt, sizes=(8, 16), tree_top_k=4, tree_depth=4,
                                                    cuda_graphs=True)
    assert step_s > 0 and list(rounds) == [8, 16]
    for seconds, tau in rounds.values():
        assert seconds > 0 and 2 < tau <= 5


def _args(**kw):
    defaults = dict(speculate="eagle2", temperature=0.0, top_k=None, top_p=None, compile=False, compile_prefill=False,
                    device="cpu", tree=None, tree_top_k=4, tree_depth=3, tree_tokens="auto")
    return argparse.Namespace(**{**defaults, **kw})


@torch.no_grad()
def test_make_decoder_auto_falls_back_to_vanilla_or_builds_the_chosen_tree(monkeypatch, tmp_path):
    target, draft = mirrored_pair()
    save_draft(draft, tmp_path / "eagle")
    prompt = [5, 7, 11, 13]
    expected = gen.generate(target, torch.tensor([prompt]), 20)[0]
    monkeypatch.setattr(speculative, "measure_tree_costs", lambda *a, **k: (1.0, {8: (5.0, 2.0), 16: (9.0, 3.0)}))
    args = _args(draft_checkpoint_path=tmp_path / "eagle")
    decode = gen.make_decoder(args, target, (), 64, prompt)
    assert args.speculate == "none" and args.tree_tokens is None
    ids, per_round = decode(prompt, 20)
    assert ids == expected and per_round is None  # vanilla decoding
    monkeypatch.setattr(speculative, "measure_tree_costs", lambda *a, **k: (1.0, {8: (1.2, 3.0), 16: (1.3, 4.0)}))
    args = _args(draft_checkpoint_path=tmp_path / "eagle")
    decode = gen.make_decoder(args, target, (), 64, prompt)
    assert args.speculate == "eagle2" and args.tree_tokens == 16
    ids, per_round = decode(prompt, 20)
    assert ids == expected and per_round is not None


def test_vanilla_decoder_uses_the_compiled_step(monkeypatch):
    """make_decoder must call the step function compile_decoding installed, not generate()'s default."""
    target, _ = mirrored_pair()
    calls = []
    step = gen.decode_one_token
    monkeypatch.setattr(gen, "decode_one_token", lambda *a: calls.append(1) or step(*a))
    decode = gen.make_decoder(_args(speculate="none", tree_tokens=60), target, (), 32)
    ids, _ = decode([1, 2, 3], 5)
    assert len(ids) == 5 and len(calls) == 4


def test_generate_cli_rejects_auto_for_the_static_tree(capsys):
    with pytest.raises(SystemExit):
        gen.parse_args(["--speculate", "eagle", "--tree_tokens", "auto", "--draft_checkpoint_path", str(ROOT)])
    assert "--tree_tokens auto sizes the dynamic trees of eagle2 and eagle3" in capsys.readouterr().err
