"""tp.py: tensor parallelism over two gloo processes on the CPU gives the single-process results.

The multi-process checks share one launch of two ranks (the `ranks` fixture): each rank loads tiny
models from files through checkpoint.load_model(shard=...), runs every scenario of `scenarios`,
and saves what it computed; here the same scenarios run in one process through the plain code
path, and the tests compare. Tolerance for logits: float32, 1e-5 absolute and relative (a sum split
over two ranks is added in another order; measured differences are ~1e-6). Tokens: equal.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import autoshape
import quantize
import checkpoint
import generate as gen
import speculative
import tp
from conftest import ROOT, free_port, mirrored_pair, random_draft, save_checkpoint, tiny_target, torchrun
from draft import Eagle3Draft, draft_config_for, eagle3_layer_ids
from quantize_checkpoint import quantize_checkpoint

WORLD_SIZE = 2
TARGETS = ["tiny-llama", "tiny-qwen2", "tiny-mixtral"]  # GQA; q/k/v biases and tied embeddings; experts
QUANTIZED = ["tiny-llama/model_int8.pth", "tiny-mixtral/model_int8.pth", "tiny-llama/model_int4.g32.pth"]
PROMPT = torch.tensor([[5, 17, 200, 33, 4, 91, 250, 7, 64]])
NEW_TOKENS = 16
TREE = dict(tree_top_k=4, tree_depth=4, tree_tokens=16)  # small trees: a round is cheap on a busy CPU


# ---------------------------------------------------------------------------------------------
# The files both sides load, and what they compute from them
# ---------------------------------------------------------------------------------------------
def write_models(folder: Path):
    """Tiny targets, their int8/int4 versions, and drafts: an EAGLE-2 draft that mirrors its target
    (long acceptances, so that compaction moves several sharded K/V entries per round) and a random
    EAGLE-3 draft over a 16-token vocabulary (small enough that its guesses get accepted)."""
    for name in TARGETS:
        save_checkpoint(tiny_target(name), folder / name)
    save_checkpoint(tiny_target("tiny-llama", n_head=3, n_local_heads=3, dim=48, intermediate_size=96), folder / "kv3")  # for an error
    for path in QUANTIZED:
        mode, groupsize = quantize.mode_from_path(path)
        quantize_checkpoint(folder / path.split("/")[0] / "model.pth", mode, groupsize or 32)
    target, draft = mirrored_pair()
    save_checkpoint(target, folder / "mirrored")
    checkpoint.save_draft(draft, folder / "mirrored" / "eagle")
    target = tiny_target("tiny-llama", vocab_size=16)
    save_checkpoint(target, folder / "vocab16")
    torch.manual_seed(2)
    draft = Eagle3Draft(draft_config_for(target.config), 12, eagle3_layer_ids(target.config.n_layer))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
        draft.vocab.copy_(torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15]))
    checkpoint.save_draft(draft, folder / "vocab16" / "eagle3")


def load(folder: Path, path: str, shard):
    model = checkpoint.load_model(folder / path, "cpu", torch.float32, shard)
    model.setup_caches(1, 128)
    return model


def speculate(folder: Path, name: str, draft_name: str, shard, temperature=0.0, seed=0, compiled=False):
    target = load(folder, f"{name}/model.pth", shard)
    draft = checkpoint.load_draft(folder / name / draft_name, target.config)  # replicated: every rank loads it all
    spec = speculative.Speculator(target, draft, temperature=temperature, **TREE)
    round_fn = None
    if compiled:  # fullgraph: the round, all-reduces included, is one graph (aot_eager: no C++ build in a test)
        round_fn = torch.compile(spec.round, backend="aot_eager", fullgraph=True)
    torch.manual_seed(seed)
    ids, per_round = speculative.speculative_generate(spec, PROMPT[:, :6] % target.config.vocab_size, 40,
                                                      round_fn=round_fn)
    return ids[0], per_round[0]


@torch.no_grad()
def scenarios(folder: Path, shard) -> dict:
    """Everything compared between the ranks and the single process: logits of a prefill and of the
    next decode step, greedy and sampled generation, EAGLE-2 and EAGLE-3 rounds (tokens and the
    accepted length of every round, which shows that the drafts saw the same features)."""
    out = {}
    for path in [f"{name}/model.pth" for name in TARGETS] + QUANTIZED:
        model = load(folder, path, shard)
        prefill = model(PROMPT, torch.arange(PROMPT.size(1)))
        step = model(prefill[:, -1:].argmax(-1), torch.tensor([PROMPT.size(1)]))
        out[path, "logits"] = torch.cat([prefill, step], 1)
        out[path, "greedy"] = gen.generate(model, PROMPT, NEW_TOKENS)[0]
    torch.manual_seed(7)
    out["sampled"] = gen.generate(load(folder, "tiny-llama/model.pth", shard), PROMPT, NEW_TOKENS, temperature=1.0)[0]
    out["eagle2"] = speculate(folder, "mirrored", "eagle", shard)
    out["eagle3"] = speculate(folder, "vocab16", "eagle3", shard)
    out["eagle2 sampled"] = speculate(folder, "mirrored", "eagle", shard, temperature=0.8, seed=3)
    return out


@torch.no_grad()
def distributed_only(folder: Path, shard) -> dict:
    """What only the ranks run: compiled graphs, the helpers that talk to the other ranks, and
    the size of a rank's share."""
    out = {}
    model = load(folder, "tiny-llama/model.pth", shard)
    out["weight bytes"] = tp.weight_bytes(model)
    step = torch.compile(gen.decode_one_token, backend="aot_eager", fullgraph=True)
    out["compiled greedy"] = gen.generate(model, PROMPT, NEW_TOKENS, decode_fn=step)[0]
    out["compiled eagle2"] = speculate(folder, "mirrored", "eagle", shard, compiled=True)
    target = load(folder, "mirrored/model.pth", shard)  # --tree_tokens auto: its timings are rank 0's everywhere
    draft = checkpoint.load_draft(folder / "mirrored" / "eagle", target.config)
    costs, acceptance = autoshape.measure_shapes(target, draft, [PROMPT[0].tolist()], top_ks=(2,), max_depth=2,
                                                   tokens=(2, 4), rounds=2)
    out["tree costs"] = costs
    out["tree probes"] = [(scores.tolist(), depth.tolist(), accepted) for scores, depth, accepted in acceptance[2]]
    out["from rank 0"] = tp.from_rank0(f"rank {shard.rank}")
    try:
        tp.check_same_command({"checkpoint": "model.pth", "seed": 1234 + shard.rank})
    except ValueError as e:
        out["different commands"] = str(e)
    return out


