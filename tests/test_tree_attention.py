"""gpu_kernels/tree_attention.py: the fused Triton kernel against its PyTorch reference (SDPA over the dense
mask), and the speculative round with the kernel against the SDPA path.

Without a GPU the kernel runs in triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before anything imports triton). The interpreter has no bfloat16 tl.dot (it multiplies the raw
bits: triton-lang/triton#11584), so bfloat16 is checked on CUDA only; float16 exercises the same
16-bit path on the CPU.
"""

from unittest import mock

import pytest
import torch
from torch._dynamo.comptime import comptime

import attention
import generate as gen
import model
import speculative
from attention import use_attention
from compiling import compile_round
from conftest import mirrored_pair, tiny_target
from gpu_kernels import tree_attention
from trees import mc_sim_7b_63, static_tree, tree_structure

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not tree_attention.INTERPRETED,
                                                 reason="the kernel is compiled for the GPU (no TRITON_INTERPRET)")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def make_visible(kind: str, B: int, T: int, R: int, g: torch.Generator) -> torch.Tensor:
    """[B, T, R] masks over the tree region, the queries being the last T of R region slots.
    tree: random trees of R nodes, each query sees its ancestors (rows differ);
    self: each query sees itself only;  random: any bits, a few rows seeing nothing."""
    if kind == "tree":
        parents = (torch.rand(B, R, generator=g) * torch.arange(R)).long()  # node i's parent: one of 0 .. i - 1
        parents[:, 0] = -1
        return tree_structure(parents, R - 1)[1][:, R - T:]
    if kind == "self":
        return torch.eye(R, dtype=torch.bool)[R - T:].expand(B, T, R)
    visible = torch.rand(B, T, R, generator=g) < 0.4
    visible[:, 0] = False
    return visible


