"""quantize.py: int8/int4 round trips stay within their error bounds; quantized layers equal a
matmul with the dequantized weight (padded sizes included); the files it writes are read back by
generate.load_model and draft.load_draft; greedy EAGLE-2 output on a quantized target equals
vanilla greedy on that same quantized target; bad input gets a clear error."""
import copy
import json
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import generate as gen
import quantize
import compiling
import invariant
import speculative
from compiling import compile_function
from checkpoint import load_draft, save_draft
from conftest import invariant_cases, mirrored_pair, random_draft, save_checkpoint, tiny_target
from quantize import (WeightOnlyInt4Linear, WeightOnlyInt8Linear, dequantize_int4, dequantize_int8, int4_kernel,
                      pack_int4, quantize_int4, quantize_int8, quantize_model, unpack_nibbles)
from quantize_checkpoint import main

CLASSES = {"int8": WeightOnlyInt8Linear, "int4": WeightOnlyInt4Linear}


def quantized(model, mode, groupsize=32):
    """model quantized in memory and packed as load_model does on CPU in float32."""
    quantize_model(model, mode, groupsize)
    return pack_int4(model.float())


def prompts(count, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, int(torch.randint(3, 20, (1,), generator=g))), generator=g) for _ in range(count)]


def vanilla(target, prompt, n, **kw):
    target.setup_caches(1, prompt.size(1) + n)
    return gen.generate(target, prompt, n, **kw)


# ---------------------------------------------------------------------------------------------
# Quantize -> dequantize
# ---------------------------------------------------------------------------------------------
def test_int8_roundtrip_error_bound():
    torch.manual_seed(0)
    # a leading expert dim (a mixture-of-experts stack [E, out, in]) and rows of very different size
    w = torch.randn(3, 40, 96) * torch.logspace(-3, 1, 40)[:, None]
    w[1, 7] = 0.0
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (3, 40)
    deq = dequantize_int8(q, scales)
    assert ((deq - w).abs() <= scales[..., None] / 2 * (1 + 1e-5)).all()  # at most half a step
    used = w.abs().amax(-1) > 0
    assert (q.abs().amax(-1)[used] == 127).all()  # every row spans the whole code range
    assert torch.equal(deq[1, 7], torch.zeros(96))  # an all-zero row stays zero, no 0/0


