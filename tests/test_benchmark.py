"""scripts/benchmark.py end to end on a tiny checkpoint: MT-bench mode, with and without the
transformers peers, and random-weights mode."""
import argparse
import importlib.util
import json
import sys

import pytest
import torch

import autoshape
import compiling
import generate as gen
import packages
from conftest import ROOT, mirrored_pair, tiny_config_file, torchrun
from test_autoshape import chain_probes

spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts/benchmark.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)



def test_eager_float32_baseline_row(tiny_checkpoint, tmp_path):
    """--eager_float32: plain decoding eager in float32, a row of the same run (here, eager float32
    anyway: the same tokens as vanilla at T=0)."""
    checkpoint, questions = tiny_checkpoint
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--methods",
                         "vanilla", "--num_questions", "1", "--max_new_tokens", "16", "--device", "cpu",
                         "--temperatures", "0", "--eager_float32", "--no_plot", "--out", str(tmp_path / "b")])
    rows = {r["method"]: r for r in report["records"] if r["category"] == "overall"}
    assert set(rows) == {"vanilla", bench.EAGER_FLOAT32} and rows[bench.EAGER_FLOAT32]["equal_to_vanilla"] == 1.0
    assert "float32" in report["methods"][bench.EAGER_FLOAT32]
    step = report["decode_step"]  # the plain step's bandwidth against a copy's, in the same run
    assert step["step_ms"] > 0 and step["copy_gb_s"] > 0 and step["fraction_of_copy"] == step["gb_s"] / step["copy_gb_s"]


@pytest.mark.all_threads
def test_batch_invariant_run_is_equal_and_times_the_plain_decoding_it_replaces(tiny_checkpoint, tmp_path):
    """--batch_invariant (bf16): every speculative answer equals the invariant vanilla's at T=0,
    and a row of plain decoding without the mode (its own copy of the weights) prices the mode."""
    checkpoint, questions = tiny_checkpoint
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--methods",
                         "vanilla", "eagle2+lookup", "--tree_tokens", "12", "--num_questions", "2",
                         "--max_new_tokens", "24", "--device", "cpu", "--temperatures", "0", "--batch_invariant",
                         "--no_plot", "--out", str(tmp_path / "b")])
    rows = {r["method"]: r for r in report["records"] if r["category"] == "overall"}
    assert set(rows) == {"vanilla", "eagle2+lookup", bench.NOT_INVARIANT}
    assert rows["eagle2+lookup"]["equal_to_vanilla"] == 1.0 and rows["eagle2+lookup"]["mean_accepted"] > 1
    assert report["dtype"] == "bfloat16" and report["batch_invariant"]
    assert "batch-invariant target" in (tmp_path / "b.md").read_text()


def test_plain_rows_compile_their_step_as_vanilla_is(monkeypatch):
    """--batch_invariant --compile: the row without the mode is priced against a step compiled with
    vanilla's options (CUDA graphs on CUDA), both through plain_decoders; a step compiled without
    them would run several times slower and overstate the mode's gain."""
    target, _ = mirrored_pair()
    seen = []
    monkeypatch.setattr(compiling, "compile_function", lambda fn, device, modules, **kw: seen.append((device, kw)) or fn)
    args = argparse.Namespace(device="cuda", compile_prefill=False, temperatures=[0.0])
    for name in ("vanilla", bench.NOT_INVARIANT):
        decoders, step = bench.plain_decoders(args, target, (), name, compiled=True)
        assert set(decoders) == {(name, 0.0)} and step is gen.decode_one_token  # compile_function stubbed
    assert len(seen) == 2 and seen[0] == seen[1] and seen[1][1]["options"]["triton.cudagraphs"]


