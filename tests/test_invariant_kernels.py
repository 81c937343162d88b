"""gpu_kernels/invariant.py: batch-invariant mode's CUDA kernels. Each kernel's row t of a T-row call
equals a one-row call bit for bit (T = 1..64), the kernels agree with PyTorch's arithmetic, and a
whole model on them (invariant.use_invariant_kernels) gives a verify's rows the bits of one-token
steps. (That every launch compiles for sm_80/86/90: tests/test_kernel_fit.py.)

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before anything imports triton). The interpreter has no bfloat16 tl.dot (triton-lang/triton#11584),
so the linear is checked there in float16 and float32; the norm and attention (no tl.dot) in all three.
"""

import numpy as np
import pytest
import torch

import invariant
from compiling import compile_function
from conftest import invariant_cases, tiny_target
from gpu_kernels import invariant as ik
from model import RMSNorm


@pytest.fixture(autouse=True)
def interpreter_dot_row_by_row(monkeypatch):
    """In the interpreter, tl.dot is numpy's matmul, and numpy's BLAS can round a row differently
    by its place in the block (measured on an AMD EPYC, CPU family 26: 20 of 32 rows of a [32, 64] x
    [64, 64] float32 product change bits when moved to row 0), which hides what these tests check:
    that nothing in the kernels depends on the row count. A GPU's MMA computes each output element
    the same wherever its row sits. So each row of an interpreted tl.dot is its own [1, K] x [K, N]
    product, the same call for any place."""
    if not ik.INTERPRETED:
        return
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def row_by_row(self, a, b, d, *rest):
        rows = [dot(self, interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype.scalar), b,
                    interpreter.TensorHandle(d.data[..., i:i + 1, :], d.dtype.scalar), *rest)
                for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows], axis=-2), rows[0].dtype)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", row_by_row)


DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not ik.INTERPRETED,
                                                 reason="the kernels are compiled for the GPU (no TRITON_INTERPRET)")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (device, dtype) of the linear: bf16's tl.dot on the GPU only
LINEAR_CASES = [pytest.param(d.values[0], dtype, marks=d.marks) for d in DEVICES for dtype in ALL_DTYPES
                if not (d.values[0] == "cpu" and dtype == torch.bfloat16)]


def assert_rows_invariant(fn, x, rows=range(1, 65)):
    """fn(x[:T])[t] == fn(x[t:t + 1])[0] bit for bit for every T in rows and t < T."""
    singles = torch.cat([fn(x[t:t + 1]) for t in range(max(rows))])
    for T in rows:
        assert torch.equal(fn(x[:T]), singles[:T]), T


# the module's constants for one pass over K and over an old part (the tests without these run its defaults)
ONE_PASS = dict(LINEAR_SPLIT_PROGRAMS=0, ATTENTION_CHUNK=0)