@pytest.mark.parametrize("groupsize", [32, 64, 128, 256])
def test_int4_roundtrip_error_bound(groupsize):
    torch.manual_seed(0)
    out_features, in_features = 48, 512
    w = torch.randn(out_features, in_features) * torch.logspace(-2, 0, out_features)[:, None]
    w += torch.randn(out_features, 1)  # offsets: the asymmetric zero point matters
    q, sz = quantize_int4(w, groupsize)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert sz.shape == (in_features // groupsize, out_features, 2) and sz.dtype == torch.bfloat16
    scale = sz[..., 0].float().t().repeat_interleave(groupsize, 1)
    zero = sz[..., 1].float().t().repeat_interleave(groupsize, 1)
    err = (dequantize_int4(q, sz, groupsize) - w).abs()
    # half a step, plus what rounding scale and zero to bfloat16 (2^-9 relative) can move the range ends
    assert (err <= 0.5 * scale + (15 * scale + zero.abs()) / 512 + 1e-6).all()
    groups = q.view(out_features, -1, groupsize)
    assert (groups.amin(-1) <= 1).all() and (groups.amax(-1) >= 14).all()  # groups span the code range


# ---------------------------------------------------------------------------------------------
# Quantized linear layers vs the matmul with the dequantized weight
# ---------------------------------------------------------------------------------------------
def random_linear(in_features, out_features, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.5)
        if bias:
            lin.bias.normal_(0, 0.5)
    return lin


def assert_close_to(y, ref, rel):
    assert y.shape == ref.shape
    assert (y.float() - ref).abs().max() <= rel * ref.abs().max(), ((y.float() - ref).abs().max(), ref.abs().max())


@torch.no_grad()
def test_int8_linear_matches_dequantized_matmul():
    lin = random_linear(96, 40)
    m = WeightOnlyInt8Linear.from_linear(lin)
    deq = dequantize_int8(m.weight, m.scales)
    x = torch.randn(2, 5, 96)
    assert_close_to(m(x), F.linear(x, deq, lin.bias), 1e-5)
    # bfloat16: a few rows take torch's CPU int8 kernel, many rows the cast; both are the same layer
    mb = copy.deepcopy(m).bfloat16()
    for rows in (1, 3, 40):
        xb = torch.randn(rows, 96).bfloat16()
        assert_close_to(mb(xb), F.linear(xb.float(), deq, lin.bias), 2e-2)


@pytest.mark.parametrize("in_features, out_features, groupsize, padded", [
    (256, 48, 32, False),
    (576, 64, 128, True),    # SmolLM2's hidden size: 576 is no multiple of 128, padded to 640
    (100, 40, 32, True),     # both sizes padded: 100 -> 128 columns, 40 -> 48 rows
    (1152, 576, 256, True),  # an EAGLE draft's fc at SmolLM2's size: 1152 -> 1280
])
@torch.no_grad()
def test_int4_linear_matches_dequantized_matmul(in_features, out_features, groupsize, padded):
    lin = random_linear(in_features, out_features)
    m = WeightOnlyInt4Linear.from_linear(lin, groupsize)
    assert m.padded == padded
    deq = dequantize_int4(unpack_nibbles(m.weight), m.scales_and_zeros, groupsize)[:out_features, :in_features]
    x = torch.randn(2, 3, in_features)
    with pytest.raises(RuntimeError, match="pack_int4"):
        m(x)
    m32 = copy.deepcopy(m).float()
    m32.pack()
    assert_close_to(m32(x), F.linear(x, deq, lin.bias), 1e-5)  # the CPU kernel computes in x's dtype
    mb = copy.deepcopy(m).bfloat16()
    mb.pack()
    assert_close_to(mb(x.bfloat16()), F.linear(x, deq, lin.bias), 2e-2)
    # the padded columns do not leak in: the layer is the [out, in] one, whatever it is padded to
    assert_close_to(F.linear(x, dequantize_int4(*quantize_int4(
        F.pad(lin.weight, (0, m.in_padded - in_features)), groupsize), groupsize)[:, :in_features], lin.bias),
        F.linear(x, deq, lin.bias), 1e-6)


@pytest.mark.all_threads
@torch.no_grad()
def test_cpu_rows_do_not_depend_on_the_row_count_in_batch_invariant_mode():
    """bf16 on a CPU, SmolLM2's layer shapes: each row of a 1-64-row matmul equals that row alone,
    for int4 layers always, for int8 layers with set_row_invariant (without it, beyond
    CPU_INT8_KERNEL_ROWS rows the layer casts the weight and rounds differently)."""
    torch.manual_seed(0)
    for K, N in ((576, 1536), (1536, 576)):
        linear = nn.Linear(K, N, bias=False).to(torch.bfloat16)
        int8 = quantize.set_row_invariant(WeightOnlyInt8Linear.from_linear(linear))
        int4 = WeightOnlyInt4Linear.from_linear(linear, 32)
        int4.pack()
        x = torch.randn(64, K).to(torch.bfloat16)
        for layer in (int8, int4):
            alone = torch.cat([layer(x[i:i + 1]) for i in range(64)])
            assert all(torch.equal(layer(x[:m]), alone[:m]) for m in range(1, 65)), type(layer).__name__
        quantize.set_row_invariant(int8, False)
        alone = torch.cat([int8(x[i:i + 1]) for i in range(64)])
        rows = quantize.CPU_INT8_KERNEL_ROWS
        assert torch.equal(int8(x[:rows]), alone[:rows]) and not torch.equal(int8(x[:rows + 1]), alone[:rows + 1])



@torch.no_grad()
def test_a_prefill_in_batch_invariant_mode_runs_int8_layers_as_outside_it():
    """invariant.enable's hooks: for an eager prefill, an int8 layer in the mode computes a
    prompt's rows as outside the mode (the cast and a bf16 GEMM beyond CPU_INT8_KERNEL_ROWS rows),
    and is back in the mode afterwards, an exception inside included."""
    target = tiny_target("tiny-llama").to(torch.bfloat16)
    quantize.quantize_model(target, "int8")
    invariant.enable(target)
    target.setup_caches(1, 64)
    int8 = target.layers[0].attention.wqkv
    seen = []
    hook = int8.register_forward_hook(lambda m, args, out: seen.append(m.row_invariant))
    x = torch.randn(quantize.CPU_INT8_KERNEL_ROWS + 4, 64).to(torch.bfloat16)
    kernel = torch.ops.aten._weight_int8pack_mm(x, int8.weight, int8.scales)
    cast = F.linear(x, int8.weight.to(x.dtype)) * int8.scales
    assert not torch.equal(kernel, cast) and torch.equal(int8(x), kernel)  # the two can be told apart
    target(torch.randint(0, 512, (1, 24)), torch.arange(24))
    assert seen[-1] is False and int8.row_invariant and torch.equal(int8(x), kernel)
    hook.remove()
    int8.register_forward_hook(lambda m, args, out: (_ for _ in ()).throw(KeyError("inside")))
    with pytest.raises(KeyError):
        target(torch.randint(0, 512, (1, 24)), torch.arange(24))
    assert int8.row_invariant


@torch.no_grad()
def test_plain_and_speculative_prefills_leave_the_mode_for_int8_layers():
    """generate.prefill and Speculator.prefill run an eager target's int8 layers outside the mode
    (invariant.enable's hooks), both alike, so that the caches they fill stay equal; the steps and
    verifies after them run in it."""
    target = tiny_target("tiny-llama").to(torch.bfloat16)
    quantize.quantize_model(target, "int8")
    invariant.enable(target)
    layer = target.layers[0].attention.wqkv
    seen = []
    layer.register_forward_hook(lambda m, args, out: seen.append((args[0].numel() // m.in_features, m.row_invariant)))
    prompt = torch.randint(0, target.config.vocab_size, (1, 24))
    target.setup_caches(1, 64)
    gen.prefill(target, prompt, 0.0, None, None)
    spec = speculative.Speculator(target, random_draft(target).to(torch.bfloat16), tree_top_k=2, tree_depth=2,
                                  tree_tokens=4)
    spec.prefill(prompt, 8)
    spec.round()
    assert seen[0] == (24, False) and seen[1] == (24, False)
    assert all(invariant for _, invariant in seen[2:]) and len(seen) > 2


@pytest.mark.all_threads
@pytest.mark.autotune  # as generate.py compiles: max-autotune has a GEMM template of its own for int8 weights
@pytest.mark.parametrize("mode", ["int8", "int4"])
@torch.no_grad()
def test_compiled_quantized_rows_equal_one_token_steps_in_batch_invariant_mode(mode):
    """Compiled for the CPU in batch-invariant mode (bf16), an int8 or int4 target's verify of 16
    and 64 tree nodes gives each token the logits of its one-token step bit for bit, with the code
    this CPU's mode compiles its layers to: for int8 Inductor's C++ template, or with AMX torch's
    kernel as an opaque op (quantize.INDUCTOR_INT8_ROWS_INVARIANT: there the template gives rows
    of SmolLM2's shapes apart); for int4 Inductor's int4 template on
    an AVX-512 CPU without AMX (quantize.INDUCTOR_INT4_ROWS_INVARIANT; SmolLM2's shapes all take it),
    else the kernel (int4_rows_cpu)."""
    torch._dynamo.reset()
    # SmolLM2's layer shapes (one layer, a small vocabulary): where Inductor's lowering differs
    model = tiny_target("SmolLM2-135M", n_layer=1, vocab_size=512).to(torch.bfloat16)
    quantize.quantize_model(model, mode)
    quantize.pack_int4(model)
    invariant.enable(model)
    eager_forward = model.forward
    model.forward = compile_function(eager_forward, "cpu", (model,))
    try:
        for P, T, region in ((20, 8, 16), (30, 30, 64)):
            model.setup_caches(1, 160)
            steps, cases = invariant_cases(model, torch.bfloat16, P, T, region, prefill=eager_forward)
            assert all(torch.equal(logits, steps) for logits in cases.values()), (mode, P, T, region)
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()


@pytest.mark.autotune  # the template is max-autotune's
@pytest.mark.parametrize("mode,out_features,template", [("int8", 96, True), ("int8", 96, False),
                                                         ("int4", 128, True), ("int4", 128, False),
                                                         ("int4", 96, True)])
@pytest.mark.all_threads
@torch.no_grad()
def test_compiled_quantized_layers_of_the_mode_are_the_template_or_the_kernel(monkeypatch, mode, out_features,
                                                                              template):
    """In a batch-invariant CPU graph a quantized layer compiles to Inductor's C++ template where its
    rows do not depend on the row count (quantize.INDUCTOR_INT8_ROWS_INVARIANT: AVX2 or AVX-512, no
    AMX; INDUCTOR_INT4_ROWS_INVARIANT: AVX-512, no AMX, and a shape the int4 template takes, which
    96 outputs are not), the code a plain compiled step runs too; elsewhere to a call of torch's
    kernel. Either way every row of a 5-row call equals that row alone (the template's case is not
    asked of a CPU where it is not expected to hold)."""
    from torch._inductor.utils import run_and_get_code
    flag = "INDUCTOR_INT8_ROWS_INVARIANT" if mode == "int8" else "INDUCTOR_INT4_ROWS_INVARIANT"
    if template and not getattr(quantize, flag):
        pytest.skip(f"this CPU's {mode} template is not row-count invariant (AMX) or there is none")
    monkeypatch.setattr(quantize, flag, template)
    monkeypatch.setattr(compiling, "CPU_INDUCTOR", {**compiling.CPU_INDUCTOR, "fx_graph_cache": False})
    torch.manual_seed(0)
    linear = nn.Linear(128, out_features, bias=False).to(torch.bfloat16)
    layer = WeightOnlyInt8Linear.from_linear(linear) if mode == "int8" else WeightOnlyInt4Linear.from_linear(linear, 32)
    if mode == "int4":
        layer.pack()
        assert layer.template_invariant() == (template and out_features % 64 == 0)
        template = layer.template_invariant()  # 96 outputs: no int4 template, the kernel
    quantize.set_row_invariant(layer)
    holder = nn.Module()
    holder.invariant_window = 32  # compile in the mode's settings
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    try:
        outs, codes = [], []
        for rows in (x, x[:1]):  # a graph for the 5 rows, one for a single row
            torch._dynamo.reset()
            compiled = compile_function(layer.forward, "cpu", (holder, layer))
            out, code = run_and_get_code(compiled, rows)
            outs.append(out)
            codes.append("".join(code))
        outs[1:] = [compiled(row) for row in x.split(1)]  # each row alone, through the single-row graph
    finally:
        torch._dynamo.reset()
    assert torch.equal(outs[0], torch.cat(outs[1:]))
    kernel_call = {"int8": "_weight_int8pack_mm(", "int4": "_weight_int4pack_mm_cpu_tensor("}[mode]
    for code in codes:
        assert (kernel_call in code) != template
        assert ("micro_gemm" in code) == template


@pytest.mark.parametrize("mode", ["int8", "int4"])
@torch.no_grad()
def test_compiled_row_ops_are_direct_kernel_calls(monkeypatch, mode):
    """In a batch-invariant CPU graph, quantize.int8_rows and int4_rows_cpu compile into calls of
    torch's int8 and int4 kernels from the compiled code (quantize.lower_int8_rows_to_the_kernel,
    lower_int4_rows_to_the_kernel: for int4 Inductor's extern call through its C shim), not calls
    through the dispatcher back into the custom op's Python, which cost ~9 us an int8 layer more and
    made the mode's int4 step cost 44 % rather than 11 % (a Zen 4, SmolLM2 group 32); the result is
    the kernel's, bit for bit."""
    from torch._inductor.utils import run_and_get_code
    # the code generated now, not a cached graph (Inductor's cache key does not see lowerings)
    monkeypatch.setattr(compiling, "CPU_INDUCTOR", {**compiling.CPU_INDUCTOR, "fx_graph_cache": False})
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    if mode == "int8":
        weight, scales = quantize.quantize_int8(torch.randn(96, 64))
        args = (weight, scales.to(torch.bfloat16))
        op, kernel, kernel_call = quantize.int8_rows, torch.ops.aten._weight_int8pack_mm, "_weight_int8pack_mm("
        op_call = "eagle_gpt_fast::int8_rows"
    else:
        layer = WeightOnlyInt4Linear.from_linear(nn.Linear(64, 128, bias=False), 32)
        layer.pack()
        args = (layer.weight, 32, layer.scales_and_zeros.to(torch.bfloat16))
        op, kernel = quantize.int4_rows_cpu, torch.ops.aten._weight_int4pack_mm_for_cpu
        kernel_call, op_call = "_weight_int4pack_mm_cpu_tensor(", "eagle_gpt_fast::int4_rows_cpu"
    holder = nn.Module()
    holder.invariant_window = 32  # compile in the mode's settings
    compiled = compile_function(lambda x: op(x, *args) * 2, "cpu", (holder,))
    try:
        out, code = run_and_get_code(compiled, x)
        code = "".join(code)
        assert torch.equal(out, kernel(x, *args) * 2)
        assert kernel_call in code
        assert op_call not in code  # no call through the dispatcher
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_quantized_linears_on_cuda():
    lin = random_linear(576, 960)
    x = torch.randn(3, 576)
    int8 = WeightOnlyInt8Linear.from_linear(lin)
    ref8 = F.linear(x, dequantize_int8(int8.weight, int8.scales), lin.bias)
    assert_close_to(int8.to("cuda", torch.bfloat16)(x.cuda().bfloat16()).cpu(), ref8, 2e-2)
    for groupsize in (32, 128):  # 128: padded
        int4 = WeightOnlyInt4Linear.from_linear(lin, groupsize)
        ref4 = F.linear(x, dequantize_int4(unpack_nibbles(int4.weight), int4.scales_and_zeros, groupsize)[:, :576], lin.bias)
        int4 = int4.to("cuda", torch.bfloat16)
        int4.pack()
        assert_close_to(int4(x.cuda().bfloat16()).cpu(), ref4, 2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_int4_on_cuda_picks_the_path_by_rows(monkeypatch):
    """Up to CUDA_INT4_KERNEL_ROWS rows torch's int4 kernel, beyond them the dequantized weight
    and cuBLAS: the two paths give the same result."""
    lin = random_linear(576, 960)
    int4 = WeightOnlyInt4Linear.from_linear(lin, 128)  # padded: 576 -> 640 columns
    ref = dequantize_int4(unpack_nibbles(int4.weight), int4.scales_and_zeros, 128)[:, :576]
    int4 = int4.to("cuda", torch.bfloat16)
    int4.pack()
    x = torch.randn(20, 576)
    expected = F.linear(x, ref, lin.bias)
    monkeypatch.setattr(quantize, "CUDA_INT4_KERNEL_ROWS", 32)
    by_kernel = int4(x.cuda().bfloat16()).cpu()
    monkeypatch.setattr(quantize, "CUDA_INT4_KERNEL_ROWS", 16)
    by_cublas = int4(x.cuda().bfloat16()).cpu()
    assert_close_to(by_kernel, expected, 2e-2)
    assert_close_to(by_cublas, expected, 2e-2)
    assert_close_to(by_cublas, by_kernel.float(), 2e-2)


@torch.no_grad()
def test_int4_prefill_dequantizes_in_bounded_pieces(monkeypatch):
    """The dequantized path of a CUDA prefill (dequantize_int4_as): the same bits as dequantizing the
    whole layer in float32 and casting, with no float32 intermediate larger than the chunk."""
    int4 = WeightOnlyInt4Linear.from_linear(random_linear(256, 100), 32)  # 100 rows, padded to 112
    sizes, real = [], quantize.dequantize_int4
    monkeypatch.setattr(quantize, "dequantize_int4", lambda q, *a: sizes.append(q.numel()) or real(q, *a))
    whole = real(unpack_nibbles(int4.weight), int4.scales_and_zeros, 32).to(torch.bfloat16)
    pieces = quantize.dequantize_int4_as(int4.weight, int4.scales_and_zeros, 32, torch.bfloat16, chunk=30 * 256)
    assert pieces.dtype == torch.bfloat16 and torch.equal(pieces, whole)
    assert sizes == [30 * 256] * 3 + [22 * 256]  # 112 rows, 30 at a time
    sizes.clear()
    quantize.dequantize_int4_as(int4.weight, int4.scales_and_zeros, 32, torch.bfloat16)  # fits one default chunk
    assert sizes == [112 * 256]


def test_int4_on_cpu_keeps_no_second_copy():
    int4 = WeightOnlyInt4Linear.from_linear(random_linear(256, 48), 32)
    int4.pack()
    assert int4.packed_for == "cpu" and not hasattr(int4, "nibbles")  # the nibbles serve CUDA's dequantized path only


# ---------------------------------------------------------------------------------------------
# Files: scripts/quantize_checkpoint.py writes them, checkpoint.load_model and load_draft read them
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, groupsize, name", [
    ("int8", None, "model_int8.pth"), ("int4", 32, "model_int4.g32.pth"), ("int4", 128, "model_int4.g128.pth")])
@torch.no_grad()
def test_quantized_checkpoint_round_trip(tmp_path, capsys, mode, groupsize, name):
    target = tiny_target("tiny-qwen2")  # tied embeddings and q/k/v biases
    path = save_checkpoint(target, tmp_path / "tiny")
    out = main(["--checkpoint_path", str(path), "--mode", mode] + (["--groupsize", str(groupsize)] if groupsize else []))
    assert out == path.with_name(name) and out.stat().st_size < path.stat().st_size
    printed = capsys.readouterr().out
    assert "tied LM head" in printed and "wrote" in printed
    assert ("padded" in printed) == (groupsize == 128)  # the tiny hidden size 64 < 128

    loaded = checkpoint.load_model(out, "cpu", torch.float32)
    assert isinstance(loaded.layers[1].attention.wqkv, CLASSES[mode]) and isinstance(loaded.output, CLASSES[mode])
    assert torch.equal(loaded.tok_embeddings.weight, target.tok_embeddings.weight)  # the table stays in float
    expected = quantized(copy.deepcopy(target), mode, groupsize or 32)
    ids = torch.randint(0, 512, (1, 12))
    for m in (loaded, expected):
        m.setup_caches(1, 12)
    assert torch.equal(loaded(ids, torch.arange(12)), expected(ids, torch.arange(12)))
    if groupsize != 128:  # the bytes a decode step reads: quantized weights and scales count, the float table not
        weights = sum(m.weight.numel() for m in target.modules() if isinstance(m, nn.Linear))
        bits = 8 if mode == "int8" else 4
        assert weights * bits / 8 < gen.model_bytes_per_token(loaded) < 0.3 * gen.model_bytes_per_token(target)


@torch.no_grad()
def test_quantized_draft_round_trip(tmp_path):
    target = tiny_target("tiny-llama")
    draft = random_draft(target, std=0.2)
    save_draft(draft, tmp_path / "eagle")
    out = main(["--draft", "--checkpoint_path", str(tmp_path / "eagle"), "--mode", "int4", "--groupsize", "64"])
    assert out == tmp_path / "eagle" / "draft_int4.g64.safetensors"

    loaded = load_draft(out, target.config)
    assert isinstance(loaded.fc, WeightOnlyInt4Linear) and isinstance(loaded.layer.feed_forward.w2, WeightOnlyInt4Linear)
    assert isinstance(load_draft(tmp_path / "eagle", target.config).fc, nn.Linear)  # the folder still means the float one
    expected = quantized(copy.deepcopy(draft), "int4", 64)
    embeds, features = torch.randn(1, 7, 64), torch.randn(1, 7, 64)
    for d in (loaded, expected):
        d.setup_caches(1, 16)
    assert loaded.layer.attention.kv_cache.k_cache.dtype == torch.float32  # not the quantized fc's dtype
    assert torch.equal(loaded(embeds, features, torch.arange(7)), expected(embeds, features, torch.arange(7)))


def test_generate_cli_speculates_on_quantized_files(tiny_hf_checkpoint, tmp_path):
    """generate.py end to end: an int8 target with an int4 draft, --speculate eagle2 against vanilla."""
    from convert_hf_checkpoint import convert_hf

    model_path = convert_hf(tiny_hf_checkpoint("llama"))
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    save_draft(random_draft(target, std=0.2), model_path.parent / "eagle")
    int8 = main(["--checkpoint_path", str(model_path), "--mode", "int8"])
    draft = main(["--draft", "--checkpoint_path", str(model_path.parent / "eagle"), "--mode", "int4"])
    outputs = {}
    for method in ("none", "eagle2"):
        report = tmp_path / f"{method}.json"
        gen.main(["--checkpoint_path", str(int8), "--prompt", "The quick brown fox", "--max_new_tokens", "30",
                  "--device", "cpu", "--no-compile", "--speculate", method, "--draft_checkpoint_path", str(draft),
                  "--output_json", str(report)])
        outputs[method] = json.loads(report.read_text())["token_ids"]
    assert outputs["eagle2"] == outputs["none"] and len(outputs["none"]) > 5


# ---------------------------------------------------------------------------------------------
# Greedy losslessness relative to the quantized target
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["int8", "int4"])
@torch.no_grad()
def test_greedy_eagle2_equals_vanilla_on_quantized_tiny(mode):
    target = quantized(tiny_target("tiny-qwen2"), mode)
    spec = speculative.Speculator(target, random_draft(target, std=0.2))
    for prompt in prompts(6):
        assert speculative.speculative_generate(spec, prompt, 30)[0] == vanilla(target, prompt, 30)
    # a draft that mirrors the target (both quantized alike) gets long runs accepted
    target, draft = (quantized(m, mode) for m in mirrored_pair())
    spec = speculative.Speculator(target, draft)
    taus = []
    for prompt in prompts(6, seed=1):
        ids, per_round = speculative.speculative_generate(spec, prompt, 40)
        assert ids == vanilla(target, prompt, 40)
        taus.append(sum(per_round[0]) / len(per_round[0]))
    assert sum(taus) / len(taus) > 2


@torch.no_grad()
def test_greedy_eagle2_equals_vanilla_on_smollm2_int8(smollm2_checkpoint):
    from conftest import ROOT
    from tokenizer import load_tokenizer

    target = quantized(checkpoint.load_model(smollm2_checkpoint / "model.pth", "cpu", torch.float32), "int8")
    tokenizer = load_tokenizer(smollm2_checkpoint)
    head = ROOT / "heads" / "SmolLM2-135M-Instruct"
    draft = load_draft(head, target.config) if head.is_dir() else random_draft(target)
    # a small tree keeps the test short; losslessness does not depend on the tree's size
    spec = speculative.Speculator(target, quantized(draft, "int8"), tree_top_k=4, tree_depth=3, tree_tokens=10,
                          stop_ids=tokenizer.stop_ids)
    for text in ["What is the capital of France?", "Write a haiku about autumn.", "What is 12 times 7?"]:
        prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": text}])])
        assert speculative.speculative_generate(spec, prompt, 12)[0] == vanilla(target, prompt, 12, stop_ids=tokenizer.stop_ids)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_unsupported_groupsize(tmp_path, capsys):
    path = save_checkpoint(tiny_target(), tmp_path / "tiny")
    with pytest.raises(SystemExit, match=r"^error: int4 groupsize must be one of 32, 64, 128, 256 .*got 48$"):
        main(["--checkpoint_path", str(path), "--mode", "int4", "--groupsize", "48"])
    with pytest.raises(SystemExit):
        main(["--checkpoint_path", str(path), "--mode", "int8", "--groupsize", "32"])
    assert "--groupsize applies to --mode int4 only" in capsys.readouterr().err
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pth", "model_config.json"]  # nothing written
    with pytest.raises(ValueError, match="groupsize must be one of"):
        quantize_int4(torch.randn(16, 64), 16)
    with pytest.raises(ValueError, match="groupsize must be one of"):
        WeightOnlyInt4Linear(64, 64, 100)
    with pytest.raises(ValueError, match="run on CPU or CUDA, not on meta"):
        int4_kernel(torch.device("meta"))


def test_missing_files(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: checkpoint not found: .*nowhere/model.pth"):
        main(["--checkpoint_path", str(tmp_path / "nowhere" / "model.pth"), "--mode", "int8"])
    with pytest.raises(SystemExit, match=r"^error: no EAGLE draft at .*eagle: expected draft_config.json"):
        main(["--draft", "--checkpoint_path", str(tmp_path / "eagle"), "--mode", "int8"])
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        checkpoint.load_model(tmp_path / "model_int8.pth", "cpu", torch.float32)
    target = tiny_target()
    save_draft(random_draft(target), tmp_path / "eagle")
    with pytest.raises(FileNotFoundError, match="expected draft_config.json and draft_int8.safetensors"):
        load_draft(tmp_path / "eagle" / "draft_int8.safetensors", target.config)


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    path = save_checkpoint(tiny_target(), tmp_path / "tiny")
    (tmp_path / "tiny" / "model_int8.pth").write_text("the user's own file")
    with pytest.raises(SystemExit, match=r"^error: refusing to overwrite .*model_int8.pth: pass --force"):
        main(["--checkpoint_path", str(path), "--mode", "int8"])
    assert (tmp_path / "tiny" / "model_int8.pth").read_text() == "the user's own file"
    main(["--checkpoint_path", str(path), "--mode", "int8", "--force"])
    assert isinstance(checkpoint.load_model(tmp_path / "tiny" / "model_int8.pth", "cpu", torch.float32).output,
                      WeightOnlyInt8Linear)


def test_file_name_must_say_what_the_file_holds(tmp_path):
    """The mode comes from the name (gpt-fast naming) and is checked against the tensors, so a
    renamed file cannot pass for what it is not."""
    path = save_checkpoint(tiny_target(), tmp_path / "tiny")
    int8 = main(["--checkpoint_path", str(path), "--mode", "int8"])
    with pytest.raises(SystemExit, match="model_int8.pth is already quantized"):
        main(["--checkpoint_path", str(int8), "--mode", "int4"])
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(path.parent / "model_config.json", other)
    shutil.copy(int8, other / "model.pth")
    with pytest.raises(ValueError, match="model.pth holds int8 weights but its name says float"):
        checkpoint.load_model(other / "model.pth", "cpu", torch.float32)
    shutil.copy(path, other / "model_int4.g32.pth")
    with pytest.raises(ValueError, match="model_int4.g32.pth holds float weights but its name says int4 groupsize 32"):
        checkpoint.load_model(other / "model_int4.g32.pth", "cpu", torch.float32)