def test_compiled_mt_bench_packages_greedy_rounds_only(tiny_checkpoint, tmp_path, monkeypatch):
    """--compile on a CPU: the greedy rounds (their round, plain step and flush) and vanilla's greedy steps go
    through packages.py as generate.py's do, the sampled ones through torch.compile; here both run eagerly
    (the packages' wrappers with their state as inputs, compile_function stubbed) and greedy answers equal
    vanilla's."""
    built, compiled = [], []

    def record(self, args, state):
        built.append(self.name)
        return self.bound
    monkeypatch.setattr(packages.Packaged, "load_or_build", record)
    monkeypatch.setattr(compiling, "compile_function", lambda fn, device, modules, **kw: compiled.append(fn) or fn)
    checkpoint, questions = tiny_checkpoint
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--methods",
                         "vanilla", "eagle2+lookup", "--tree_tokens", "8", "--num_questions", "1", "--max_new_tokens",
                         "16", "--device", "cpu", "--dtype", "float32", "--compile", "--temperatures", "0", "1",
                         "--no_plot", "--out", str(tmp_path / "c")])
    assert set(built) == {"step", "round", "plain_step", "flush"} and compiled  # T=1's round and vanilla step
    rows = {(r["method"], r["temperature"]): r for r in report["records"] if r["category"] == "overall"}
    assert rows["eagle2+lookup", 0.0]["equal_to_vanilla"] == 1.0


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
    # every answer: 2 questions x 2 turns x 8 methods x 2 temperatures
    assert len(saved["answers"]) == 2 * 2 * len(bench.METHODS) * 2 == 64
    assert {r["category"] for r in records} == {"overall", "writing", "coding"}
    # the mirrored draft is mostly right: rounds emit several tokens; vanilla's tau is 1 by definition
    assert overall["vanilla", 0.0]["mean_accepted"] == 1.0
    for method in ("chain", "eagle", "eagle2"):
        r = overall[method, 0.0]
        assert r["mean_accepted"] > 2 and r["rounds"] < r["tokens"]
    assert overall["eagle2", 0.0]["tree_tokens"] == 12 and overall["eagle", 0.0]["tree_tokens"] == 26
    assert overall["eagle3", 0.0]["tree_tokens"] == 12 and "depth 8" in saved["methods"]["eagle3"]
    # lookup alone guesses 10 tokens a round; the hybrids add 8 lookup nodes to the 12-token tree
    assert overall["lookup", 0.0]["tree_tokens"] == 11 and overall["eagle2+lookup", 0.0]["tree_tokens"] == 20
    assert "decoded adaptively" in saved["methods"]["eagle3+lookup"]
    # plain steps only where the driver may take them; tau over the rounds alone is never below the
    # tau over all forwards (a plain step emits 1 token)
    for (method, T), r in overall.items():
        if method in bench.ADAPTIVE:
            assert r["round_tau"] >= r["mean_accepted"] and 0 <= r["plain_steps"] < r["rounds"]
        elif method != "vanilla":
            assert r["plain_steps"] == 0 and r["round_tau"] == pytest.approx(r["mean_accepted"])
    markdown = out.with_suffix(".md").read_text()
    assert "| eagle2 | 0 |" in markdown and "| coding | 1 |" in markdown and saved["command"] in markdown