@pytest.mark.parametrize("device, dtype", LINEAR_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_do_not_depend_on_the_row_count(device, dtype, bias, monkeypatch):
    monkeypatch.setattr(ik, "LINEAR_SPLIT_PROGRAMS", 0)  # one pass over K (split-K: the next test)
    g = torch.Generator().manual_seed(0)
    K, N = 200, 72  # neither a multiple of the blocks: masked edges in both
    x = torch.randn(40, K, generator=g).to(device, dtype)  # not the default: T = 1..40 (the split test on CUDA: 1..64)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    torch.testing.assert_close(ik.invariant_linear(x, w, b).float(), torch.nn.functional.linear(x, w, b).float(),
                               **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    assert_rows_invariant(lambda rows: ik.invariant_linear(rows, w, b), x, rows=range(1, 41))


@pytest.mark.parametrize("device, dtype", [c for c in LINEAR_CASES if c.values[1] == torch.float16])
def test_the_linear_reads_its_setting_at_every_call(device, dtype, monkeypatch):
    """A tuning sweep tries whole 16-bit settings of LINEAR_CONFIG: under another one the linear
    still computes F.linear and its rows still do not depend on the row count."""
    setting = (16, 16, 64, 2, 3)
    assert setting != ik.LINEAR_CONFIG[2]
    monkeypatch.setitem(ik.LINEAR_CONFIG, 2, setting)
    assert ik.linear_config(dtype)["BLOCK_N"] == 16
    g = torch.Generator().manual_seed(1)
    K, N = 200, 72
    x = torch.randn(20, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    torch.testing.assert_close(ik.invariant_linear(x, w).float(), torch.nn.functional.linear(x, w).float(),
                               atol=2e-2, rtol=2e-2)
    # every row count on CUDA; in the interpreter, for time, those about its BLOCK_M of 16's edge
    assert_rows_invariant(lambda rows: ik.invariant_linear(rows, w), x,
                          rows=range(1, 21) if device == "cuda" else (1, 2, 3, 9, 15, 16, 17, 20))


@pytest.mark.parametrize("device, dtype", LINEAR_CASES)
@pytest.mark.parametrize("bias", [True])  # the bias is added once, by the sum (without one: the default's test)
def test_split_k_linear_is_f_linear_and_its_rows_do_not_depend_on_the_row_count(device, dtype, bias, monkeypatch):
    """LINEAR_SPLIT_PROGRAMS > 0: K cut into ranges by the weight's shape (the last one short), their
    float32 sums added in a second launch; the result is still F.linear's and row-count free."""
    monkeypatch.setattr(ik, "LINEAR_SPLIT_PROGRAMS", 8)
    g = torch.Generator().manual_seed(2)
    K, N = 200, 72
    launch = ik.linear_config(dtype)
    splits, k_per = ik.linear_splits(N, K, launch)
    assert splits > 1 and k_per % launch["BLOCK_K"] == 0 and (splits - 1) * k_per < K <= splits * k_per
    x = torch.randn(64, K, generator=g).to(device, dtype)  # T = 1..64 on CUDA: the defaults split
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    torch.testing.assert_close(ik.invariant_linear(x, w, b).float(), torch.nn.functional.linear(x, w, b).float(),
                               **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    # in the interpreter, for time: T = 1..40 in float16 as in the one-pass test (BLOCK_M 32: one and
    # two row blocks), T = 1..24 in float32 (BLOCK_M 16: one and two)
    counts = range(1, 65) if device == "cuda" else range(1, 25) if dtype == torch.float32 else range(1, 41)
    assert_rows_invariant(lambda rows: ik.invariant_linear(rows, w, b), x, rows=counts)
    monkeypatch.setattr(ik, "LINEAR_SPLIT_PROGRAMS", 2)  # N = 72 is 2 or 3 column blocks: one pass
    assert ik.linear_splits(N, K, launch) == (1, K)


@pytest.mark.parametrize("device, dtype, split", [
    pytest.param(*c.values, split, marks=c.marks) for c in LINEAR_CASES for split in (0, 8)
    # in the interpreter, for time: float16 split, float32 (the tight check) in one pass
    if c.values[0] == "cuda" or (split == 8) == (c.values[1] == torch.float16)])
@torch.no_grad()
def test_a_linear_with_its_norm_fused_in_normalises_each_row_alone(device, dtype, split, monkeypatch):
    """invariant_linear(x, w, norm_weight=g) (FUSE_NORMS): F.linear of x's rows RMS-normalised
    times g, each row's RMS summed inside the kernel, and row t the same bits for every row count,
    in one pass over K and split. Rows of very different scales: a row's RMS is its own."""
    monkeypatch.setattr(ik, "LINEAR_SPLIT_PROGRAMS", split)
    g = torch.Generator().manual_seed(5)
    K, N = 200, 72
    x = (torch.randn(64, K, generator=g) * torch.logspace(-2, 2, 64)[:, None]).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    norm = RMSNorm(K, eps=1e-5)
    norm.weight.data = 1 + torch.randn(K, generator=g) / 4
    norm = norm.to(device, dtype)
    fused = lambda rows: ik.invariant_linear(rows, w, None, None, 0, norm.weight, norm.eps)  # noqa: E731
    expected = torch.nn.functional.linear(norm(x).float(), w.float())
    torch.testing.assert_close(fused(x).float(), expected,
                               **(dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)))
    interpreted_rows = range(1, 25 if dtype.itemsize == 2 else 18)  # two row blocks (BLOCK_M 32 and 16)
    assert_rows_invariant(fused, x, rows=range(1, 65) if device == "cuda" else interpreted_rows)


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_fused_norms_leave_the_model_its_logits_and_launch_only_the_final_norm(device, monkeypatch):
    """use_invariant_kernels marks each block's two norms as feeding only linears (wqkv; w1 and w3):
    with FUSE_NORMS those linears normalise their input and the norms pass it on, so a forward
    launches rms_norm once (the final norm, whose output the LM head and the draft read), and the
    logits are the unfused model's up to the order of a sum of squares."""
    if device == "cpu":  # the mode sends a WindowMask to the kernel on CUDA only
        monkeypatch.setattr(invariant, "invariant_attention", ik.window_attention)
    model = invariant.use_invariant_kernels(tiny_target("tiny-llama", n_layer=2)).to(device, torch.float32)
    invariant.enable(model, window=16)
    launched = []
    norm = ik.rms_norm
    monkeypatch.setattr(ik, "rms_norm", lambda *args: launched.append(1) or norm(*args))
    tokens = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(6)).to(device)
    logits = {}
    for fuse in (False, True):
        monkeypatch.setattr(ik, "FUSE_NORMS", fuse)
        model.setup_caches(1, 32)
        launched.clear()
        logits[fuse] = model(tokens, torch.arange(6, device=device))
        assert len(launched) == (1 if fuse else 2 * model.config.n_layer + 1)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)
    assert set(model.state_dict()) == set(tiny_target("tiny-llama", n_layer=2).state_dict())


