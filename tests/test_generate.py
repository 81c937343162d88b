"""generate.py, vanilla decoding: greedy output equals transformers' generate, sampling helpers,
the command line on the real model, and clear errors for bad input."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import checkpoint
import generate as gen
import invariant
import packages
import sampling
from compiling import compile_function
from convert_hf_checkpoint import convert_hf
from conftest import ROOT, tiny_target
from cpu import pack_linears
from quantize_checkpoint import quantize_checkpoint


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@torch.no_grad()
def test_greedy_equals_transformers_generate(tiny_hf_checkpoint, arch):
    folder = tiny_hf_checkpoint(arch)
    model = checkpoint.load_model(convert_hf(folder), "cpu", torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for seed in range(3):
        prompt = torch.randint(0, 512, (1, 5 + 4 * seed), generator=torch.Generator().manual_seed(seed))
        n = 30  # longer than the tiny Mistral's sliding window of 16, with the prompt
        expected = reference.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, prompt.size(1):].tolist()
        assert gen.generate(model, prompt, n)[0] == expected


@torch.no_grad()
def test_stops_at_a_stop_token_and_compiled_matches_eager():
    model = tiny_target()
    prompt = torch.randint(0, 512, (1, 6))
    full = gen.generate(model, prompt, 40)[0]
    assert len(full) == 40
    stop = full[21]  # a token first seen at step 21 stops generation there, the stop token kept
    first = full.index(stop)
    assert gen.generate(model, prompt, 40, stop_ids={stop})[0] == full[:first + 1]
    # Streaming sees exactly the returned tokens.
    seen = []
    gen.generate(model, prompt, 40, stop_ids={stop}, callback=lambda t: seen.append(int(t[0])))
    assert seen == full[:first + 1]
    compiled = torch.compile(gen.decode_one_token, mode="reduce-overhead", fullgraph=True)
    assert gen.generate(model, prompt, 40, decode_fn=compiled)[0] == full
    with pytest.raises(ValueError, match="exceed the context"):  # past the RoPE table the model was built for
        gen.generate(model, prompt, model.config.block_size)


@pytest.mark.autotune
@torch.no_grad()
def test_compiled_frozen_decoding_equals_eager_on_smollm2(smollm2_checkpoint):
    """--compile on a CPU as generate.py does it (frozen weights, max-autotune's C++ GEMM
    templates, SDPA, the KV cache mutated in place): greedy tokens equal eager decoding's, float32.
    The model's first four layers: the real weights and every GEMM shape, at a seventh of the
    compile time of all thirty (the layers are alike; the graph grows with each)."""
    from tokenizer import load_tokenizer

    model = checkpoint.load_model(smollm2_checkpoint / "model.pth", "cpu", torch.float32)
    model.layers, model.config.n_layer = model.layers[:4], 4
    tokenizer = load_tokenizer(smollm2_checkpoint)
    prompts = [torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": text}])])
               for text in ("Name three colours of the rainbow.", "Write one sentence about the moon.")]
    n = 32
    model.setup_caches(1, max(p.size(1) for p in prompts) + n)  # one cache size: one compiled graph
    eager = [gen.generate(model, p, n, stop_ids=tokenizer.stop_ids)[0] for p in prompts]
    step = compile_function(gen.decode_one_token, "cpu", (model,))
    assert [gen.generate(model, p, n, stop_ids=tokenizer.stop_ids, decode_fn=step)[0] for p in prompts] == eager
    assert all(len(ids) > 8 for ids in eager)


def test_logits_to_probs_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = sampling.logits_to_probs(logits, 1.0)
    torch.testing.assert_close(p, torch.softmax(logits, -1))
    top2 = sampling.logits_to_probs(logits, 1.0, top_k=2)
    assert (top2[0, 2:] == 0).all()
    torch.testing.assert_close(top2[0, :2], torch.softmax(logits[0, :2], -1))
    # top_p keeps the smallest prefix reaching the mass: p = [.55, .20, .12, .07, .03] (rounded)
    assert (sampling.logits_to_probs(logits, 1.0, top_p=0.5)[0, 1:] == 0).all()  # the top token alone
    kept = sampling.logits_to_probs(logits, 1.0, top_p=0.7)
    assert (kept[0, :2] > 0).all() and (kept[0, 2:] == 0).all()
    torch.testing.assert_close(kept.sum(-1), torch.ones(1))
    # temperature sharpens
    assert sampling.logits_to_probs(logits, 0.5)[0, 0] > p[0, 0]


def test_sampling_matches_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = sampling.sample_from(probs.expand(200_000, 4))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, probs, atol=5e-3, rtol=0)
    # unnormalised rows with zeros (acceptance's residuals): a zero-probability token is never drawn,
    # even where u * total rounds up to the total
    residual = torch.tensor([[0.0, 0.2, 0.0, 0.1, 0.0]]).expand(100_000, 5)
    draws = sampling.sample_from(residual)
    assert set(draws.tolist()) == {1, 3} and abs((draws == 1).float().mean() - 2 / 3) < 0.01
    almost_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    torch.manual_seed(0)
    original = torch.rand_like
    try:
        torch.rand_like = lambda x: torch.full_like(x, almost_one)
        assert sampling.sample_from(torch.tensor([[0.3, 0.7, 0.0]])).item() == 1
    finally:
        torch.rand_like = original


# ---------------------------------------------------------------------------------------------
# The command line on the real model
# ---------------------------------------------------------------------------------------------
def test_cli_answers_paris_and_stops_at_end_of_turn(smollm2_checkpoint, tmp_path):
    out = tmp_path / "out.json"
    gen.main(["--checkpoint_path", str(smollm2_checkpoint / "model.pth"), "--chat", "--prompt",
              "What is the capital of France?", "--max_new_tokens", "64", "--no-compile", "--output_json", str(out)])
    report = json.loads(out.read_text())
    assert "Paris" in report["text"]
    assert report["token_ids"][-1] == 2 and report["new_tokens"] < 64  # stopped at <|im_end|>
    assert "<|im_end|>" not in report["text"]
    assert report["device"] == "cpu" and report["compiled"] is False and report["tokens_per_s"] > 0
    assert report["prompt_ids"][:1] == [1]  # <|im_start|>: the chat template was applied


def run_cli(*args):
    return subprocess.run([sys.executable, "generate.py", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top_k", "0"], "--top_k must be >= 1"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
    (["--prompt", "@no/such/file.txt"], "--prompt @no/such/file.txt: file not found"),
    (["--tree", "4,3"], "expected auto, TOP_K,DEPTH,TOKENS"),
    (["--tree", "4,3,8"], "--tree TOP_K,DEPTH,TOKENS (or auto) sizes the dynamic trees"),
    (["--speculate", "eagle2", "--tree", "paths.json"], "--tree FILE.json sets the static tree of --speculate eagle"),
    (["--lookup", "-1"], "--lookup must be >= 0"),
    (["--compare"], "--compare puts plain decoding beside --speculate METHOD"),
])
def test_bad_flags_are_clear_errors(args, message, capsys):
    """Refused while the flags are read, before any work (in this process: a Python process for
    each would cost seconds of imports; the next tests run the real command line)."""
    with pytest.raises(SystemExit) as exit:
        gen.parse_args(args)
    assert exit.value.code != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", sorted(gen.REMOVED))
def test_a_removed_flag_names_its_replacement(flag, capsys):
    with pytest.raises(SystemExit):
        gen.parse_args([flag, "1"])
    err = capsys.readouterr().err
    assert f"{flag} was removed: use {gen.REMOVED[flag]}" in err and err.count("\n") <= 3


def test_a_missing_checkpoint_is_a_clear_error():
    result = run_cli("--checkpoint_path", "no/such/model.pth")
    assert result.returncode != 0
    assert "checkpoint not found" in result.stderr and "Traceback" not in result.stderr


def test_prompt_longer_than_the_context_is_a_clear_error(smollm2_checkpoint, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 9000)  # > 8192 tokens
    result = run_cli("--checkpoint_path", str(smollm2_checkpoint / "model.pth"), "--prompt", f"@{prompt}")
    assert result.returncode != 0
    assert "more than the model's context of 8192 tokens" in result.stderr and "Traceback" not in result.stderr


def test_bytes_per_token_counts_packed_linears():
    """model_bytes_per_token is the same once pack_linears has put the linears' weights in oneDNN's
    layout (eager half precision on a CPU), where they are no longer in the state dict."""
    for name in ("tiny-llama", "tiny-qwen2"):
        model = tiny_target(name).to(torch.bfloat16)
        unpacked = gen.model_bytes_per_token(model)
        if not pack_linears(model):
            pytest.skip("this CPU's oneDNN has no bf16 support: pack_linears packs nothing")
        assert gen.model_bytes_per_token(model) == unpacked > 0, name


def test_compare_answers_plainly_then_speculatively(tiny_checkpoint, tmp_path, capsys):
    """--compare: both answers, their speeds and ratio, tau, and equality (float32, greedy: identical)."""
    checkpoint, _ = tiny_checkpoint
    out = tmp_path / "compare.json"
    report = gen.main(["--checkpoint_path", str(checkpoint), "--chat", "--prompt", "Rivers flow to the sea.",
                       "--speculate", "eagle2", "--tree", "10,6,16", "--compare", "--max_new_tokens", "40",
                       "--device", "cpu", "--no-compile", "--output_json", str(out)])
    err = capsys.readouterr().err
    assert report["identical"] and report["plain"]["token_ids"] == report["speculative"]["token_ids"]
    assert report["speculative"]["mean_accepted"] > 2 and report["plain"]["mean_accepted"] == 1.0
    assert report["speedup"] == pytest.approx(report["speculative"]["tokens_per_s"] / report["plain"]["tokens_per_s"])
    assert "the two answers are identical" in err and "tau" in err and "speedup" in err
    assert json.loads(out.read_text())["speedup"] == report["speedup"]


def test_compiled_runs_size_their_graphs_alike_for_prompts_of_any_length(tiny_checkpoint, monkeypatch):
    """A compiled graph has static shapes, the caches' and the round's buffers' among them: two
    compiled runs (--compare: the plain step, the round, its plain step and flush) with prompts of
    different lengths hand the compiler the same shapes, so the second reuses the first's packages
    (packages.py; here run eagerly through the packages' wrappers, their state passed as inputs).
    The cache length is the next power of two from 512, at most the model's context. Every package
    loads in a warm-up, none inside a timed run (device_sync is called around each)."""
    checkpoint, _ = tiny_checkpoint
    compiled, events = [], []

    def record(self, args, state):  # what a package's key depends on besides weights and code: its shapes
        compiled.append((self.name, tuple(tuple(t.shape) for t in (*args, *state))))
        events.append(self.name)
        return self.bound
    monkeypatch.setattr(packages.Packaged, "load_or_build", record)
    monkeypatch.setattr(gen, "device_sync", lambda device: events.append("|"))
    monkeypatch.setattr(gen, "WARM_UP_TOKENS", 6)  # a round and a plain burst: too few for adaptive decoding's own
    runs = []
    for prompt in ("Rivers.", "Rivers flow to the sea, and the sea gives the rain back to the hills. " * 3):
        compiled.clear()
        report = gen.main(["--checkpoint_path", str(checkpoint), "--chat", "--prompt", prompt, "--speculate", "eagle2",
                           "--tree", "4,3,8", "--compare", "--max_new_tokens", "24", "--device", "cpu", "--compile",
                           "--dtype", "float32", "--no-batch_invariant"])
        assert report["identical"]
        runs.append((len(report["prompt_ids"]), sorted(compiled)))
        # main syncs once after loading; then each timed run sits between two syncs
        timed = " ".join(events[1:]).split("|")[1::2]
        assert events[0] == "|" and len(timed) == 2 and not "".join(timed).strip(), events
        events.clear()
    assert runs[0][0] + 40 < runs[1][0] and runs[0][1] == runs[1][1]
    assert {name for name, _ in runs[0][1]} == {"step", "round", "plain_step", "flush"}
    assert [gen.cache_length(n, 8192) for n in (1, 300, 512, 513, 3000)] == [512, 512, 512, 1024, 4096]
    assert gen.cache_length(300, 256) == 256 and gen.cache_length(600, 600) == 600


def test_forwards_report_tau_over_rounds_and_plain_steps_apart():
    """Adaptive decoding's plain steps emit 1 token each: counted as rounds they would drag tau
    towards 1 (a head accepting 2.5 tokens a round read as 1.2). tau is over the rounds alone."""
    rounds_only = gen.Forwards([3, 1, 2])
    assert (rounds_only.rounds, rounds_only.tau) == (3, 2.0)
    assert rounds_only.describe() == "tau 2.00 over 3 rounds"
    mixed = gen.Forwards([3, 1, 1, 1, 1, 2, 1, 4], plain_steps=4)
    assert (mixed.rounds, mixed.plain_steps, mixed.tau) == (4, 4, (3 + 1 + 2 + 4) / 4)
    assert mixed.describe().startswith("tau 2.50 over 4 rounds and 4 plain steps (50% of the forwards")
    assert "1.75 tokens per forward overall" in mixed.describe()
    assert gen.Forwards([1, 1], plain_steps=2).tau is None


@pytest.mark.all_threads
def test_batch_invariant_compare_in_bf16_is_identical_and_bad_settings_are_clear_errors(tiny_checkpoint, capsys,
                                                                                        monkeypatch):
    """--batch_invariant --compare in bf16 (eager): identical answers, and the verdict says so
    without the bf16 near-tie caveat; eager float32/float16 (row-count variant GEMMs) and eager
    trees larger than this CPU's invariant.gemm_invariant_rows are refused with one line, and
    where it is 1 (no tree fits) before --tree auto measures shapes."""
    checkpoint, _ = tiny_checkpoint
    report = gen.main(["--checkpoint_path", str(checkpoint), "--chat", "--prompt", "Rivers flow to the sea.",
                       "--speculate", "eagle2", "--tree", "10,6,16", "--lookup", "4", "--compare",
                       "--max_new_tokens", "40", "--device", "cpu", "--no-compile", "--batch_invariant"])
    err = capsys.readouterr().err
    assert report["dtype"] == "bfloat16" and report["identical"]
    assert "batch-invariant" in err and "the two answers are identical" in err and "nearly tie" not in err
    for bad, message in ((["--dtype", "float32", "--no-compile"], "--batch_invariant in float32 needs --compile"),
                         (["--dtype", "float16", "--no-compile"], "--batch_invariant in float16 needs --compile")):
        with pytest.raises(SystemExit):
            gen.parse_args(["--device", "cpu", "--batch_invariant", *bad])
        assert message in capsys.readouterr().err
    for dtype in ("float32", "float16", "bfloat16"):  # compiled, every dtype holds (tests/test_invariant.py)
        assert gen.parse_args(["--device", "cpu", "--batch_invariant", "--compile", "--dtype", dtype]).batch_invariant
    with pytest.raises(SystemExit, match=r"in trees of over \d+ nodes"):
        gen.main(["--checkpoint_path", str(checkpoint), "--prompt", "Rivers", "--speculate", "eagle2",
                  "--tree", "10,6,70", "--device", "cpu", "--no-compile", "--batch_invariant"])
    monkeypatch.setattr(invariant, "gemm_invariant_rows", lambda model, most: 1)
    monkeypatch.setattr(gen, "auto_tree", lambda *a, **k: pytest.fail("auto_tree ran before the refusal"))
    with pytest.raises(SystemExit, match="round a verify's rows apart from one-token steps for every tree"):
        gen.main(["--checkpoint_path", str(checkpoint), "--prompt", "Rivers", "--speculate", "eagle2",
                  "--tree", "auto", "--device", "cpu", "--no-compile", "--batch_invariant"])


def test_batch_invariant_on_cuda_takes_every_dtype_and_quantized_files_and_refuses_torchrun():
    """On CUDA the mode runs on gpu_kernels/invariant.py in every dtype, eager or compiled, int8 and int4
    files too (tests/test_invariant_kernels.py); torchrun is refused in one line."""
    for dtype in ("bfloat16", "float16", "float32"):
        for compile in (False, True):
            for quantized in (None, "int8", "int4"):
                assert invariant.problem("cuda", dtype, compile, quantized, False) is None
    assert "not --device mps" in invariant.problem("mps", "bfloat16", True, None, False)
    assert "not under torchrun" in invariant.problem("cuda", "bfloat16", True, None, True)


@pytest.mark.all_threads
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_batch_invariant_with_quantized_checkpoints_is_identical(tiny_checkpoint, capsys, mode):
    """int8 and int4 files in batch-invariant mode (eager, bf16): trees of 32 nodes (28 + 4 lookup), where a plain
    int8 layer would switch from torch's int8 kernel (up to 16 rows) to a cast weight, give the
    same answer as plain decoding. Compiled, they hold too (tests/test_quantize.py); in another
    dtype than bfloat16 they are refused."""
    checkpoint, _ = tiny_checkpoint
    quantized = quantize_checkpoint(checkpoint, mode)
    report = gen.main(["--checkpoint_path", str(quantized), "--chat", "--prompt", "Rivers flow to the sea.",
                       "--speculate", "eagle2", "--tree", "10,6,28", "--lookup", "4", "--compare",
                       "--max_new_tokens", "40", "--device", "cpu", "--no-compile", "--batch_invariant"])
    err = capsys.readouterr().err
    assert report["dtype"] == "bfloat16" and report["identical"] and report["speculative"]["mean_accepted"] > 1
    assert "batch-invariant" in err and "the two answers are identical" in err
    assert gen.parse_args(["--checkpoint_path", str(quantized), "--device", "cpu", "--batch_invariant", "--compile"])
    with pytest.raises(SystemExit):
        gen.parse_args(["--checkpoint_path", str(quantized), "--device", "cpu", "--batch_invariant", "--compile",
                        "--dtype", "float32"])
    assert "with a quantized file is built for bfloat16, not float32" in capsys.readouterr().err