def run_rank(rank: int, folder: Path, port: int):
    """One rank, as torchrun would start it (environment variables), one thread like torchrun's."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    shard, _ = tp.init("cpu", timeout_s=120)
    results = dict(scenarios(folder, shard), **distributed_only(folder, shard))
    results["deterministic after compiling"] = (torch._inductor.config.deterministic,
                                                torch.are_deterministic_algorithms_enabled())
    tp.finish()
    results["threads after finish"] = thread_names()
    torch.save(results, folder / f"rank{rank}.pt")


def thread_names() -> list:
    """The names of this process's threads (Linux), e.g. gloo's 'gloo_tcp_loop' and 'pt_gloo_runloop'."""
    names = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names


@pytest.fixture(scope="session")
def files(build_once):  # the session's, shared by pytest-xdist's workers
    return build_once("tp", write_models)


@pytest.fixture(scope="session")
def ranks(files, build_once):
    """[rank 0's results, rank 1's results] of one two-process run."""
    build_once("tp-ranks", lambda _: mp.spawn(run_rank, args=(files, free_port()), nprocs=WORLD_SIZE))
    return [torch.load(files / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="session")
def single(files):
    return scenarios(files, None)


# ---------------------------------------------------------------------------------------------
# TP=2 equals TP=1
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [f"{name}/model.pth" for name in TARGETS] + QUANTIZED)
def test_logits_and_greedy_equal_single_process(ranks, single, path):
    for results in ranks:
        torch.testing.assert_close(results[path, "logits"], single[path, "logits"], atol=1e-5, rtol=1e-5)
        assert results[path, "greedy"] == single[path, "greedy"]


@pytest.mark.parametrize("draft, target", [("eagle2", "mirrored"), ("eagle3", "vocab16")])
def test_speculative_greedy_equals_single_process(ranks, single, files, draft, target):
    """Tokens equal vanilla TP=1, and so does the accepted length of every round: the replicated
    draft grew the same trees from the ranks' features as it does in one process."""
    ids, per_round = single[draft]
    model = load(files, f"{target}/model.pth", None)
    assert ids == gen.generate(model, PROMPT[:, :6] % model.config.vocab_size, 40)[0]
    assert max(per_round) > 2  # guesses were accepted: the check has teeth
    for results in ranks:
        assert results[draft] == (ids, per_round)