class _NoSecondLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a folded split-K call launched _split_sum_kernel")


@pytest.mark.parametrize("device, quant", [pytest.param(d.values[0], quant, marks=d.marks) for d in DEVICES
                                           for quant in ("none", "int8")
                                           if d.values[0] == "cuda" or quant == "int8"])  # int8: scale and bias
def test_split_k_folded_into_one_launch_gives_the_two_launches_bits(device, quant, monkeypatch):
    """LINEAR_FOLD_SPLITS: each output tile's last K range to finish adds the ranges itself, in range
    order. Its result is the two-launch split-K's bit for bit at every row count (so its rows do
    not depend on the row count either), it launches no second kernel, it leaves its counters at
    zero for the next call, and a launch of more tiles than FOLD_TILES takes the two launches. On a
    GPU, where the ranges finish in any order, each call is repeated to give a race its chance."""
    monkeypatch.setattr(ik, "LINEAR_SPLIT_PROGRAMS", 8)
    dtype = torch.float16
    g = torch.Generator().manual_seed(4)
    K, N = 200, 72
    assert ik.linear_splits(N, K, ik.linear_config(dtype))[0] > 1
    x = torch.randn(64, K, generator=g).to(device, dtype)
    bias = torch.randn(N, generator=g).to(device, dtype)
    if quant == "int8":
        weight = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8).to(device)
        scales = (torch.rand(N, generator=g) / 100).to(device, dtype)
    else:
        weight, scales = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype), None
    empty = torch.empty  # the kernels' buffers born NaN: a sum read before it is written shows
    monkeypatch.setattr(torch, "empty", lambda *size, **kw: empty(*size, **kw).fill_(float("nan")))
    rows = range(1, 65) if device == "cuda" else range(1, 25)
    two_launches = [ik.invariant_linear(x[:T], weight, bias, scales) for T in rows]
    monkeypatch.setattr(ik, "LINEAR_FOLD_SPLITS", True)
    second_launch = ik._split_sum_kernel
    monkeypatch.setattr(ik, "_split_sum_kernel", _NoSecondLaunch())
    for T, expected in zip(rows, two_launches):
        for _ in range(20 if device == "cuda" else 1):
            assert torch.equal(ik.invariant_linear(x[:T], weight, bias, scales), expected), T
    assert not ik.tile_counters(x.device).any()
    monkeypatch.setattr(ik, "_split_sum_kernel", second_launch)
    monkeypatch.setattr(ik, "FOLD_TILES", 1)  # N = 72 is two column blocks
    assert torch.equal(ik.invariant_linear(x[:3], weight, bias, scales), two_launches[2])


