"""invariant.py, batch-invariant mode: a token's row is the same from a one-token step and from a
verify of many, eager and compiled, and the mode's attention is attention."""
import copy

import pytest
import torch

import invariant
import packages
from attention import use_attention
from compiling import compile_function, cpu_settings
from conftest import invariant_cases, tiny_target
from cpu import PackedLinear, onednn_gemms, pack_linears
from invariant import WindowMask, invariant_attention
from model import ModelArgs, Transformer, TreeMask, transformer_configs
from test_model import TINY, make_model

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_batch_invariant_attention_is_attention(dtype):
    """The window form computes the same attention as the usual one (within rounding)."""
    model = make_model("tiny-llama", max_seq_length=96).to(dtype)
    plain_steps, _ = invariant_cases(model, dtype, 30, 12, 20)
    invariant.enable(model, window=16)
    steps, cases = invariant_cases(model, dtype, 30, 12, 20)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(steps.float(), plain_steps.float(), **tol)
    torch.testing.assert_close(cases["tree reversed"].float(), plain_steps.float(), **tol)


@pytest.mark.all_threads
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_invariant_attention_rows_do_not_depend_on_how_many_come_together(dtype):
    """The window form on its own, eager: for T of 1 to 64 queries (GQA, two batch rows), each row
    equals the one-query call's bit for bit, and is the attention over its old slots and its
    gathered recent ones; a query with no old slot (position < W) attends to its recent part only.
    The T tried put 1 or 2 rows past a 32-row block (where the kernel's matmuls take another path
    in some dtypes, measured), and pass 192 rows (where its row blocks grow to 64)."""
    torch.manual_seed(0)
    B, KV, G, S, D, T, W = 2, 3, 3, 600, 64, 64, 8
    q = torch.randn(B, T, KV * G, D, dtype=dtype).transpose(1, 2)  # strided as Attention.forward's q
    k, v = torch.randn(B, KV, S, D, dtype=dtype), torch.randn(B, KV, S, D, dtype=dtype)
    position = torch.randint(0, S - 20, (B, T))
    position[0, :3] = torch.tensor([0, 3, W])  # no old slot, no old slot and some recent ones missing, one old slot
    recent = torch.stack([torch.randperm(S)[:W + 1] for _ in range(B * T)]).view(B, T, W + 1)  # anywhere, as a tree's
    recent_ok = position[..., None] - W + torch.arange(W + 1) >= 0
    mask = WindowMask(position - W, recent, recent_ok)
    one = torch.cat([invariant_attention(q[:, :, t:t + 1], k, v, WindowMask(*(f[:, t:t + 1] for f in mask)))
                     for t in range(T)], 2)
    for n in (1, 2, 3, 10, 11, 12, 21, 22, 23, 32, 42, 43, 44, 53, 54, 55, 63, 64):  # rows 3n
        together = invariant_attention(q[:, :, :n], k, v, WindowMask(*(f[:, :n] for f in mask)))
        assert torch.equal(together, one[:, :, :n]), n
    kf, vf = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    rows = torch.arange(B)[:, None, None]
    keys = torch.cat([kf[:, :, None].expand(B, -1, T, S, D), kf[rows, :, recent].permute(0, 3, 1, 2, 4)], 3)
    values = torch.cat([vf[:, :, None].expand(B, -1, T, S, D), vf[rows, :, recent].permute(0, 3, 1, 2, 4)], 3)
    seen = torch.cat([torch.arange(S) < mask.old_end[..., None], recent_ok], -1)[:, None]  # [B, 1, T, S + W + 1]
    scores = (q.float()[..., None, :] @ keys.transpose(-1, -2)).squeeze(-2) * D ** -0.5
    expected = (torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)[..., None, :] @ values).squeeze(-2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(one.float(), expected, **tol)


@pytest.mark.all_threads
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_compiled_invariant_attention_rows_do_not_depend_on_how_many_come_together(dtype):
    """The window form compiled for the CPU, at SmolLM2's geometry (9 query and 3 KV heads of 64)
    over a 1,100-slot cache: each row of a 3- and a 32-query call (each count a graph) equals the
    one-query call's bit for bit, though the calls read the cache's first 512, 1,024 or all 1,100
    slots, as their latest query needs (attention.live_slots). When the two parts were merged outside
    the softmax, Inductor computed the merge's exp in a vector loop for one query and in a scalar tail
    loop for more, and float32 rows differed; the whole-model compiled test below (tiny-llama,
    head_dim 16, 4 query heads over 2 KV heads) did not show it. Compiled rows equal eager ones within
    rounding only (Inductor sums in its own order): steps and verifies run both compiled or both eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    B, KV, G, S, D, T, W = 1, 3, 3, 1100, 64, 32, 32
    q = torch.randn(B, T, KV * G, D, dtype=dtype).transpose(1, 2)
    k, v = torch.randn(B, KV, S, D, dtype=dtype), torch.randn(B, KV, S, D, dtype=dtype)
    position = torch.randint(W, S - 20, (B, T))
    position[:, :3] = torch.tensor([300, 310, 500])  # the 3-query call reads 512 slots, the 32-query one all
    recent = torch.stack([torch.randperm(S)[:W + 1] for _ in range(B * T)]).view(B, T, W + 1)
    mask = WindowMask(position - W, recent, position[..., None] - W + torch.arange(W + 1) >= 0)
    model = invariant.enable(make_model("tiny-llama"), window=W)  # (also what lets dynamo trace flash_rows)
    compiled = compile_function(invariant_attention, "cpu", (model,))  # in the mode's settings
    try:
        one = torch.cat([compiled(q[:, :, t:t + 1], k, v, WindowMask(*(f[:, t:t + 1] for f in mask)))
                         for t in range(T)], 2)
        for n in (3, 32):
            together = compiled(q[:, :, :n], k, v, WindowMask(*(f[:, :n] for f in mask)))
            assert torch.equal(together, one[:, :, :n]), n
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(one.float(), invariant_attention(q, k, v, mask).float(), **tol)
    finally:
        torch._dynamo.reset()


@pytest.mark.all_threads
@pytest.mark.parametrize("name", TINY)
@torch.no_grad()
def test_batch_invariant_rows_equal_one_token_steps_bf16(name):
    """In bfloat16, eager: every row of a tree verify (T up to 24 chain tokens among 48 nodes, more
    than one 32-row block of the attention's old part) equals the one-token step bit for bit.
    Without the mode the spread-out tree differs (the next test)."""
    model = make_model(name, max_seq_length=128).to(torch.bfloat16)
    invariant.enable(model, window=32)
    for P, T, region in ((5, 3, 3), (40, 24, 48)):
        model.setup_caches(1, 128)
        steps, cases = invariant_cases(model, torch.bfloat16, P, T, region)
        for case, logits in cases.items():
            assert torch.equal(logits, steps), (case, P, T)


# the eager tests below ask gemm_invariant_rows up to 32 rows, all of them: one probe of SmolLM2's
# shapes (its LM head's is the slow one), cached for the rest (tests/test_speculative.py too)
EAGER_ROWS_ASKED = 32


@pytest.mark.all_threads
@pytest.mark.parametrize("packed", [False, True])
@torch.no_grad()
def test_gemm_invariant_rows_is_where_eager_gemms_stop_giving_one_row_bits(packed):
    """invariant.gemm_invariant_rows: every row count up to its answer gives each row of each of the
    model's linears the bits of a one-row call (checked here on other data than the probe's), and
    where it is below what was asked one more row does not, for some linear. packed: the linears
    as an eager bf16 run on a CPU holds them (cpu.pack_linears: oneDNN's packed weights)."""
    net = smollm2_two_layers_bf16()
    if packed and not pack_linears(net):
        pytest.skip("this CPU's oneDNN has no bf16 support: pack_linears packs nothing")
    rows = invariant.gemm_invariant_rows(net, most=EAGER_ROWS_ASKED)
    assert invariant.gemm_invariant_rows(net, most=3) == min(3, rows)  # generate.py asks up to a tree's size
    linears = [mod for mod in net.modules() if type(mod) in (torch.nn.Linear, PackedLinear)]
    assert linears and all((type(lin) is PackedLinear) == packed for lin in linears)
    x = torch.randn(rows + 1, net.config.intermediate_size, generator=torch.Generator().manual_seed(5))
    for lin in linears:
        xs = x[:, :lin.in_features].to(torch.bfloat16)
        alone = torch.cat([lin(r) for r in xs.split(1)])
        assert all(torch.equal(lin(xs[:n]), alone[:n]) for n in range(1, rows + 1)), lin
    if rows < EAGER_ROWS_ASKED:  # some linear gives a call of rows + 1 other bits
        assert any(invariant._linear_rows(lin.weight.dtype, lin.out_features, lin.in_features, most=rows + 1,
                                        packed=packed, threads=torch.get_num_threads()) == rows
                   for lin in linears)


SMOLLM2_WIDTHS = dict(dim=576, n_head=9, n_local_heads=3, intermediate_size=1536, vocab_size=1024)


def smollm2_two_layers_bf16():
    torch.manual_seed(0)
    config = ModelArgs(**{**transformer_configs["SmolLM2-135M"], "n_layer": 2})
    model = Transformer(config).eval().to(torch.bfloat16)
    model.setup_caches(1, 256)
    use_attention(model)
    return model


@pytest.mark.all_threads
@pytest.mark.parametrize("packed", [False, True])
def test_batch_invariant_eager_verify_rows_equal_one_token_steps_bf16(packed):
    """In the mode, eager, a verify of as many nodes as invariant.gemm_invariant_rows finds this CPU's
    GEMMs invariant for (up to 32 here) gives every row the bits of one-token steps, however the
    tree lays out its keys (compiled, 64 in the next tests).
    Without the mode a 48-node verify's rows differ from the steps' on some CPUs and not on others,
    so that side is not asserted.
    packed: the linears as generate.py runs eager bf16 on a CPU (pack_linears), which
    gemm_invariant_rows probes as packed (it once looked for nn.Linear only and, finding none,
    allowed any tree, where a packed down projection rounds calls of 2 rows or more apart)."""
    model = smollm2_two_layers_bf16()
    if packed and not pack_linears(model):
        pytest.skip("this CPU's oneDNN has no bf16 support: pack_linears packs nothing")
    invariant.enable(model, window=32)
    region = invariant.gemm_invariant_rows(model, most=EAGER_ROWS_ASKED)
    steps, cases = invariant_cases(model, torch.bfloat16, 100, min(12, region), region)
    assert all(torch.equal(logits, steps) for logits in cases.values())


@pytest.mark.all_threads
@pytest.mark.autotune  # the GEMMs generate.py compiles (templates, or oneDNN's): they are what must be invariant
@pytest.mark.parametrize("dtype,widths", [(torch.bfloat16, {}), (torch.float16, {}), (torch.float32, {}),
                                          (torch.bfloat16, SMOLLM2_WIDTHS)])
@torch.no_grad()
def test_batch_invariant_compiled_step_and_verify_graphs_give_equal_rows(dtype, widths):
    """Compiled for the CPU (Inductor, freezing, C++ GEMM templates or, where cpu.onednn_gemms, oneDNN's),
    the one-token step and the verify are different graphs; in batch-invariant mode their rows agree bit
    for bit for trees of 16 and 64 nodes in bf16 (at tiny-llama's and SmolLM2's widths), of 64 in fp16
    and float32 (eager, float32 and float16 GEMMs are not row-count invariant: invariant.problem).
    Four layers, not tiny-llama's two: Inductor inlines a chain of residual adds into the kernels
    that read it and stores the sum where the chain grows too long, which a two- or three-layer
    graph does at the same adds in both graphs and a four-layer one does not; without the mode's
    emulate_precision_casts (compiling.CPU_INVARIANT) the unrounded sums then gave every row of
    the bf16 case apart, as they did for the whole of SmolLM2."""
    torch._dynamo.reset()
    model = tiny_target("tiny-llama", n_layer=4, **widths).to(dtype)
    invariant.enable(model, window=32)
    compiled = compile_function(model.forward, "cpu", (model,))
    eager_forward, model.forward = model.forward, compiled
    try:
        # bf16, the default, also at 16 nodes; the other dtypes at 64 only (each shape is a compile)
        for P, T, region in ((20, 8, 16), (30, 30, 64)) if dtype == torch.bfloat16 else ((30, 30, 64),):
            model.setup_caches(1, 160)
            steps, cases = invariant_cases(model, dtype, P, T, region, prefill=eager_forward)
            assert torch.equal(cases["tree spread"], steps), (T, region)
            assert torch.equal(cases["tree reversed"], steps), (T, region)
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()


def step_logits(model, idx, input_pos):
    return model(idx, input_pos)


def verify_logits(model, idx, input_pos, cache_pos, prefix_len, visible):
    return model(idx, input_pos, cache_pos, TreeMask(prefix_len, visible))


class PackagedForward:
    """A model's steps and verifies through packages (packages.py), as invariant_cases calls a model."""

    def __init__(self, model, folder):
        self.max_seq_length, self.config, self.tok_embeddings = model.max_seq_length, model.config, model.tok_embeddings
        self.step = packages.Packaged(step_logits, model, "step", folder)
        self.verify = packages.Packaged(verify_logits, model, "verify", folder)

    def __call__(self, idx, input_pos, cache_pos=None, mask=None):
        if mask is None:
            return self.step(idx, input_pos)
        return self.verify(idx, input_pos, cache_pos, mask.prefix_len, mask.visible)


@pytest.mark.all_threads
@pytest.mark.autotune
@torch.no_grad()
def test_batch_invariant_packaged_step_and_verify_give_equal_rows(tmp_path):
    """As the compiled test above, through AOTInductor packages, which generate.py runs on a CPU: where
    GEMMs go to oneDNN their graphs pack the weights (cpu.packed_in_graph) and steps run as two
    tokens (invariant.step_as_two); at SmolLM2's widths in bf16, trees of 16 and 64 nodes."""
    model = tiny_target("tiny-llama", n_layer=4, **SMOLLM2_WIDTHS).to(torch.bfloat16)
    invariant.enable(model, window=32)
    model.setup_caches(1, 160)
    packaged = PackagedForward(model, tmp_path)
    for P, T, region in ((20, 8, 16), (30, 30, 64)):
        model.setup_caches(1, 160)
        steps, cases = invariant_cases(packaged, torch.bfloat16, P, T, region, prefill=model)
        assert torch.equal(cases["tree spread"], steps), (T, region)
        assert torch.equal(cases["tree reversed"], steps), (T, region)
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.so")) == ["step", "verify", "verify"]


@pytest.mark.all_threads
@pytest.mark.skipif(not onednn_gemms(torch.bfloat16), reason="compiled bf16 GEMMs are Inductor's templates here")
@torch.no_grad()
def test_compiled_onednn_linear_gives_a_row_called_twice_the_bits_of_many_rows():
    """Compiled as the mode compiles where GEMMs go to oneDNN, SmolLM2's down projection (1,536 inputs):
    a call of one row twice (what invariant.step_as_two makes of a step) gives each of 256 rows the
    bits that calls of 2, 3, 8 and 16 rows give it (a one-row call does not: 27 of 147,456 outputs
    differ on a Zen 5, too few for the model-level test above to meet). The mode compiles with
    ATen's GEMMs alone here."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1536, 576, bias=False)).to(torch.bfloat16).eval()
    forward = compile_function(net.forward, "cpu", (net,))
    assert cpu_settings((net,))["max_autotune_gemm_backends"] == "ATEN"
    x = torch.randn(256, 1536, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    try:
        alone = torch.cat([forward(row.repeat(2, 1))[:1] for row in x.split(1)])
        for m in (2, 3, 8, 16):
            assert torch.equal(torch.cat([forward(rows) for rows in x.split(m)]), alone), m
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(not onednn_gemms(torch.bfloat16), reason="the mode steps one token as one row here")
@torch.no_grad()
def test_step_as_two_is_the_first_row_of_a_two_token_call_and_writes_the_steps_cache_entry():
    """In the mode where GEMMs go to oneDNN, a one-token step (logits, features and layer inputs) is
    the first row of a call of its token twice at its position, it writes the cache entry that call
    writes, and a deepcopy of the model steps so too."""
    model = invariant.enable(smollm2_two_layers_bf16(), window=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    model(ids[:, :19], torch.arange(19))
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin
    got = model(ids[:, 19:], torch.tensor([19]), return_features=True, layer_ids=(1,))
    pos = torch.tensor([[19, 19]])
    mask = invariant.window_mask(None, pos, pos, twin.max_seq_length, twin.invariant_window)
    want = Transformer.forward(twin, ids[:, [19, 19]], pos, pos, mask, return_features=True, layer_ids=(1,))
    for g, w in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        assert g.shape[:2] == (1, 1) and torch.equal(g, w[:, :1])
    assert torch.equal(model.kv_storage, twin.kv_storage)
    assert torch.equal(twin(ids[:, 19:], torch.tensor([19])), got[0])


def test_flash_rows_pads_only_where_the_kernel_rounds_apart_and_leaves_sampling_alone():
    """invariant.flash_rows' probe: a row count the kernel computes like whole blocks is kept as it is
    (a multiple of the block, by definition), any answer is at least the count asked for and is
    itself kept; the probe draws from its own generator, so the global random stream (what
    sampling draws from) continues as if it had not run."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    invariant._flash_rows_probe.cache_clear()
    for dtype in (torch.bfloat16, torch.float32):
        assert invariant.flash_rows(dtype, 64, 512, invariant.FLASH_BLOCK) == invariant.FLASH_BLOCK
        for rows in (1, 2, 3, 33):
            padded = invariant.flash_rows(dtype, 64, 512, rows)
            assert rows <= padded < rows + 2 * invariant.FLASH_BLOCK
            assert invariant.flash_rows(dtype, 64, 512, padded) == padded
    assert torch.equal(torch.rand(4), expected)


def test_batch_invariant_cache_holds_at_least_512_slots_on_a_cpu():
    """Over fewer than 512 keys ATen's CPU kernel rounds some bf16 rows of long calls apart (model.
    invariant.MIN_SLOTS), so the mode's cache is never shorter; invariant.enable grows
    a cache set up before it."""
    model = make_model("tiny-llama", max_seq_length=96)
    invariant.enable(model)
    assert model.max_seq_length == invariant.MIN_SLOTS
    assert model.layers[0].attention.kv_cache.k_cache.size(2) == invariant.MIN_SLOTS
    model.setup_caches(1, 600)
    assert model.max_seq_length == 600


def test_batch_invariant_mode_errors():
    model = make_model("tiny-llama")
    invariant.enable(model, window=4)
    dense = torch.ones(1, 1, 64, dtype=torch.bool)
    with pytest.raises(ValueError, match="causal mask .None. or a TreeMask"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), mask=dense)
    visible = torch.ones(1, 2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="one query per tree node"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.arange(2), torch.arange(2),
              TreeMask(torch.tensor([0]), visible))


def test_enable_refuses_a_sliding_window_and_a_second_call_only_moves_the_window():
    model = tiny_target(sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        invariant.enable(model)
    model = make_model("tiny-llama")
    invariant.enable(model, window=8)
    invariant.enable(model, window=16)
    assert model.invariant_window == 16 and len(model._forward_pre_hooks) == 1


@pytest.mark.all_threads
@torch.no_grad()
def test_compiled_step_and_round_trace_the_modes_hooks_and_give_plain_decodings_tokens():
    """What generate.py --compile runs in the mode: the decode step and the round compiled as
    wholes (compiling.compile_step, compile_round), the mode's forward hooks traced into their
    graphs, the prefill eager; bf16 greedy speculative output equals compiled plain decoding's."""
    import generate as gen
    import speculative
    from compiling import compile_round, compile_step
    from conftest import mirrored_pair

    torch._dynamo.reset()
    target, draft = mirrored_pair(seed=4)
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    invariant.enable(target)
    spec = speculative.Speculator(target, draft, tree_top_k=4, tree_depth=3, tree_tokens=10, lookup=3)
    spec.setup(1, 96)
    round_fn = compile_round(spec).round
    step = compile_step(gen.decode_one_token, "cpu", target)
    try:
        for seed in (1, 2):
            prompt = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(seed))
            plain = gen.generate(target, prompt, 40, decode_fn=step)
            ids, rounds = speculative.speculative_generate(spec, prompt, 40, round_fn=round_fn)
            assert ids == plain and max(map(max, rounds)) > 1
    finally:
        torch._dynamo.reset()


def test_a_deepcopy_of_a_model_in_the_mode_grows_its_own_cache():
    model = make_model("tiny-llama", max_seq_length=96)
    invariant.enable(model)
    twin = copy.deepcopy(model)
    twin.setup_caches(1, 700)
    assert twin.max_seq_length == 700 and model.max_seq_length == invariant.MIN_SLOTS