def check_kernel(device, dtype, H, KV, D, T, R, prefix, S, n_splits, min_share, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(prefix)
    # q as the model makes it: a [B, H, T, D] view of a [B, T, H, D] tensor
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    k, v = torch.randn(2, B, KV, S, D, generator=g)
    prefix_len, visible = torch.tensor(prefix), make_visible(kind, B, T, R, g)
    expected = tree_attention.reference(q, k, v, prefix_len, visible)  # float32, on the CPU
    to = dict(device=device, dtype=dtype)
    with mock.patch.object(tree_attention, "MIN_SPLIT_SLOTS", min_share or tree_attention.MIN_SPLIT_SLOTS):
        out = tree_attention.tree_attention(q.to(**to), k.to(**to), v.to(**to), prefix_len.to(device),
                                            visible.to(device), n_splits=n_splits)
    assert out.shape == (B, H, T, D) and out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


# H, KV, D, T, R, per-row prefix lengths, cache slots S, n_splits (None: chosen from the launch),
# the smallest share of a split (None: MIN_SPLIT_SLOTS; small ones make short test prefixes really
# split), region mask. Small: the interpreter multiplies matrices at a few MFLOP/s.
CASES = {
    "mha-T1-prefix-0-and-1": (4, 4, 64, 1, 1, [0, 1], 80, 1, None, "self"),
    "gqa2-T5-prefix-around-a-block": (4, 2, 64, 5, 5, [63, 64, 70], 150, 1, None, "tree"),
    "gqa3-d128-T9-split3": (6, 2, 128, 9, 9, [0, 129], 300, 3, 64, "random"),
    "mqa-T64-four-query-blocks-split2": (4, 1, 64, 64, 64, [130, 7], 260, 2, 64, "tree"),
    "draft-level-T10-region-50": (3, 3, 64, 10, 50, [33, 150], 200, None, 64, "tree"),
    "default-split-long-prefix": (2, 2, 64, 3, 3, [1040], 1100, None, None, "self"),
    # LLaMA-3's verify: 4 query heads per KV head x 60 nodes = 240 rows, two blocks of 128
    "gqa4-T60-240-rows-split2": (8, 2, 64, 60, 60, [100, 250], 400, 2, 64, "tree"),
    # a short live prefix in a big cache: most shares are empty (row 0: one; row 1: three of five)
    "short-prefix-big-cache": (4, 2, 64, 3, 3, [40, 1500, 0], 2100, None, None, "tree"),
    "head-dim-80-split3": (4, 4, 80, 5, 5, [70, 200], 260, 3, 64, "tree"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_kernel_equals_reference(case, dtype, device):
    check_kernel(device, dtype, *CASES[case])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
def test_kernel_equals_reference_bf16_cuda(case):
    check_kernel("cuda", torch.bfloat16, *CASES[case])


def test_the_split_count_comes_from_the_launch():
    # batch 1, 32 KV heads, one query block: 32 programs, split 4 ways to fill an H100's SMs
    assert tree_attention.num_splits(32, 4096) == 4
    # a launch that fills the GPU is not split, nor a cache too short for two shares
    assert tree_attention.num_splits(256, 8192) == 1 and tree_attention.num_splits(32, 500) == 1
    # LLaMA-3 at batch 1: 8 KV heads, 4 x 60 = 240 rows of head_dim 128 in four blocks of 64:
    # 32 programs, 4 splits; two blocks of 128 rows (head_dim 64): 16 programs, 8 splits
    assert tree_attention.launch_config(torch.bfloat16, 240, 128, 101376)["block_m"] == 64
    assert tree_attention.num_splits(32, 8192) == 4 and tree_attention.num_splits(16, 8192) == 8
    # the default cases above really run split: "default-split-long-prefix" (1 x 2 KV heads x
    # one block) and "short-prefix-big-cache" (3 x 2 x 1), at most as many shares as the cache holds
    assert tree_attention.num_splits(1 * 2 * 1, 1100 - 3) == 3
    assert tree_attention.num_splits(3 * 2 * 1, 2100 - 3) == 5


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_empty_shares_are_neither_written_nor_read(device, monkeypatch):
    """A short prefix in a big cache leaves most shares empty; the merge must skip them. Every
    float buffer the call allocates starts as NaN here, so a share read without being written,
    or an output element left unwritten, would show."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    g = torch.Generator().manual_seed(4)
    B, H, KV, T, D, S = 3, 4, 2, 4, 64, 2100
    q, (k, v) = torch.randn(B, H, T, D, generator=g), torch.randn(2, B, KV, S, D, generator=g)
    prefix_len, visible = torch.tensor([40, 1500, 0]), make_visible("tree", B, T, T, g)
    expected = tree_attention.reference(q, k, v, prefix_len, visible)
    monkeypatch.setattr(torch, "empty", nan_empty)
    out = tree_attention.tree_attention(*(x.to(device) for x in (q, k, v, prefix_len, visible)), n_splits=8)
    monkeypatch.undo()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@torch.no_grad()
def test_launch_constants_are_read_at_every_call(device, dtype, monkeypatch):
    """A tuning sweep sets the module's launch constants: other values, same result."""
    monkeypatch.setattr(tree_attention, "BLOCK_N", 16)
    monkeypatch.setattr(tree_attention, "FP32_BLOCK_N", 16)
    monkeypatch.setattr(tree_attention, "MAX_BLOCK_M", 16)  # 24 rows: two blocks
    monkeypatch.setattr(tree_attention, "NUM_STAGES", 1)
    monkeypatch.setattr(tree_attention, "MIN_SPLIT_SLOTS", 32)
    launch = tree_attention.launch_config(dtype, 24, 64, 10**6)
    assert (launch["block_m"], launch["block_n"], launch["num_stages"]) == (16, 16, 1)
    check_kernel(device, dtype, 6, 2, 64, 8, 8, [45, 90], 140, None, None, "tree")


@pytest.mark.parametrize("dtype, head_dim, limit, expected", [
    # 16-bit: at most 64 x 128 query elements a block (128 rows of head_dim 128 spilled on sm_8x)
    (torch.bfloat16, 128, 101376, (64, 64, 2, 8)),
    (torch.float16, 64, 101376, (128, 64, 2, 8)),
    (torch.bfloat16, 64, 232448, (128, 64, 2, 8)),
    # float32 (no tensor cores): small tiles, 8 warps, wherever it runs
    (torch.float32, 128, 232448, (16, 32, 2, 8)),
    (torch.float32, 128, 101376, (16, 32, 2, 8)),
    # a smaller GPU (sm_75: 64 KB): smaller K/V blocks, then fewer stages
    (torch.bfloat16, 128, 65536, (64, 32, 2, 8)),
    (torch.float32, 128, 65536, (16, 32, 1, 8)),
])
def test_launches_keep_within_the_shared_memory_limit(dtype, head_dim, limit, expected):
    """What launch_config chooses for LLaMA-3's verify (4 x 60 = 240 stacked rows), by dtype and by
    the GPU's per-block limit, and that its bound on shared memory stays within the limit."""
    launch = tree_attention.launch_config(dtype, 240, head_dim, limit)
    assert (launch["block_m"], launch["block_n"], launch["num_stages"], launch["num_warps"]) == expected
    assert tree_attention.shared_bytes(launch["block_m"], launch["block_n"], launch["block_d"], launch["num_stages"],
                                       dtype.itemsize) <= limit
    with pytest.raises(ValueError, match="no launch fits in 4096 bytes"):
        tree_attention.launch_config(dtype, 240, head_dim, 4096)


def test_the_shared_memory_limit_comes_from_the_device(monkeypatch):
    """On CUDA the device's own opt-in figure, then the table by compute capability; Triton's
    interpreter chooses as the tightest GPU we target (sm_86, 99 KB)."""
    assert tree_attention.shared_memory_limit(torch.device("cpu")) == 101376
    props = mock.Mock(major=8, minor=0, shared_memory_per_block_optin=166912, shared_memory_per_block=49152)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert tree_attention.shared_memory_limit(torch.device("cuda", 0)) == 166912
    props.shared_memory_per_block_optin = 0  # a build that does not report it: the table
    props.minor = 6
    assert tree_attention.shared_memory_limit(torch.device("cuda", 0)) == 101376
    assert tree_attention.SHARED_MEMORY_PER_BLOCK[9, 0] == 232448 and tree_attention.SHARED_MEMORY_PER_BLOCK[8, 9] == 101376


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_slots_between_prefix_and_region_are_never_read(device):
    """Slots past prefix_len hold stale entries (rejected nodes, old rounds): make them huge and check
    they change nothing, also when prefix_len would reach into the region (clamped as the dense mask)."""
    B, H, KV, T, D, S = 2, 4, 2, 6, 64, 120
    g = torch.Generator().manual_seed(1)
    q, (k, v) = torch.randn(B, H, T, D, generator=g), torch.randn(2, B, KV, S, D, generator=g)
    prefix_len, visible = torch.tensor([37, 500]), make_visible("tree", B, T, T, g)
    clean = tree_attention.tree_attention(*(x.to(device) for x in (q, k, v, prefix_len, visible)))
    k[0, :, 37:S - T], v[0, :, 37:S - T] = 1e4, 1e4
    dirty = tree_attention.tree_attention(*(x.to(device) for x in (q, k, v, prefix_len, visible)))
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)
    expected = tree_attention.reference(q, k, v, prefix_len, visible)
    torch.testing.assert_close(dirty.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_bad_input_gets_a_clear_error():
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    prefix_len, visible = torch.tensor([5]), torch.ones(1, 3, 3, dtype=torch.bool)
    ta = tree_attention.tree_attention
    with pytest.raises(ValueError, match="multiple of the 3 KV heads"):
        ta(q, torch.randn(1, 3, 32, 16), torch.randn(1, 3, 32, 16), prefix_len, visible)
    with pytest.raises(ValueError, match="one shape"):
        ta(q, k, v[:, :, :16], prefix_len, visible)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        ta(q, k.half(), v, prefix_len, visible)
    with pytest.raises(ValueError, match=r"bool \[B=1, T=3, R\]"):
        ta(q, k, v, prefix_len, visible.float())
    with pytest.raises(ValueError, match=r"bool \[B=1, T=3, R\]"):
        ta(q, k, v, prefix_len, torch.ones(1, 3, 40, dtype=torch.bool))  # region larger than the cache
    with pytest.raises(ValueError, match="integer tensor"):
        ta(q, k, v, prefix_len.float(), visible)


# ---------------------------------------------------------------------------------------------
# The switch in model.py, and whole speculative rounds
# ---------------------------------------------------------------------------------------------
TRACED = []  # one entry per graph that dynamo traced the kernel into (kernel_calls)


def _note_traced(ctx):
    TRACED.append(1)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Switch model.py to the triton backend for one test; count the kernel's eager calls, and
    note in TRACED each compiled graph it is traced into."""
    calls = []
    TRACED.clear()

    def counted(*args, **kwargs):
        # no list mutation while dynamo traces: it would guard the graph on the list's length,
        # which grows at every call, and recompile each round until its limit (seen on an H200);
        # comptime runs once, at trace time, and leaves nothing in the graph
        if torch.compiler.is_compiling():
            comptime(_note_traced)
        else:
            calls.append(args[0].shape)
        return real(*args, **kwargs)

    real = tree_attention.tree_attention
    monkeypatch.setattr(tree_attention, "tree_attention", counted)
    yield calls


def test_use_attention_backends():
    target = tiny_target()
    assert use_attention(target, "auto") == "sdpa" and target.layers[0].attention.attend is attention.cpu_attention
    assert use_attention(target, "triton") == "triton"
    assert all(layer.attention.attend is attention.tree_kernel_attention for layer in target.layers)
    with pytest.raises(ValueError, match="auto, sdpa or triton"):
        use_attention(target, "flash")


def test_triton_without_the_kernel_is_a_clear_error(monkeypatch):
    """An older Triton can fail inside the kernel's import with an AttributeError (it did, on
    triton.knobs before Triton 3.4): "auto" then takes sdpa (on CUDA, saying why); "triton" is a
    clear error."""
    monkeypatch.setattr(attention, "tree_attention", None)
    monkeypatch.setattr(attention, "TREE_KERNEL_MISSING", "AttributeError: triton.knobs", raising=False)
    target = tiny_target()
    assert use_attention(target, "auto") == "sdpa"
    with pytest.raises(ValueError, match="needs triton"):
        use_attention(target, "triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["eagle", "eagle2"])
@torch.no_grad()
def test_speculative_rounds_with_the_kernel_equal_the_sdpa_path(method, device, kernel_calls):
    """Greedy: the kernel path emits exactly the tokens of the SDPA path (and of vanilla decoding),
    with a draft good enough that deep paths are accepted and compacted every round."""
    target, draft = mirrored_pair(seed=2)
    target, draft = target.to(device), draft.to(device)
    use_attention(target, "triton"), use_attention(draft, "triton")
    if method == "eagle":
        spec = speculative.Speculator(target, draft, static=static_tree(mc_sim_7b_63))
    else:
        spec = speculative.Speculator(target, draft, tree_top_k=4, tree_depth=4, tree_tokens=16)
    prompt = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3)).to(device)
    with_kernel, rounds = speculative.speculative_generate(spec, prompt, 16)
    n_calls = len(kernel_calls)
    use_attention(target, "sdpa"), use_attention(draft, "sdpa")
    with_sdpa, _ = speculative.speculative_generate(spec, prompt, 16)
    assert len(kernel_calls) == n_calls  # the SDPA run did not use the kernel
    assert with_kernel == with_sdpa == gen.generate(target, prompt, 16)
    # every round: the target's verify (one per layer) and the draft's tree levels but the last
    assert n_calls == max(map(len, rounds)) * (target.config.n_layer + spec.depth - 1)
    assert max(max(r) for r in rounds) >= 3  # deep acceptances happened


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
def test_compiled_round_with_the_kernel_on_cuda(kernel_calls):
    """The kernel inside the one CUDA graph of a compiled round (prefix_len read on the device only),
    Inductor passing its scale as fp64 (tests/test_kernel_fit.py): the round gives plain decoding's
    tokens, in its first run and in a replay of the captured graph."""
    target, draft = (m.to("cuda") for m in mirrored_pair(seed=2))
    use_attention(target, "triton"), use_attention(draft, "triton")
    spec = speculative.Speculator(target, draft, tree_top_k=4, tree_depth=4, tree_tokens=16)
    spec.setup(2, 64)
    round_fn = compile_round(spec).round
    prompt = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3)).cuda()
    for _ in range(2):  # the second run replays the captured graph
        ids, _ = speculative.speculative_generate(spec, prompt, 16, round_fn=round_fn)
        assert ids == gen.generate(target, prompt, 16)
    assert TRACED  # the kernel was traced into the round's graph


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_sliding_window_models_keep_the_dense_path(device, kernel_calls):
    target = tiny_target("tiny-llama", sliding_window=8).to(device)
    use_attention(target, "triton")
    target.setup_caches(1, 64)
    T, L = 5, 20
    target(torch.randint(0, 512, (1, L), device=device), torch.arange(L, device=device))
    ancestors = tree_structure(torch.tensor([[-1, 0, 0, 1, 3]]), 4)[1].to(device)
    args = (torch.randint(0, 512, (1, T), device=device), L + torch.tensor([[0, 1, 1, 2, 3]], device=device),
            64 - T + torch.arange(T, device=device))
    compact = target(*args, model.TreeMask(torch.tensor([L], device=device), ancestors))
    dense = target(*args, model.TreeMask(torch.tensor([L], device=device), ancestors).dense(64))
    assert kernel_calls == []
    torch.testing.assert_close(compact, dense, atol=0, rtol=0)