@pytest.mark.parametrize("device, dtype", [c for c in LINEAR_CASES
                                           if c.values[0] == "cuda" or c.values[1] == torch.float16])
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("split", [0, 8])
def test_quantized_linears_dequantize_in_the_kernel_and_their_rows_do_not_depend_on_the_row_count(
        device, dtype, quant, split, monkeypatch):
    """quantize.py's int8 and int4 layers through InvariantLinear (use_invariant_kernels' swap): the
    kernel dequantizes tile by tile, the result is the layer's dequantized weight times x (+ bias),
    and row t is the same bits for every row count, in one pass over K and split. K = 200 and
    N = 72 are no multiples of int4's group of 32 nor of its 16-row padding: the kernel masks the
    padded columns and the layer cuts the padded rows. (Interpreter: float16, T = 1..24.)"""
    import quantize
    monkeypatch.setattr(ik, "LINEAR_SPLIT_PROGRAMS", split)
    g = torch.Generator().manual_seed(3)
    K, N = 200, 72
    linear = torch.nn.Linear(K, N, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(N, K, generator=g) / K ** 0.5)
        linear.bias.copy_(torch.randn(N, generator=g))
    if quant == "int8":
        layer = quantize.WeightOnlyInt8Linear.from_linear(linear)
        w = quantize.dequantize_int8(layer.weight, layer.scales)
    else:
        layer = quantize.WeightOnlyInt4Linear.from_linear(linear, 32)
        assert layer.padded
        w = quantize.dequantize_int4(quantize.unpack_nibbles(layer.weight), layer.scales_and_zeros, 32)[:N, :K]
    if split:
        assert ik.linear_splits(N, K, ik.linear_config(dtype))[0] > 1
    fast = invariant.InvariantLinear(layer.to(device, dtype))
    x = torch.randn(64, K, generator=g).to(device, dtype)
    expected = torch.nn.functional.linear(x.float(), w.to(device)) + linear.bias.to(device)
    torch.testing.assert_close(fast(x).float(), expected,
                               **(dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)))
    assert_rows_invariant(fast, x, rows=range(1, 65) if device == "cuda" else range(1, 25))


def test_an_int4_layer_packed_for_the_cpu_is_a_clear_error():
    """quantize.pack_int4 on a CPU replaces the nibbles by torch's CPU packing (and keeps no nibbles):
    the kernels cannot read it, so the swap says so in one line."""
    import quantize
    layer = quantize.WeightOnlyInt4Linear.from_linear(torch.nn.Linear(64, 32), 32).to(torch.bfloat16)
    layer.pack()
    with pytest.raises(ValueError, match="keeps no nibbles"):
        invariant.InvariantLinear(layer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_row_count_and_equal_the_model_norm(device, dtype):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=g)
    norm = norm.to(device, dtype)
    x = (torch.randn(64, 96, generator=g) * 3).to(device, dtype)
    torch.testing.assert_close(ik.rms_norm(x, norm.weight, norm.eps), norm(x),
                               **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}))
    assert_rows_invariant(lambda rows: ik.rms_norm(rows, norm.weight, norm.eps), x)