def test_compiled_step_and_round_are_one_graph_each(ranks, single):
    for results in ranks:
        assert results["compiled greedy"] == single["tiny-llama/model.pth", "greedy"]
        assert results["compiled eagle2"] == single["eagle2"]


def test_ranks_agree_bit_for_bit(ranks):
    """Not only close: the same bits on every rank (the all-reduce's sum is one sum), with
    sampling the same tokens, from the same seed, and the same timings for --tree_tokens auto."""
    first, second = ranks
    for key, value in first.items():
        if key in ("from rank 0", "different commands", "threads after finish"):
            continue
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, second[key]), key
        else:
            assert value == second[key], key
    assert first["sampled"] != first["tiny-llama/model.pth", "greedy"]  # it did sample


def test_a_rank_holds_its_share(ranks, files):
    full = tp.weight_bytes(load(files, "tiny-llama/model.pth", None))
    layers = full - 2 * 512 * 64 * 4 - (2 * 2 + 1) * 64 * 4  # embedding, LM head and norms are replicated
    assert ranks[0]["weight bytes"] == full - layers // 2


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from Linux's /proc")
def test_finish_joins_the_process_group_threads(ranks):
    """After tp.finish() no gloo thread is left. They were, while something still held the group:
    torch.distributed.nn.functional's default arguments (imported by the first functional
    collective) and the compiled graphs of this run; the process then sometimes died at exit with
    "terminate called without an active exception"."""
    for results in ranks:
        assert results["threads after finish"]  # the main thread, at least: the listing works
        assert not [name for name in results["threads after finish"] if "gloo" in name]


def test_ranks_never_choose_kernels_by_timing(ranks):
    """Set by tp.init, and still set after the ranks compiled graphs (dynamo restores
    use_deterministic_algorithms after each, which resets inductor's flag set on its own)."""
    assert all(r["deterministic after compiling"] == (True, True) for r in ranks)


def test_inductor_flags_on_a_torch_without_deterministic_mode():
    """An inductor config as older torch has it (no deterministic mode): every timing switch off."""
    from types import SimpleNamespace

    old = SimpleNamespace(max_autotune=True, max_autotune_pointwise=True, coordinate_descent_tuning=True,
                          shape_padding=True, dynamic_scale_rblock=True, benchmark_fusion=True,
                          triton=SimpleNamespace(autotune_pointwise=True, multi_kernel=1))
    assert "triton.autotune_pointwise" in tp.inductor_flags(old)
    assert (old.max_autotune, old.max_autotune_pointwise, old.coordinate_descent_tuning, old.shape_padding,
            old.dynamic_scale_rblock, old.benchmark_fusion) == (False,) * 6
    assert (old.triton.autotune_pointwise, old.triton.multi_kernel) == (False, 0)
    assert not hasattr(old, "max_autotune_gemm")  # a flag this version lacks is not invented
    new = SimpleNamespace(deterministic=False, max_autotune=True)
    assert tp.inductor_flags(new) == ["deterministic"] and new.deterministic and new.max_autotune


