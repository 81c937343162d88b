"""model.py on its own: the KV cache, and the masked multi-token forward that tree verification needs."""
import pytest
import torch

from conftest import invariant_cases, tiny_target
from model import ModelArgs, Transformer, TreeMask, copy_slots, eager_invariant_rows, transformer_configs

TINY = ["tiny-llama", "tiny-llama-3.1", "tiny-qwen2"]


def make_model(name, max_batch_size=1, max_seq_length=64, seed=0):
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.from_name(name)).eval()
    # Random biases: the default init leaves them at zero, which would hide a bias bug.
    for layer in model.layers:
        if layer.attention.wqkv.bias is not None:
            torch.nn.init.normal_(layer.attention.wqkv.bias, std=0.5)
    model.setup_caches(max_batch_size, max_seq_length)
    return model


@pytest.mark.parametrize("name", TINY)
@torch.no_grad()
def test_incremental_decoding_equals_full_forward(name):
    model = make_model(name)
    tokens = torch.randint(0, model.config.vocab_size, (1, 24))
    full = model(tokens, torch.arange(24))
    model.setup_caches(1, 64)
    steps = [model(tokens[:, :5], torch.arange(5))]
    steps += [model(tokens[:, t:t + 1], torch.tensor([t])) for t in range(5, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def _sequential_logits(model, prefix, path):
    """Logits of the last token of prefix + path, computed by plain prefill + one-token decode."""
    ids = prefix + path
    model(torch.tensor([ids[:len(prefix)]]), torch.arange(len(prefix)))
    logits = None
    for t in range(len(prefix), len(ids)):
        logits = model(torch.tensor([[ids[t]]]), torch.tensor([t]))
    return logits[0, -1]


@pytest.mark.parametrize("name", TINY)
@torch.no_grad()
def test_tree_forward_equals_sequential_decoding(name):
    """A tree of T tokens in T consecutive slots after the prefix, at positions prefix_len + depth,
    each node seeing the prefix and its ancestors only, gives every node the logits that plain
    decoding of its root-to-node path gives; rows of the batch have prefixes of different lengths."""
    model = make_model(name, max_batch_size=2)
    V = model.config.vocab_size
    #        0
    #      / | \
    #     1  2  3
    #    / \     \
    #   4   5     6
    #   |
    #   7
    parents = [-1, 0, 0, 0, 1, 1, 3, 4]
    T = len(parents)
    depth = [0] * T
    ancestors = torch.eye(T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            ancestors[i] |= ancestors[p]
    prefixes = [torch.randint(0, V, (11,)).tolist(), torch.randint(0, V, (6,)).tolist()]
    trees = torch.randint(0, V, (2, T))

    # Prefill both rows in one call; the shorter prefix is padded into slots it never attends to
    # (the tree overwrites them).
    S = model.max_seq_length
    P0, P1 = len(prefixes[0]), len(prefixes[1])
    padded = torch.tensor([prefixes[0], prefixes[1] + [0] * (P0 - P1)])
    pos = torch.arange(P0).expand(2, P0)
    mask = (torch.arange(S) <= pos[..., None])
    model(padded, pos, pos, mask)

    prefix_len = torch.tensor([P0, P1])
    depth_t = torch.tensor(depth)
    input_pos = prefix_len[:, None] + depth_t
    cache_pos = prefix_len[:, None] + torch.arange(T)
    slot = torch.arange(S)
    rel = slot - prefix_len[:, None]  # [2, S]: index of the tree node in each slot
    in_tree = (rel >= 0) & (rel < T)
    tree_vis = ancestors[:, rel.clamp(0, T - 1)].permute(1, 0, 2) & in_tree[:, None, :]  # [2, T, S]
    mask = (slot < prefix_len[:, None])[:, None, :] | tree_vis
    tree_logits = model(trees, input_pos, cache_pos, mask)

    for b in range(2):
        for i in range(T):
            path, node = [], i
            while node >= 0:
                path.insert(0, int(trees[b, node]))
                node = parents[node]
            ref_model = make_model(name)  # fresh cache, same weights (same seed)
            expected = _sequential_logits(ref_model, prefixes[b], path)
            torch.testing.assert_close(tree_logits[b, i], expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_features_and_layer_inputs():
    model = make_model("tiny-llama")
    tokens = torch.randint(0, model.config.vocab_size, (1, 7))
    logits, features, layer_inputs = model(tokens, torch.arange(7), layer_ids=(0, 1))
    torch.testing.assert_close(logits, model.output(features))
    torch.testing.assert_close(layer_inputs[0], model.tok_embeddings(tokens))
    assert len(layer_inputs) == 2 and layer_inputs[1].shape == features.shape


def test_config_lookup_by_name():
    assert ModelArgs.from_name("Meta-Llama-3.1-8B-Instruct").rope_scaling is not None
    assert ModelArgs.from_name("Meta-Llama-3-8B-Instruct").rope_scaling is None
    assert ModelArgs.from_name("Llama-2-7b-chat-hf").dim == 4096
    assert ModelArgs.from_name("vicuna-13b-v1.3").n_layer == 40
    assert ModelArgs.from_name("SmolLM2-135M-Instruct").n_local_heads == 3
    assert ModelArgs.from_name("Qwen2.5-Coder-1.5B-Instruct").qkv_bias
    with pytest.raises(ValueError, match="unknown model name"):
        ModelArgs.from_name("gpt2-xl")
    for name, cfg in transformer_configs.items():
        args = ModelArgs(**cfg)
        assert args.n_head % args.n_local_heads == 0, name


def test_forward_without_caches_is_a_clear_error():
    model = Transformer(ModelArgs.from_name("tiny-llama"))
    with pytest.raises(RuntimeError, match="setup_caches"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))


@pytest.mark.parametrize("T, S", [(5, 30), (256, 1024)])
def test_cpu_half_precision_attention_path_equals_sdpa(T, S):
    """bf16/fp16 attention on CPU runs as plain matmuls up to MATMUL_ATTENTION_MAX_SCORES scores
    (SDPA is slow there for few rows), as SDPA past it: the same result either way."""
    import torch.nn.functional as F
    from model import MATMUL_ATTENTION_MAX_SCORES, _matmul_attention, attention

    assert (2 * 6 * T * S < MATMUL_ATTENTION_MAX_SCORES) == (T == 5)  # one case on each side
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, T, 16), torch.randn(2, 2, S, 16), torch.randn(2, 2, S, 16)
    mask = torch.rand(2, T, S) > 0.3
    mask[..., 0] = True  # every query sees something
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(_matmul_attention(q, k, v, mask), reference, atol=1e-5, rtol=1e-5)
    half = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    torch.testing.assert_close(half.float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("T", [1, 7])
@torch.no_grad()
def test_cpu_gqa_attention_stacks_query_heads_and_equals_sdpa(T):
    """On a CPU the query heads that share a KV head go to SDPA as rows of one call (its GQA mode
    is slow there): the same attention as enable_gqa, head by head and query by query, each row
    with its own mask, compiled too (the path generate.py --compile takes)."""
    import torch.nn.functional as F
    from model import _grouped_sdpa, attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, T, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.rand(2, T, 40) > 0.3
    mask[..., 0] = True  # every query sees something
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(_grouped_sdpa(q, k, v, mask), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention(q, k, v, mask), reference, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(attention, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask).float(), reference,
                               atol=3e-2, rtol=3e-2)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["tiny-llama", "mistral-sliding"])
@torch.no_grad()
def test_kv_len_reads_only_the_live_slots_and_changes_nothing(name):
    """kv_len (eager CPU decoding passes the live length) gives the logits of the full cache."""
    if name == "mistral-sliding":
        torch.manual_seed(0)
        model = Transformer(ModelArgs(**{**ModelArgs.from_name("tiny-llama").to_dict(), "sliding_window": 6})).eval()
        model.setup_caches(1, 64)
    else:
        model = make_model(name)
    tokens = torch.randint(0, model.config.vocab_size, (1, 20))
    full = model(tokens, torch.arange(20))
    model.setup_caches(1, 64)
    steps = [model(tokens[:, :5], torch.arange(5), kv_len=5)]
    steps += [model(tokens[:, t:t + 1], torch.tensor([t]), kv_len=t + 1) for t in range(5, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kv_len"):
        model(tokens[:, :1], torch.tensor([0]), kv_len=65)


@torch.no_grad()
def test_layer_inputs_come_in_the_order_asked_and_bad_ids_are_errors():
    model = make_model("tiny-llama")
    tokens = torch.randint(0, model.config.vocab_size, (1, 6))
    _, _, first = model(tokens, torch.arange(6), layer_ids=(0,))
    _, _, both = model(tokens, torch.arange(6), layer_ids=(1, 0, 1))
    torch.testing.assert_close(both[1], first[0])
    torch.testing.assert_close(both[1], model.tok_embeddings(tokens))  # layer 0's input is the embedding
    torch.testing.assert_close(both[0], both[2])
    with pytest.raises(ValueError, match="layers the model does not have"):
        model(tokens, torch.arange(6), layer_ids=(2,))


@torch.no_grad()
def test_copy_slots_moves_entries_of_every_layer_at_once():
    """Every layer's cache is a view of kv_storage, so one copy_slots moves keys and values in all
    of them; sources and destinations may overlap (reads come first)."""
    model = make_model("tiny-llama", max_batch_size=2, max_seq_length=32)
    model.kv_storage.normal_()
    before = model.kv_storage.clone()
    src, dst = torch.tensor([[5, 6, 7], [20, 3, 9]]), torch.tensor([[6, 7, 8], [0, 1, 2]])
    copy_slots(model, src, dst)
    expected = before.clone()
    for b in range(2):
        for i in range(3):
            expected[:, :, b, :, dst[b, i]] = before[:, :, b, :, src[b, i]]
    assert torch.equal(model.kv_storage, expected)
    for layer, storage in zip(model.layers, model.kv_storage):
        assert torch.equal(layer.attention.kv_cache.k_cache, storage[0])
        assert torch.equal(layer.attention.kv_cache.v_cache, storage[1])
    # .double() after setup copies each buffer on its own; setup_caches makes the views again
    model.double()
    model.setup_caches(2, 32)
    model.kv_storage.zero_()
    assert all(not layer.attention.kv_cache.k_cache.any() for layer in model.layers)


def test_forward_with_grad_mode_on_after_setup_without():
    """Caches made under no_grad (as generation does) still take writes from a forward with grad
    mode on, and those writes land in the model's one KV storage."""
    model = make_model("tiny-llama")  # setup_caches ran outside no_grad; redo it inside
    model.max_seq_length = -1
    with torch.no_grad():
        model.setup_caches(1, 16)
    logits = model(torch.tensor([[1, 2, 3]]), torch.arange(3))
    assert logits.shape == (1, 3, 512) and model.kv_storage[:, :, 0, :, :3].abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# Batch-invariant mode: a token's row is the same from a one-token step and from a verify of many
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_batch_invariant_attention_is_attention(dtype):
    """The window form computes the same attention as the usual one (within rounding)."""
    model = make_model("tiny-llama", max_seq_length=96).to(dtype)
    plain_steps, _ = invariant_cases(model, dtype, 30, 12, 20)
    model.invariant_window = 16
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
    from model import WindowMask, invariant_attention
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
    over a 512-slot cache at positions past 300: each row of a 3-, 12- and 32-query call equals the
    one-query call's bit for bit. When the two parts were merged outside the kernel, Inductor
    computed the merge's exp in a vector loop for one query and in a scalar tail loop for more, and
    float32 rows differed (2 of 3, 12 of 12, 29 of 32 here); the whole-model compiled test below
    (tiny-llama, head_dim 16, 4 query heads over 2 KV heads) did not show it."""
    import speculative
    from model import WindowMask, invariant_attention
    torch._dynamo.reset()
    torch.manual_seed(0)
    B, KV, G, S, D, T, W = 1, 3, 3, 512, 64, 32, 32
    q = torch.randn(B, T, KV * G, D, dtype=dtype).transpose(1, 2)
    k, v = torch.randn(B, KV, S, D, dtype=dtype), torch.randn(B, KV, S, D, dtype=dtype)
    position = 300 + torch.randint(0, 20, (B, T))
    recent = torch.stack([torch.randperm(S)[:W + 1] for _ in range(B * T)]).view(B, T, W + 1)
    mask = WindowMask(position - W, recent, position[..., None] - W + torch.arange(W + 1) >= 0)
    holder = torch.nn.Module()
    holder.invariant_window = W  # what makes compile_function compile in the mode's settings
    compiled = speculative.compile_function(invariant_attention, "cpu", (holder,))
    try:
        one = torch.cat([compiled(q[:, :, t:t + 1], k, v, WindowMask(*(f[:, t:t + 1] for f in mask)))
                         for t in range(T)], 2)
        for n in (3, 12, 32):
            together = compiled(q[:, :, :n], k, v, WindowMask(*(f[:, :n] for f in mask)))
            assert torch.equal(together, one[:, :, :n]), n
        torch.testing.assert_close(one, invariant_attention(q, k, v, mask), atol=0, rtol=0)
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
    model.invariant_window = 32
    for P, T, region in ((5, 3, 3), (40, 24, 48)):
        model.setup_caches(1, 128)
        steps, cases = invariant_cases(model, torch.bfloat16, P, T, region)
        for case, logits in cases.items():
            assert torch.equal(logits, steps), (case, P, T)


# the eager tests below ask eager_invariant_rows up to 32 rows, all of them: one probe of SmolLM2's
# shapes (its LM head's ~6 s on a 2-core Zen 3), cached for the rest (tests/test_speculative.py too)
EAGER_ROWS_ASKED = 32


@pytest.mark.all_threads
@pytest.mark.parametrize("packed", [False, True])
@torch.no_grad()
def test_eager_invariant_rows_is_where_eager_gemms_stop_giving_one_row_bits(packed):
    """model.eager_invariant_rows: every row count up to its answer gives each row of each of the
    model's linears the bits of a one-row call (checked here on other data than the probe's), and
    where it is below what was asked one more row does not, for some linear. packed: the linears
    as an eager bf16 run on a CPU holds them (model.pack_linears: oneDNN's packed weights)."""
    import model as m
    net = smollm2_two_layers_bf16()
    if packed and not m.pack_linears(net):
        pytest.skip("this CPU's oneDNN has no bf16 support: pack_linears packs nothing")
    rows = m.eager_invariant_rows(net, most=EAGER_ROWS_ASKED)
    assert m.eager_invariant_rows(net, most=3) == min(3, rows)  # generate.py asks up to a tree's size
    linears = [mod for mod in net.modules() if type(mod) in (torch.nn.Linear, m.PackedLinear)]
    assert linears and all((type(lin) is m.PackedLinear) == packed for lin in linears)
    x = torch.randn(rows + 1, net.config.intermediate_size, generator=torch.Generator().manual_seed(5))
    for lin in linears:
        xs = x[:, :lin.in_features].to(torch.bfloat16)
        alone = torch.cat([lin(r) for r in xs.split(1)])
        assert all(torch.equal(lin(xs[:n]), alone[:n]) for n in range(1, rows + 1)), lin
    if rows < EAGER_ROWS_ASKED:  # some linear gives a call of rows + 1 other bits
        assert any(m._eager_linear_rows(lin.weight.dtype, lin.out_features, lin.in_features, most=rows + 1,
                                        packed=packed, threads=torch.get_num_threads()) == rows
                   for lin in linears)


def smollm2_two_layers_bf16():
    torch.manual_seed(0)
    config = ModelArgs(**{**transformer_configs["SmolLM2-135M"], "n_layer": 2})
    model = Transformer(config).eval().to(torch.bfloat16)
    model.setup_caches(1, 256)
    return model


@pytest.mark.all_threads
@pytest.mark.parametrize("packed", [False, True])
def test_batch_invariant_eager_verify_rows_equal_one_token_steps_bf16(packed):
    """In the mode, eager, a verify of as many nodes as model.eager_invariant_rows finds this CPU's
    GEMMs invariant for (up to 32 here) gives every row the bits of one-token steps, however the
    tree lays out its keys (compiled, 64 in the next tests).
    Without the mode a 48-node verify's rows differed from the steps' on the AMX Xeon; on an AMD
    EPYC (AVX-512, no AMX) torch 2.13's eager bf16 GEMMs gave equal rows for 12-128 nodes, so that
    side depends on the CPU and is not asserted.
    packed: the linears as generate.py runs eager bf16 on a CPU (pack_linears), which
    eager_invariant_rows probes as packed. (It looked for nn.Linear only and, finding none, allowed
    any tree: on an AMD EPYC (Zen 4) the packed 1536 -> 576 down projection rounds calls of 2 rows
    or more apart, and a verify's rows differed from the steps'.)"""
    from model import pack_linears
    model = smollm2_two_layers_bf16()
    if packed and not pack_linears(model):
        pytest.skip("this CPU's oneDNN has no bf16 support: pack_linears packs nothing")
    model.invariant_window = 32
    region = eager_invariant_rows(model, most=EAGER_ROWS_ASKED)
    steps, cases = invariant_cases(model, torch.bfloat16, 100, min(12, region), region)
    assert all(torch.equal(logits, steps) for logits in cases.values())


@pytest.mark.all_threads
@pytest.mark.autotune  # the C++ GEMM templates, as generate.py compiles: they are what must be invariant
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@torch.no_grad()
def test_batch_invariant_compiled_step_and_verify_graphs_give_equal_rows(dtype):
    """Compiled for the CPU (Inductor, freezing, C++ GEMM templates), the one-token step and the
    verify are different graphs; in batch-invariant mode their rows agree bit for bit for trees of
    16 and 64 nodes in bf16, of 64 in fp16 and float32 (eager, float32 and float16 GEMMs are not
    row-count invariant: generate.batch_invariant_problem).
    Four layers, not tiny-llama's two: Inductor inlines a chain of residual adds into the kernels
    that read it and stores the sum where the chain grows too long, which a two- or three-layer
    graph does at the same adds in both graphs and a four-layer one does not; without the mode's
    emulate_precision_casts (speculative.CPU_INVARIANT) the unrounded sums then gave every row of
    the bf16 case apart (torch 2.13, a Zen 4), as they did for the whole of SmolLM2."""
    import speculative
    torch._dynamo.reset()
    model = tiny_target("tiny-llama", n_layer=4).to(dtype)
    model.invariant_window = 32
    compiled = speculative.compile_function(torch._dynamo.dont_skip_tracing(model.forward), "cpu", (model,))
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


def test_flash_rows_pads_only_where_the_kernel_rounds_apart_and_leaves_sampling_alone():
    """model.flash_rows' probe: a row count the kernel computes like whole blocks is kept as it is
    (a multiple of the block, by definition), any answer is at least the count asked for and is
    itself kept; the probe draws from its own generator, so the global random stream (what
    sampling draws from) continues as if it had not run."""
    import model
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    model._flash_rows_probe.cache_clear()
    for dtype in (torch.bfloat16, torch.float32):
        assert model.flash_rows(dtype, 64, 512, model.FLASH_BLOCK) == model.FLASH_BLOCK
        for rows in (1, 2, 3, 33):
            padded = model.flash_rows(dtype, 64, 512, rows)
            assert rows <= padded < rows + 2 * model.FLASH_BLOCK
            assert model.flash_rows(dtype, 64, 512, padded) == padded
    assert torch.equal(torch.rand(4), expected)


def test_batch_invariant_cache_holds_at_least_512_slots_on_a_cpu():
    """Over fewer than 512 keys ATen's CPU kernel rounds some bf16 rows of long calls apart (model.
    INVARIANT_MIN_SLOTS), so the mode's cache is never shorter; generate.set_batch_invariant grows
    a cache set up before it."""
    import generate
    from model import INVARIANT_MIN_SLOTS
    model = make_model("tiny-llama", max_seq_length=96)
    generate.set_batch_invariant(model)
    assert model.max_seq_length == INVARIANT_MIN_SLOTS
    assert model.layers[0].attention.kv_cache.k_cache.size(2) == INVARIANT_MIN_SLOTS
    model.setup_caches(1, 600)
    assert model.max_seq_length == 600


def test_batch_invariant_mode_errors():
    model = make_model("tiny-llama")
    model.invariant_window = 4
    dense = torch.ones(1, 1, 64, dtype=torch.bool)
    with pytest.raises(ValueError, match="causal mask .None. or a TreeMask"):
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), mask=dense)
    visible = torch.ones(1, 2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="one query per tree node"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.arange(2), torch.arange(2),
              TreeMask(torch.tensor([0]), visible))