def window_case(device, dtype, T, W=8, H=4, KV=2, D=16, S=96, old=40, seed=0):
    """Queries at positions old + W .. old + W + T - 1 of committed text (slot = position), the
    WindowMask that invariant.window_mask builds for them, and a cache."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, D, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 1, KV, S, D, generator=g)
    pos = torch.arange(old + W, old + W + T)[None]
    mask = invariant.window_mask(None, pos, pos, S, W)
    return [t.to(device, dtype) for t in (q, k, v)], [t.to(device) for t in mask]


CHUNKED = dict(ATTENTION_BLOCK_N=16, ATTENTION_CHUNK=32)  # 2-3 chunks of 2 blocks


@pytest.mark.parametrize("device, dtype, setting", [
    pytest.param(d.values[0], dtype, setting, marks=d.marks, id=f"{name}-{d.values[0]}-{str(dtype)[6:]}")
    for d in DEVICES for dtype in ALL_DTYPES for name, setting in (("one-pass", ONE_PASS), ("chunked", CHUNKED))
    if not (d.values[0] == "cpu" and name == "chunked" and dtype != torch.float32)])  # the interpreter: one dtype
def test_window_attention_is_attention_and_its_rows_do_not_depend_on_the_row_count(device, dtype, setting,
                                                                                   monkeypatch):
    """In one pass over the old part and in fixed chunks whose partials a second launch folds in
    order (ATTENTION_CHUNK; queries here have 40-63 old slots: two chunks, a third past them all)."""
    for name, value in setting.items():
        monkeypatch.setattr(ik, name, value)
    T = 24
    (q, k, v), mask = window_case(device, dtype, T)
    out = ik.window_attention(q, k, v, invariant.WindowMask(*mask))
    expected = invariant.invariant_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(),
                                                invariant.WindowMask(*(t.cpu() for t in mask)))
    torch.testing.assert_close(out.cpu().float(), expected,
                               **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    singles = torch.cat([ik.window_attention(q[:, :, t:t + 1], k, v, invariant.WindowMask(*(m[:, t:t + 1] for m in mask)))
                         for t in range(T)], dim=2)
    assert torch.equal(out, singles)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_is_a_clear_error(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="invariant_linear wants"):
        ik.invariant_linear(x, torch.zeros(4, 7, device=device))
    q8 = torch.zeros(4, 8, dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match="int8 weight .N, K. with scales .N."):
        ik.invariant_linear(x, q8, None, torch.ones(5, device=device))
    with pytest.raises(ValueError, match="of one dtype"):  # an int8 weight without its scales
        ik.invariant_linear(x, q8)
    with pytest.raises(ValueError, match="norm_weight .K. in x's dtype"):
        ik.invariant_linear(x, torch.zeros(4, 8, device=device), norm_weight=torch.ones(4, device=device))
    nibbles = torch.zeros(16, 16, dtype=torch.uint8, device=device)  # K padded to 32 = 2 groups of 16
    with pytest.raises(ValueError, match="int4 nibbles"):  # K = 8 is a whole group short of 32
        ik.invariant_linear(x, nibbles, None, torch.ones(2, 16, 2, device=device), 16)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        ik.linear_config(torch.int8)
    with pytest.raises(ValueError, match="rms_norm wants"):
        ik.rms_norm(x, torch.ones(7, device=device), 1e-5)
    (q, k, v), mask = window_case(device, torch.float32, 2)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ik, "ATTENTION_CHUNK", ik.ATTENTION_BLOCK_N + 1)
        with pytest.raises(ValueError, match="multiple of ATTENTION_BLOCK_N"):
            ik.window_attention(q, k, v, invariant.WindowMask(*mask))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        invariant.use_invariant_kernels(tiny_target("tiny-mixtral"))


# split-K in every linear of tiny-llama but the output layer (K 64 and 128 in 32-column steps), the
# old part of attention (24-35 slots behind a window of 16) in chunks of 32 slots, 2 blocks each
SPLIT = dict(LINEAR_SPLIT_PROGRAMS=8, LINEAR_CONFIG={**ik.LINEAR_CONFIG, 2: (16, 32, 32, 4, 2)},
             ATTENTION_BLOCK_N=16, ATTENTION_CHUNK=32)
FOLDED = dict(SPLIT, LINEAR_FOLD_SPLITS=True)  # the same with split-K's sums added by its first launch
FUSED = dict(SPLIT, FUSE_NORMS=True)  # the same with each block's norms inside its linears


@pytest.mark.parametrize("device, dtype, setting", [
    pytest.param(*c.values, setting, marks=c.marks, id=f"{name}-{c.values[0]}-{str(c.values[1])[6:]}")
    for c in LINEAR_CASES for name, setting in (("one-pass", ONE_PASS), ("split", SPLIT), ("folded", FOLDED),
                                               ("fused-norms", FUSED))
    # in the interpreter (~30 s a case): the defaults' kind (split, chunks) in float16 alone; one pass
    # over K and the old part, float32's kernels, the folded sum (the same bits as split's, in an
    # interpreter that runs one program after another) and the fused norms are the kernel tests'.
    # On CUDA every dtype, the folded sum and the fused norms (both off by default) in bf16 alone.
    if (c.values[0] == "cuda" and (name in ("one-pass", "split") or c.values[1] == torch.bfloat16))
    or (name == "split" and c.values[1] == torch.float16)])
@torch.no_grad()
def test_a_model_on_the_kernels_gives_a_verify_the_rows_of_one_token_steps(device, dtype, setting, monkeypatch,
                                                                          quant=None):
    """The whole target (tiny-llama, GQA, two layers) on the kernels, eager: every row of 3- and
    48-node tree verifies equals the one-token step's logits bit for bit, with one pass over K and
    over the old part, and with split-K linears (their sums added by a second launch, or folded
    into the first; the norms apart, or fused into the linears) and chunked attention (and on CUDA
    int8 and int4 targets, next test). In the interpreter one layer and a 24-node verify of a
    6-token chain. On the CPU the attention is routed to the kernel as the mode routes it on CUDA."""
    for name, value in setting.items():
        monkeypatch.setattr(ik, name, value)
    if device == "cpu":  # the mode sends a WindowMask to the kernel on CUDA only
        monkeypatch.setattr(invariant, "invariant_attention", ik.window_attention)
    target = tiny_target("tiny-llama", n_layer=2 if device == "cuda" else 1)
    if quant:
        import quantize
        quantize.quantize_model(target, quant)  # int4 unpacked: the nibbles are what the kernel reads
    model = invariant.use_invariant_kernels(target).to(device, dtype)
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert quant or model.output.weight is model.tok_embeddings.weight or not model.config.tie_embeddings
    invariant.enable(model, window=16)
    # in the interpreter a chain of 6 in 24 nodes: split's BLOCK_M of 16 still gives the verify two row blocks
    for P, T, region in ((5, 3, 3), (40, 12, 48)) if device == "cuda" else ((40, 6, 24),):
        model.setup_caches(1, 128)
        steps, cases = invariant_cases(model, dtype, P, T, region)
        for case, logits in cases.items():
            assert torch.equal(logits, steps), (case, P, T)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantized_model_on_the_kernels_gives_a_verify_the_rows_of_one_token_steps(quant, monkeypatch):
    """The same for int8 and int4 targets in bf16, split-K and chunks (on the CPU: the layer test
    above, test_quantized_linears_...)."""
    test_a_model_on_the_kernels_gives_a_verify_the_rows_of_one_token_steps("cuda", torch.bfloat16, SPLIT, monkeypatch,
                                                                          quant)

@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_the_kernels_trace_into_one_graph_as_opaque_ops(device, monkeypatch):
    """Compiled (fullgraph, as a round is), the custom ops' fake implementations stand for the
    kernels: the graph has no break, holds each op whole, and its verify gives the eager rows
    (with FUSE_NORMS too: on CUDA; once in the interpreter, ~10 s)."""
    monkeypatch.setattr(ik, "FUSE_NORMS", device == "cuda")
    if device == "cpu":  # the mode sends a WindowMask to the kernel on CUDA only
        monkeypatch.setattr(invariant, "invariant_attention", ik.window_attention)
    model = invariant.use_invariant_kernels(tiny_target("tiny-llama", n_layer=1)).to(device, torch.float16)
    invariant.enable(model, window=32)
    model.setup_caches(1, 64)
    eager_steps, eager_cases = invariant_cases(model, torch.float16, 6, 4, 8)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    eager_forward, model.forward = model.forward, compiled
    try:
        model.setup_caches(1, 64)
        steps, cases = invariant_cases(model, torch.float16, 6, 4, 8)
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
    assert any("invariant_linear" in op for op in ops) and any("rms_norm" in op for op in ops)
    assert any("window_attention" in op for op in ops)
    assert torch.equal(steps, eager_steps)
    for case, logits in cases.items():
        assert torch.equal(logits, eager_cases[case]) and torch.equal(logits, steps), case


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_inductor_compiled_verify_gives_the_rows_of_compiled_steps_on_cuda(dtype):
    """What --compile --batch_invariant runs on CUDA: the target compiled by Inductor through
    compiling.compile_function (as rounds and steps are), the kernels opaque ops among Inductor's
    fused ones, their float arguments passed as fp64 (tests/test_kernel_fit.py): every row of a
    verify equals the compiled one-token step's logits bit for bit."""
    model = invariant.use_invariant_kernels(tiny_target("tiny-llama", n_layer=2)).to("cuda", dtype)
    invariant.enable(model, window=32)
    model.setup_caches(1, 128)
    torch._dynamo.reset()
    eager_forward = model.forward
    model.forward = compile_function(eager_forward, "cuda", [model])
    try:
        steps, cases = invariant_cases(model, dtype, 40, 12, 48)
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
    for case, logits in cases.items():
        assert torch.equal(logits, steps), case