def test_helpers_that_talk_to_the_other_ranks(ranks):
    assert [r["from rank 0"] for r in ranks] == ["rank 0", "rank 0"]
    for r in ranks:
        assert "the ranks were started differently: rank 1 has seed=1235, rank 0 has seed=1234" in r["different commands"]


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size, message", [
    (4, "over 4 ranks splits every layer by heads: 4 does not divide its 2 key/value heads; this model can run on 1 or 2 ranks"),
    (3, "3 does not divide its 2 key/value heads and its 4 query heads and its feed-forward size 128"),
], ids=["4 ranks", "3 ranks"])
def test_ranks_must_divide_the_heads(files, world_size, message):
    with pytest.raises(ValueError, match=message):
        checkpoint.load_model(files / "tiny-llama/model.pth", "cpu", torch.float32, tp.Shard(0, world_size))


@pytest.mark.parametrize("groupsize, message", [
    (64, "layers.0.attention.wo: int4 groups of 64 input columns cannot be split over 2 ranks \\(32 columns each\\)"),
    (256, "layers.0.attention.wqkv: int4 layer \\[128, 64\\] was padded to \\[128, 256\\]"),
], ids=["straddling", "padded"])
def test_int4_groups_must_not_straddle_ranks(files, tmp_path, groupsize, message):
    path = save_checkpoint(tiny_target("tiny-llama"), tmp_path / "tiny")
    quantized = quantize_checkpoint(path, "int4", groupsize)
    with pytest.raises(ValueError, match=message):
        checkpoint.load_model(quantized, "cpu", torch.float32, tp.Shard(1, 2))


def test_more_ranks_than_gpus():
    with pytest.raises(ValueError, match="over 4 ranks on this machine needs 4 GPUs, it has 2: use --nproc_per_node 2"):
        tp.check_gpu_count(4, 2)
    tp.check_gpu_count(2, 2)


# ---------------------------------------------------------------------------------------------
# The command line under torchrun
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_generate_cli_eagle2_under_torchrun(tiny_hf_checkpoint, tmp_path):
    """Two ranks, EAGLE-2 with a replicated draft: rank 0 alone prints and writes the report, which
    records the tensor parallelism and each rank's weights; the answer is the single-process one."""
    from convert_hf_checkpoint import convert_hf

    path = convert_hf(tiny_hf_checkpoint("llama"))
    model = checkpoint.load_model(path, "cpu", torch.float32)
    checkpoint.save_draft(random_draft(model), path.parent / "eagle")
    report = tmp_path / "report.json"
    result = torchrun(2, "generate.py", "--checkpoint_path", path, "--prompt", "The quick brown fox",
                      "--max_new_tokens", 12, "--speculate", "eagle2", "--tree", "4,3,12", "--output_json", report)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("tokens in") == 1  # rank 1 is silent
    assert "tensor parallel over 2 ranks" in result.stderr
    saved = json.loads(report.read_text())
    assert saved["tensor_parallel"] == 2
    assert saved["weight_bytes_per_rank"] < tp.weight_bytes(model)
    model.setup_caches(1, 64)
    expected = gen.generate(model, torch.tensor([saved["prompt_ids"]]), 12)[0]
    assert saved["token_ids"] == expected


def test_generate_cli_heads_error_under_torchrun(files):
    """Three KV heads cannot be split over two ranks: the ranks stop with a one-line error (printed
    by whichever rank gets there first: torchrun stops the other), and no traceback of ours."""
    result = torchrun(2, "generate.py", "--checkpoint_path", files / "kv3/model.pth", "--max_new_tokens", 4)
    assert result.returncode != 0
    assert ("error: tensor parallelism over 2 ranks splits every layer by heads: 2 does not divide its 3 key/value "
            "heads and its 3 query heads; this model can run on 1 or 3 ranks") in result.stderr
    assert "generate.py\", line" not in result.stderr


def test_a_missing_rank_is_an_error_not_a_hang(files):
    """Rank 0 of 2 started alone: it gives up after EAGLE_TP_TIMEOUT seconds with a clear error."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), EAGLE_TP_TIMEOUT="3")
    result = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--checkpoint_path",
                             str(files / "tiny-llama/model.pth")],
                            capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert result.returncode != 0
    assert "error: tensor parallelism: rank 0 waited 3 s and not all 2 ranks joined" in result.stderr
    assert "Traceback" not in result.stderr