def test_mt_bench_tree_tokens_auto(tiny_checkpoint, tmp_path, monkeypatch):
    """eagle2 with --tree_tokens auto, per temperature: a tree where rounds are cheap, vanilla
    decoding where they are not (costs made up; the measurement itself is tested above)."""
    checkpoint, questions = tiny_checkpoint
    monkeypatch.setenv("EAGLE_AUTO_CACHE", str(tmp_path / "cache"))
    cheap = autoshape.ShapeCosts(step=1.0, verify={T: 0.5 + 0.1 * T for T in autoshape.AUTO_TOKENS},
                                 grow={k: (0.05, 0.05) for k in autoshape.AUTO_TOP_K}, other=0.1)
    costs = {0.0: cheap, 1.0: cheap._replace(verify={T: 8.0 for T in autoshape.AUTO_TOKENS})}
    monkeypatch.setattr(autoshape, "measure_shapes", lambda *a, temperature, **k: (
        costs[temperature], {k: chain_probes(k, 8, accepted_len=5) for k in autoshape.AUTO_TOP_K}))
    report = bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--num_questions", "1",
                         "--max_new_tokens", "12", "--device", "cpu", "--methods", "eagle2", "--tree_tokens", "auto",
                         "--no_plot", "--out", str(tmp_path / "auto")])
    overall = {(r["method"], r["temperature"]): r for r in report["records"] if r["category"] == "overall"}
    assert set(overall) == {(m, T) for m in ("vanilla", "eagle2") for T in (0.0, 1.0)}
    assert overall["eagle2", 0.0]["tree_tokens"] == 6 and overall["eagle2", 0.0]["mean_accepted"] > 2
    assert overall["eagle2", 0.0]["equal_to_vanilla"] == 1.0
    assert overall["eagle2", 1.0]["tree_tokens"] is None and overall["eagle2", 1.0]["mean_accepted"] == 1.0
    assert "T=0: top_k 4, depth 5, 6 tokens" in report["methods"]["eagle2"]
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
    assert report["timing"] == "eager" and {r["timing"] for r in report["rounds"]} == {"eager"}
    assert report["skipped"] == [] and report["dtype"] == "float32"
    assert len(report["predicted"]) == 2 * 5
    for p in report["predicted"]:
        r = next(r for r in report["rounds"] if (r["method"], r["tree_tokens"]) == (p["method"], p["tree_tokens"]))
        assert p["speedup"] == pytest.approx(p["tau"] / r["cost_vs_step"])
    assert "## (c) predicted speedup" in out.with_suffix(".md").read_text()
    # a quantized target from a JSON config, and a time budget that leaves the rounds out: listed as such
    common[2] = str(tiny_config_file("tiny-llama", tmp_path))
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
    themselves are for a quiet machine: docs/tensor_parallel.md). The tiny config travels as a file."""
    out = tmp_path / "tp"
    config = tiny_config_file("tiny-llama", tmp_path)
    result = torchrun(2, "scripts/benchmark.py", "--random_weights", "--model_name", config, "--device", "cpu",
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
    (["--random_weights", "--model_name", "tiny-llama", "--peers"], "--peers and --batch_invariant are for MT-bench"),
    (["--random_weights", "--model_name", "missing.json"], "--model_name missing.json:"),
    (["--methods", "vanilla", "--peers", "--lookup_alone", "0"], "--lookup_alone must be >= 1"),
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
    args = argparse.Namespace(device="cpu", temperatures=[0.0], lookup_alone=10)  # --peers' guesses: lookup's
    decoders = bench.build_peers(args, target, stop_ids=())
    prompt = gen.generate(target, torch.tensor([[5, 7, 11]]), 24)[0]  # the greedy answer loops
    expected = gen.generate(target, torch.tensor([prompt]), 24)[0]
    ids, counted_forwards = decoders["hf_prompt_lookup", 0.0](prompt, 24)
    per_round = counted_forwards.emitted  # tokens emitted by each forward after prefill
    assert ids == expected and len(forwards) == 1 + len(per_round) < len(ids)
    assert sum(per_round) < len(ids) and max(per_round) > 1 and counted_forwards.plain_steps == 0
    forwards.clear()
    ids, counted_forwards = decoders["hf", 0.0](prompt, 24)
    assert ids == expected and list(counted_forwards.emitted) == [1] * 23 and len(forwards) == 24


def test_missing_transformers_is_a_clear_error_before_the_run(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    checkpoint, questions = tiny_checkpoint
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(SystemExit):
        bench.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions), "--methods", "vanilla",
                    "--peers", "--device", "cpu", "--no_plot", "--out", str(tmp_path / "x")])
    assert "--peers needs transformers: pip install -r requirements-dev.txt" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
