"""EAGLE speculative decoding (speculative.Speculator): greedy output equals vanilla greedy token for
token, sampled output is distributed exactly as vanilla sampling, and the KV cache after the
rounds equals vanilla's."""
import copy
import itertools

import pytest
import torch

import checkpoint
import generate as gen
import invariant
import sampling
import speculative
from attention import use_attention
from compiling import compile_round
from conftest import ROOT, eagle3_pair, mirrored_pair, random_draft, random_eagle3_draft, tiny_target
from draft import Eagle3Draft, draft_config_for, eagle3_layer_ids
from trees import Tree, mc_sim_7b_63, static_tree, tree_structure

METHODS = {
    "eagle": dict(static=static_tree(mc_sim_7b_63)),
    "eagle2": dict(),  # top_k 10, depth 6, 60 tokens
    "eagle3": dict(tree_depth=8),  # an EAGLE-3 draft over a reduced vocabulary, top_k 10, 60 tokens
}


def draft_for(method, target, **kw):
    """A random draft of the kind the method runs."""
    return random_eagle3_draft(target, **kw) if method == "eagle3" else random_draft(target, **kw)


def pair_for(method, **kw):
    """A target and a draft that predicts it well (long accepted runs) for the method."""
    return eagle3_pair(**kw) if method == "eagle3" else mirrored_pair(**kw)


def vanilla(target, prompt, n, **kw):
    target.setup_caches(prompt.size(0), prompt.size(1) + n)
    return gen.generate(target, prompt, n, **kw)


def prompts(count, vocab, seed=0, lengths=(3, 17)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, int(torch.randint(*lengths, (1,), generator=g))), generator=g)
            for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# Greedy: token-for-token equality (float32)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_greedy_equals_vanilla_random_draft(method):
    target = tiny_target("tiny-llama")
    spec = speculative.Speculator(target, draft_for(method, target), **METHODS[method])
    for prompt in prompts(20, 512):
        ids, _ = speculative.speculative_generate(spec, prompt, 40)
        assert ids == vanilla(target, prompt, 40)


# compiled: an EAGLE-1/2 draft on the static tree (eagle) and EAGLE-3's on the dynamic tree (eagle3),
# one graph each (each batch size is a graph of its own, ~1.5 min to compile here): EAGLE-3 at batch
# 1, what generate.py runs, the static tree on the batch; eagle2 is compiled below with lookup nodes
# and forced plain steps (test_compiled_decoding_follows_every_call_...)
@pytest.mark.parametrize("method, compiled", [(m, False) for m in METHODS] + [("eagle", True), ("eagle3", True)],
                         ids=[f"eager-{m}" for m in METHODS] + ["compiled-eagle", "compiled-eagle3"])
@torch.no_grad()
def test_greedy_equals_vanilla_with_long_acceptances(method, compiled):
    """A draft that mirrors the target gets most guesses accepted: deep paths, compaction of
    several tokens per round, and rows of a batch that accept different lengths."""
    target, draft = pair_for(method)
    spec = speculative.Speculator(target, draft, **METHODS[method])
    spec.setup(4, 128)
    if compiled:  # every Speculator compiles the same code object: stay clear of dynamo's recompile limit
        torch._dynamo.reset()
    round_fn = compile_round(spec, compile_prefill=False).round if compiled else None
    singles, batched = not compiled or method == "eagle3", not compiled or method == "eagle"
    taus = []
    for prompt in prompts(20, 512, seed=1, lengths=(3, 40)) if singles else []:
        ids, per_round = speculative.speculative_generate(spec, prompt, 60, round_fn=round_fn)
        assert ids == vanilla(target, prompt, 60)
        taus.append(sum(per_round[0]) / len(per_round[0]))
    if batched:  # a batch of different prompts of one length: each row on its own schedule
        batch = torch.cat([p[:, :8] for p in prompts(4, 512, seed=2, lengths=(8, 9))])
        ids, per_round = speculative.speculative_generate(spec, batch, 60, round_fn=round_fn)
        assert ids == [vanilla(target, batch[b:b + 1], 60)[0] for b in range(4)]
        assert len({len(r) for r in per_round}) > 1  # the rows needed different numbers of rounds
        taus += [sum(r) / len(r) for r in per_round]
    assert sum(taus) / len(taus) > 2.5  # the test exercises real acceptance


@torch.no_grad()
def test_a_bfloat16_eagle3_draft_leaves_float32_output_unchanged():
    """--draft_dtype bfloat16 under a float32 target: the draft's guesses change, the output does not."""
    target, draft = eagle3_pair()
    spec = speculative.Speculator(target, draft.to(torch.bfloat16), **METHODS["eagle3"])
    taus = []
    for prompt in prompts(10, 512, seed=3, lengths=(3, 40)):
        ids, per_round = speculative.speculative_generate(spec, prompt, 40)
        assert ids == vanilla(target, prompt, 40)
        taus.append(sum(per_round[0]) / len(per_round[0]))
    assert draft.lm_head.weight.dtype == torch.bfloat16 and sum(taus) / len(taus) > 2  # it still drafts well


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_stop_token_inside_an_accepted_run(method):
    target, draft = pair_for(method, seed=3)
    spec = speculative.Speculator(target, draft, **METHODS[method])
    prompt = prompts(1, 512, seed=4)[0]
    full = vanilla(target, prompt, 60)[0]
    cut_inside_a_round = 0
    for stop in dict.fromkeys(full[3:40]):  # each distinct token as the stop token, once
        spec.stop_ids = torch.tensor([stop])
        ids, per_round = speculative.speculative_generate(spec, prompt, 60)
        expected = full[:full.index(stop) + 1]
        assert ids[0] == expected
        cut_inside_a_round += 1 + sum(per_round[0]) > len(expected)  # the round went past the stop
    assert cut_inside_a_round >= 3


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_generation_up_to_the_end_of_the_cache(method):
    target, draft = pair_for(method, block_size=64)
    spec = speculative.Speculator(target, draft, **METHODS[method])
    spec.setup(1, 64 + 2 * (spec.depth + 1))  # exactly what the last round can need
    prompt = prompts(1, 512, seed=5, lengths=(20, 21))[0]
    ids, _ = speculative.speculative_generate(spec, prompt, 44)
    assert spec.capacity == 64 + 2 * (spec.depth + 1) and len(ids[0]) == 44
    assert ids == vanilla(target, prompt, 44)


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
@torch.no_grad()
def test_kv_cache_after_rounds_equals_vanilla_cache(method):
    target, draft = pair_for(method, seed=6)
    fresh = copy.deepcopy(target)
    spec = speculative.Speculator(target, draft)
    prompt = prompts(1, 512, seed=7)[0]
    ids, per_round = speculative.speculative_generate(spec, prompt, 50)
    assert max(per_round[0]) > 3  # several tokens were moved down at once
    n, n_out = int(spec.prefix_len[0]), int(spec.n_out[0])  # the last round may emit past the 50 asked for
    assert n_out >= len(ids[0]) == 50
    tokens = torch.cat([prompt[0], spec.out[0, :n_out].cpu()])  # the last token is the root: not in the cache
    assert n == tokens.numel() - 1
    tokens = tokens[:n]
    fresh.setup_caches(1, n)
    fresh(tokens[None], torch.arange(n))
    for layer, ref in zip(target.layers, fresh.layers):
        torch.testing.assert_close(layer.attention.kv_cache.k_cache[0, :, :n], ref.attention.kv_cache.k_cache[0, :, :n])
        torch.testing.assert_close(layer.attention.kv_cache.v_cache[0, :, :n], ref.attention.kv_cache.v_cache[0, :, :n])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("method", ["eagle", "eagle2", "eagle3"])
@torch.no_grad()
def test_greedy_equals_vanilla_on_cuda(method):
    """Float32 on the GPU, with the attention backend that "auto" picks there (the fused kernel):
    single prompts and a batch whose rows accept different lengths."""
    target, draft = mirrored_pair()
    if method == "eagle3":  # a random EAGLE-3 head (a vocabulary of its own): lossless all the same
        torch.manual_seed(0)
        draft = Eagle3Draft(draft_config_for(target.config), 256, eagle3_layer_ids(1)).eval()
    target, draft = target.cuda(), draft.cuda()
    use_attention(target), use_attention(draft)  # on CUDA the fused tree kernel
    spec = speculative.Speculator(target, draft, **METHODS["eagle" if method == "eagle" else "eagle2"])
    for prompt in prompts(6, 512, seed=1, lengths=(3, 40)):
        ids, _ = speculative.speculative_generate(spec, prompt.cuda(), 40)
        assert ids == vanilla(target, prompt.cuda(), 40)
    batch = torch.cat([p[:, :8] for p in prompts(4, 512, seed=2, lengths=(8, 9))]).cuda()
    ids, _ = speculative.speculative_generate(spec, batch, 40)
    assert ids == [vanilla(target, batch[b:b + 1], 40)[0] for b in range(4)]


# ---------------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------------
# Six varied chat prompts (facts, lists, arithmetic, free text), 24 new tokens each: short answers
# stop at EOS, long ones at the limit. Six keep CI's time in check (18 answers, ~50 s on a 2-core
# Zen 3; eight took 67 s); the compiled-round and benchmark tests decode further prompts.
# four kinds of answer (a fact, verse, arithmetic, an explanation); each prompt costs ~8 s of the
# suite on a 2-core CPU (vanilla and three 60-node methods, eager float32)
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "What is 12 times 7?",
                "Why is the sky blue?"]


@torch.no_grad()
def test_greedy_equals_vanilla_on_smollm2(smollm2_checkpoint):
    from checkpoint import load_draft
    from tokenizer import load_tokenizer

    target = checkpoint.load_model(smollm2_checkpoint / "model.pth", "cpu", torch.float32)
    tokenizer = load_tokenizer(smollm2_checkpoint)
    heads = {"eagle": "SmolLM2-135M-Instruct", "eagle2": "SmolLM2-135M-Instruct", "eagle3": "SmolLM2-135M-Instruct-eagle3"}
    specs = {}
    for method, kw in METHODS.items():
        head = ROOT / "heads" / heads[method]
        draft = load_draft(head, target.config) if (head / "draft.safetensors").is_file() else draft_for(method, target)
        specs[method] = speculative.Speculator(target, draft, stop_ids=tokenizer.stop_ids, **kw)
    for text in CHAT_PROMPTS[:2]:  # two of them: real-model decoding is much of the suite's time
        prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": text}])])
        expected = vanilla(target, prompt, 24, stop_ids=tokenizer.stop_ids)
        for method, spec in specs.items():
            assert speculative.speculative_generate(spec, prompt, 24)[0] == expected, (method, text)


@pytest.mark.all_threads
@torch.no_grad()
def test_greedy_equals_vanilla_in_bf16_with_batch_invariance_on_smollm2(smollm2_checkpoint):
    """bfloat16, where the batched verify and the one-token step round differently: with the
    target in batch-invariant mode (generate.py --batch_invariant) every speculative answer equals
    plain decoding's token for token, EAGLE-2 and EAGLE-3 heads with prompt lookup grafted on.
    Eager, trees as large as this CPU's GEMMs allow (invariant.gemm_invariant_rows: it depends on
    the CPU, and where it is 1 the test skips)."""
    from checkpoint import load_draft
    from tokenizer import load_tokenizer

    target = checkpoint.load_model(smollm2_checkpoint / "model.pth", "cpu", torch.bfloat16)
    invariant.enable(target)
    nodes = min(24, invariant.gemm_invariant_rows(target, most=32))  # 32: as tests/test_model.py asks (cached)
    if nodes < 2:  # generate.py refuses such runs in one line (tests/test_generate.py)
        pytest.skip("this CPU's eager bf16 GEMMs give a one-row call's bits to no call of 2 rows: no tree fits")
    lookup = min(8, nodes // 3)
    tokenizer = load_tokenizer(smollm2_checkpoint)
    specs = {}
    for method, head in (("eagle2", "SmolLM2-135M-Instruct"), ("eagle3", "SmolLM2-135M-Instruct-eagle3")):
        path = ROOT / "heads" / head
        draft = load_draft(path, target.config, dtype=torch.bfloat16) if (path / "draft.safetensors").is_file() \
            else draft_for(method, target).to(torch.bfloat16)
        specs[method] = speculative.Speculator(target, draft, tree_top_k=8, tree_depth=4, tree_tokens=nodes - lookup,
                                               lookup=lookup, stop_ids=tokenizer.stop_ids)
    for text in CHAT_PROMPTS[:1]:  # eager bf16 is slow where the CPU lacks bf16 dot products: one prompt
        prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": text}])])
        expected = vanilla(target, prompt, 32, stop_ids=tokenizer.stop_ids)
        for method, spec in specs.items():
            assert speculative.speculative_generate(spec, prompt, 32)[0] == expected, (method, text)


@pytest.mark.all_threads
@torch.no_grad()
def test_greedy_equals_vanilla_in_int8_with_batch_invariance_on_smollm2(smollm2_checkpoint):
    """The same for SmolLM2 quantized to int8 (bf16 activations) and the EAGLE-2 head, trees of
    24 nodes: more rows than an int8 layer gives torch's int8 kernel outside the mode."""
    import quantize
    from checkpoint import load_draft
    from tokenizer import load_tokenizer

    target = checkpoint.load_model(smollm2_checkpoint / "model.pth", "cpu", torch.bfloat16)
    quantize.quantize_model(target, "int8")
    invariant.enable(target)
    tokenizer = load_tokenizer(smollm2_checkpoint)
    path = ROOT / "heads" / "SmolLM2-135M-Instruct"
    draft = load_draft(path, target.config, dtype=torch.bfloat16) if (path / "draft.safetensors").is_file() \
        else draft_for("eagle2", target).to(torch.bfloat16)
    spec = speculative.Speculator(target, draft, tree_top_k=8, tree_depth=4, tree_tokens=16, lookup=8,
                                  stop_ids=tokenizer.stop_ids)
    prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}])])
    assert speculative.speculative_generate(spec, prompt, 32)[0] == vanilla(target, prompt, 32, stop_ids=tokenizer.stop_ids)


@pytest.mark.all_threads
@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
@torch.no_grad()
def test_greedy_equals_vanilla_in_bf16_with_batch_invariance(method):
    """The same on a tiny bf16 target with random drafts, over many prompts and trees of 40 nodes."""
    target = tiny_target("tiny-llama").to(torch.bfloat16)
    invariant.enable(target)
    spec = speculative.Speculator(target, draft_for(method, target).to(torch.bfloat16), tree_top_k=6, tree_depth=5,
                                  tree_tokens=40, lookup=4)
    for prompt in prompts(6, 512):
        ids, _ = speculative.speculative_generate(spec, prompt, 40)
        assert ids == vanilla(target, prompt, 40), prompt


def test_a_tree_deeper_than_the_invariant_window_is_an_error():
    target = tiny_target("tiny-llama")
    invariant.enable(target, window=6)
    with pytest.raises(ValueError, match="too deep"):
        speculative.Speculator(target, random_draft(target), tree_top_k=4, tree_depth=4, tree_tokens=10, lookup=3)


@torch.no_grad()
def test_the_draft_grows_no_deeper_than_a_tree_of_its_tokens_can_reach():
    """A dynamic tree of n tokens keeps the n - 1 best-scored candidates, and a candidate scores at
    most its parent: a Speculator asked for depth 8 and 5 tokens grows 4 levels, and the tree of
    those 4 is the tree the 8 would give (tokens, parents, depths)."""
    from draft import grow_dynamic_tree
    target = tiny_target("tiny-llama")
    draft = random_eagle3_draft(target, std=0.5)
    assert speculative.Speculator(target, draft, tree_top_k=4, tree_depth=8, tree_tokens=5).tree_depth == 4
    assert speculative.Speculator(target, draft, tree_top_k=4, tree_depth=3, tree_tokens=5).tree_depth == 3
    draft.setup_caches(2, 256)
    root = torch.tensor([5, 9])
    root_hidden = torch.randn(2, target.config.dim, generator=torch.Generator().manual_seed(0))
    trees = [grow_dynamic_tree(draft, target.tok_embeddings, target.output, root, root_hidden,
                               torch.zeros(2, dtype=torch.long), 4, depth, 5) for depth in (8, 4)]
    for name in ("tokens", "parents", "depth"):
        assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), name


# ---------------------------------------------------------------------------------------------
# Prompt lookup, hybrid trees, and adaptive decoding (rounds and plain steps mixed)
# ---------------------------------------------------------------------------------------------
def repetitive_prompts(count, vocab, seed=0):
    """Prompts that repeat themselves, so that prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        base = torch.randint(0, vocab, (1, int(torch.randint(3, 8, (1,), generator=g))), generator=g)
        out.append(torch.cat([base, base, base[:, :2]], 1))
    return out


HYBRIDS = {
    "lookup": lambda t, d: speculative.Speculator(t, None, lookup=6),
    "eagle+lookup": lambda t, d: speculative.Speculator(t, d, static=static_tree(mc_sim_7b_63), lookup=4),
    "eagle2+lookup": lambda t, d: speculative.Speculator(t, d, tree_top_k=4, tree_depth=3, tree_tokens=10, lookup=5),
    "eagle3+lookup": lambda t, d: speculative.Speculator(t, d, tree_top_k=4, tree_depth=3, tree_tokens=10, lookup=5),
}


@pytest.mark.parametrize("method", HYBRIDS)
@pytest.mark.parametrize("modes", ["rounds", "switching", "adaptive"])
@torch.no_grad()
def test_greedy_equals_vanilla_with_lookup_and_switching(method, modes):
    """Lookup chains in the tree, rounds and plain steps mixed mid-answer (forced: round, plain
    burst, plain burst, round, ...; or chosen by the adaptive driver): vanilla's tokens."""
    target, draft = eagle3_pair() if method.startswith("eagle3") else mirrored_pair()
    spec = HYBRIDS[method](target, draft)
    lookups = 0
    for prompt in repetitive_prompts(6, 512):
        drawn = []  # the forced modes, as the driver draws them
        forced = (drawn.append(m) or m for m in itertools.cycle(["round", "plain", "plain", "round"]))
        ids, emitted = speculative.speculative_generate(spec, prompt, 40,
                                                        force_modes=forced if modes == "switching" else None,
                                                        adaptive=modes == "adaptive")
        assert ids == vanilla(target, prompt, 40)
        assert sum(emitted[0]) + 1 >= len(ids[0])  # + the first token (prefill); a round may overshoot
        if modes == "switching":  # the plain steps are told apart from rounds that accepted nothing
            assert len(emitted[0]) - spec.plain_steps[0] == drawn.count("round")
            assert drawn.count("plain") <= spec.plain_steps[0] <= speculative.PLAIN_BURST * drawn.count("plain")
        elif modes == "rounds":
            assert spec.plain_steps == [0]
        lookups += max(emitted[0]) > 1
    assert lookups >= 3  # rounds accepted guesses


@torch.no_grad()
def test_compiled_decoding_follows_every_call_and_accepts_what_eager_accepts():
    """Compiled as generate.py compiles on a CPU (frozen graphs) and called as a program calls it:
    a short warm-up compiles the round, the plain step and the flush, then other prompts ask for
    more tokens, rounds and plain steps forced in turn. Inductor's freezing makes a constant of
    every buffer a graph reads and never writes: a token limit frozen at the warm-up's value would
    cut every later answer short, a position frozen in the flush would feed the draft stale
    positions. Tokens equal vanilla's, and each call accepts what the eager engine accepts."""
    target, draft = mirrored_pair()
    eager, compiled = (speculative.Speculator(target, draft, tree_top_k=4, tree_depth=3, tree_tokens=10, lookup=5)
                       for _ in range(2))
    for spec in (eager, compiled):
        spec.setup(1, 128)
    torch._dynamo.reset()
    compile_round(compiled, compile_prefill=False)

    def modes():
        return itertools.cycle(["round", "plain", "plain", "round"])

    speculative.speculative_generate(compiled, prompts(1, 512, seed=4)[0], 8, force_modes=modes())  # warm-up
    for prompt in repetitive_prompts(3, 512, seed=1):
        ids, emitted = speculative.speculative_generate(compiled, prompt, 40, force_modes=modes())
        want, want_emitted = speculative.speculative_generate(eager, prompt, 40, force_modes=modes())
        assert ids == want == vanilla(target, prompt, 40)
        assert emitted == want_emitted
    torch._dynamo.reset()


@torch.no_grad()
def test_a_compiled_flush_writes_the_draft_cache_where_the_text_is_now():
    """The flush (the draft catching up after plain steps) reads prefix_len and writes nothing
    else that would keep it an input: frozen, it wrote the second answer's catch-up at the first
    answer's positions (the draft's guesses then suffer, the output does not, so the test above
    cannot see it)."""
    target, draft = mirrored_pair()
    spec = speculative.Speculator(target, draft, tree_top_k=4, tree_depth=3, tree_tokens=10)
    spec.setup(1, 128)
    torch._dynamo.reset()
    compile_round(spec, compile_prefill=False)
    cache = draft.layer.attention.kv_cache.k_cache
    for length in (10, 30):  # the first flush compiles the graph
        spec.prefill(torch.randint(0, 512, (1, length), generator=torch.Generator().manual_seed(length)), 40)
        spec.plain_step()
        spec.plain_step()
        before = cache.clone()
        spec.flush()
        written = (cache != before).any(-1).any(1)[0].nonzero().flatten().tolist()
        # the catch-up input: the pair at the root's position (L - 1) and the two plain steps'
        assert written[:3] == [length - 1, length, length + 1]
    torch._dynamo.reset()


@torch.no_grad()
def test_compiled_prefill_takes_any_prompt_length_and_grows_the_buffers_before_its_graph():
    """--compile_prefill compiles the prompt's forward with dynamic shapes. A prompt that needs more
    room than the buffers have makes prefill grow them (setup) eagerly before the graph runs:
    traced, setup_caches' check that the target's caches are still views of one storage stopped
    dynamo ("Data pointer comparison"). Prompts of three lengths, the last one beyond the draft's
    cache: the state a round starts from is the eager prefill's, and decoding from it gives
    vanilla's tokens."""
    (target, draft), (eager_target, eager_draft) = eagle3_pair(), eagle3_pair()
    spec = speculative.Speculator(target, draft, **METHODS["eagle3"])
    eager = speculative.Speculator(eager_target, eager_draft, **METHODS["eagle3"])
    for s in (spec, eager):  # the targets' caches already hold 256 slots (as in batch-invariant mode on a
        s.target.setup_caches(1, 256)  # CPU, or after a long plain decoding): the draft's are what grow
        s.setup(1, 48)
    torch._dynamo.reset()
    eager_round = spec.round
    compile_round(spec, compile_prefill=True)
    for length, n in ((9, 8), (20, 8), (60, 40)):
        prompt = prompts(1, 512, seed=length, lengths=(length, length + 1))[0]
        grows = length + n + 2 * (spec.depth + 1) > spec.capacity
        spec.prefill(prompt, n)
        eager.prefill(prompt, n)
        assert spec.capacity >= length + n and grows == (length == 60)
        for name in ("out", "n_out", "root", "prefix_len", "cu_tokens", "cu_count", "left", "done"):
            assert torch.equal(getattr(spec, name), getattr(eager, name)), name
        torch.testing.assert_close(spec.cu_features, eager.cu_features)
        caches = [(layer.attention.kv_cache, 0) for layer in target.layers] + [(draft.layer.attention.kv_cache, 1)]
        references = [layer.attention.kv_cache for layer in eager_target.layers] + [eager_draft.layer.attention.kv_cache]
        for (cache, fewer), reference in zip(caches, references):  # the draft reads pairs: one fewer than the prompt
            for name in ("k_cache", "v_cache"):
                torch.testing.assert_close(getattr(cache, name)[:, :, :length - fewer],
                                           getattr(reference, name)[:, :, :length - fewer])
    ids, _ = speculative.speculative_generate(spec, prompt, 40, round_fn=eager_round)
    assert ids == vanilla(eager_target, prompt, 40)
    torch._dynamo.reset()


@pytest.mark.parametrize("with_draft", [False, True], ids=["lookup", "eagle2+lookup"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (1.0, None, 0.8)])
@torch.no_grad()
def test_sampling_with_lookup_branches_matches_vanilla_distribution(temperature, top_k, top_p, with_draft):
    """Lookup's chain is one more point-mass proposal per node in rank order: the joint law of the
    first three tokens is vanilla's (chi-square), and not a slightly hotter one's. The prompt
    repeats itself, so the chain is real; without a draft every accepted guess is lookup's."""
    V, N = 8, 20_000
    target, draft = mirrored_pair(seed=11, vocab_size=V)
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    exact = exact_first_three(target, prompt, temperature, top_k, top_p)
    hotter = exact_first_three(target, prompt, temperature * 1.15, top_k, top_p)
    shape = dict(tree_top_k=2, tree_depth=2, tree_tokens=4) if with_draft else {}
    spec = speculative.Speculator(target, draft if with_draft else None, lookup=3, temperature=temperature,
                                  top_k=top_k, top_p=top_p, **shape)
    torch.manual_seed(5)
    ids, per_round = speculative.speculative_generate(spec, prompt.expand(N, -1), 3)
    first3 = torch.tensor([row[:3] for row in ids])
    counts = torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3)
    assert chi_square_p_value(counts, N * exact) > 1e-3
    assert chi_square_p_value(counts, N * hotter) < 1e-3
    assert (torch.tensor([r[0] for r in per_round]) > 1).float().mean() > 0.05  # guesses were accepted


def test_the_adaptive_choice_on_synthetic_estimates():
    """Rounds while they emit tokens faster than plain steps, plain steps otherwise; unmeasured
    costs are measured first (rounds, then a plain burst); a plain stretch probes with a round
    every PROBE_EVERY steps; the first observation of each kind (compilation) is not counted."""
    Pace, choose = speculative.Pace, speculative.next_mode
    assert choose(Pace(), 0) == "round"
    assert choose(Pace(round_s=0.03, tokens=2.0), 0) == "plain"  # the step's cost is unknown
    fast = Pace(round_s=0.03, step_s=0.02, tokens=2.0)  # 67 tok/s against 50
    slow = Pace(round_s=0.03, step_s=0.02, tokens=1.3)  # 43 tok/s against 50
    assert choose(fast, 0) == "round" and choose(slow, 0) == "plain"
    assert choose(slow, speculative.PROBE_EVERY - 1) == "plain" and choose(slow, speculative.PROBE_EVERY) == "round"
    # a history: compile-time first observations ignored, then the estimates decay toward the news
    pace = speculative.observe(Pace(), "round", 60.0, 3.0)  # compiling: not counted as a cost
    assert pace.round_s is None and pace.tokens == 3.0
    pace = speculative.observe(pace, "plain", 40.0)
    pace = speculative.observe(pace, "plain", 0.02)
    for _ in range(3):
        pace = speculative.observe(pace, "round", 0.03, 3.0)
    assert choose(pace, 0) == "round"  # 100 tok/s against 50
    for _ in range(30):  # the text turns unpredictable: one token a round
        pace = speculative.observe(pace, "round", 0.03, 1.0)
    assert pace.tokens < 1.1 and choose(pace, 0) == "plain"


@torch.no_grad()
def test_an_answer_starts_from_the_estimates_the_last_one_left():
    """Tokens per round carry over from one answer to the next, as the costs do: a Speculator whose
    estimates say plain steps are faster answers with plain steps from the first token on (a reset
    estimate would spend a round first, and a poor first round would condemn the whole answer); and
    the count of plain steps until a probe round carries over too."""
    target, draft = mirrored_pair()
    spec = speculative.Speculator(target, draft, tree_top_k=4, tree_depth=3, tree_tokens=10)
    spec.pace = speculative.Pace(round_s=1.0, step_s=0.001, tokens=1.0, seen=frozenset({"round", "plain"}))
    prompt = repetitive_prompts(1, 512)[0]
    ids, emitted = speculative.speculative_generate(spec, prompt, 12, adaptive=True)
    assert ids == vanilla(target, prompt, 12)
    assert emitted[0] == [1] * 11 and spec.plain_steps == [11]  # no round: the estimate was not reset
    # the plain steps before a probe round count over answers too: plain ones never stay plain for good
    rounds = 0
    for _ in range(speculative.PROBE_EVERY // 11 + 1):
        ids, emitted = speculative.speculative_generate(spec, prompt, 12, adaptive=True)
        assert ids == vanilla(target, prompt, 12)
        rounds += len(emitted[0]) - spec.plain_steps[0]
    assert rounds >= 1


# ---------------------------------------------------------------------------------------------
# Sampling: the acceptance rule on hand-built trees, then the whole pipeline's distribution
# ---------------------------------------------------------------------------------------------
def hand_built_tree(B):
    #        root (token 0)
    #        /          \
    #   node 1 (tok 1)  node 2 (tok 2)
    #       |
    #   node 3 (tok 3)
    parents = torch.tensor([[-1, 0, 0, 1]]).expand(B, 4)
    depth, ancestors, paths = tree_structure(parents, 2)
    return Tree(torch.tensor([[0, 1, 2, 3]]).expand(B, 4), parents, depth, ancestors, paths)


def emitted(tree, node, n_accepted, bonus):
    """The tokens a row emits: the accepted path's tokens, then the bonus."""
    rows = torch.arange(node.numel())
    path_tokens = tree.tokens.gather(1, tree.paths[rows, node].clamp(min=0))[:, 1:]
    return [path_tokens[b, :n_accepted[b]].tolist() + [int(bonus[b])] for b in rows]


def assert_frequencies(samples, probs, what):
    """Empirical frequencies within 5 standard errors of probs."""
    n = len(samples)
    assert n > 1000, what
    freq = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double() / n
    tol = 5 * (probs.double() * (1 - probs.double()) / n).sqrt() + 1e-9
    assert ((freq - probs.double()).abs() <= tol).all(), (what, freq, probs)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 3, None), (1.3, None, 0.8)])
@torch.no_grad()
def test_accept_samples_each_step_from_the_target(temperature, top_k, top_p):
    torch.manual_seed(0)
    B, V = 200_000, 6
    tree = hand_built_tree(B)
    logits = torch.tensor([[1.0, 1.2, 1.5, -0.5, 0.0, 0.8],    # at the root: children 1 and 2 likely
                           [0.0, 0.2, -1.0, 2.0, 0.4, 0.1],    # at node 1: its child (3) likely
                           [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],     # at node 2 (a leaf)
                           [2.0, -2.0, 0.0, 0.0, 1.0, -1.0]])  # at node 3 (a leaf)
    node, n_acc, bonus = speculative.accept(tree, logits.expand(B, 4, V), temperature, top_k, top_p)
    out = emitted(tree, node, n_acc, bonus)
    p = sampling.logits_to_probs(logits, temperature, top_k, top_p)
    assert_frequencies([o[0] for o in out], p[0], "first token ~ p(root)")
    assert_frequencies([o[1] for o in out if o[0] == 1], p[1], "after token 1 ~ p(node 1)")
    assert_frequencies([o[1] for o in out if o[0] == 2], p[2], "after token 2 ~ p(node 2)")
    assert_frequencies([o[2] for o in out if o[:2] == [1, 3]], p[3], "after 1, 3 ~ p(node 3)")
    assert all(len(o) == 1 for o in out if o[0] not in (1, 2))  # no child accepted: the bonus only


def test_accept_greedy():
    tree = hand_built_tree(3)
    logits = torch.full((3, 4, 5), -5.0)
    logits[0, 0, 1], logits[0, 1, 3], logits[0, 3, 4] = 1, 1, 1  # 1, 3 accepted, then bonus 4
    logits[1, 0, 2], logits[1, 2, 0] = 1, 1                      # 2 accepted (a leaf), bonus 0
    logits[2, 0, 4] = 1                                          # nothing accepted, bonus 4
    node, n_acc, bonus = speculative.accept(tree, logits, 0.0)
    assert emitted(tree, node, n_acc, bonus) == [[1, 3, 4], [2, 0], [4]]


def test_accept_when_the_children_hold_all_the_mass():
    B = 50_000
    tree = hand_built_tree(B)
    logits = torch.full((4, 6), -float("inf"))
    logits[:, 1], logits[:, 2] = 0.0, 1.0  # the root's children 1 and 2 hold all of p
    torch.manual_seed(1)
    node, n_acc, bonus = speculative.accept(tree, logits.expand(B, 4, 6), 1.0)
    first = [o[0] for o in emitted(tree, node, n_acc, bonus)]
    assert set(first) <= {1, 2} and (n_acc >= 1).all()
    assert_frequencies(first, torch.softmax(logits[0], -1), "children only")


def exact_first_three(target, prompt, temperature, top_k, top_p):
    """P(t1, t2, t3) of vanilla sampling, computed exactly by running every continuation."""
    V, L = target.config.vocab_size, prompt.size(1)
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]
    seqs = torch.cat([prompt.expand(V * V, L), pairs], 1)
    target.setup_caches(V * V, L + 2)
    logits = target(seqs, torch.arange(L + 2))
    p1 = sampling.logits_to_probs(logits[0, L - 1], temperature, top_k, top_p)
    p2 = sampling.logits_to_probs(logits[::V, L], temperature, top_k, top_p)  # [V(t1), V]
    p3 = sampling.logits_to_probs(logits[:, L + 1], temperature, top_k, top_p).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p_value(counts, expected):
    """Pearson's test; cells expected fewer than 5 times are pooled into one."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = keep.sum() - 1
    return float(torch.special.gammaincc(df / 2, chi2 / 2))


@pytest.mark.parametrize("method, compiled, temperature, top_k, top_p", [
    *[(method, False, *sampling) for method in ("eagle2", "eagle3")
      for sampling in ((1.0, None, None), (0.8, 4, None), (1.0, None, 0.8))],
    ("eagle3", True, 1.0, None, 0.8)])
@torch.no_grad()
def test_sampling_matches_vanilla_distribution(temperature, top_k, top_p, method, compiled):
    """20,000 rows sampled in one batch: the joint law of the first three tokens passes a
    chi-square test against vanilla's exact law, and fails one against a slightly hotter law.
    eagle3: the draft's vocabulary lacks some of the eight tokens, which it can never propose:
    they must still come out with exactly their probability (through the residual draws).
    compiled: the round as one frozen graph, as generate.py --compile runs it on a CPU."""
    V, N = 8, 20_000
    if method == "eagle3":  # sharpness 0.03: the target's next token is token + 1 about half the time
        target, draft = eagle3_pair(seed=11, vocab_size=V, sharpness=0.03, missing=0.3)
        outside_vocab = torch.tensor(sorted(set(range(V)) - set(draft.vocab.tolist())))
        assert 1 <= len(outside_vocab) <= 4
    else:
        target, draft = mirrored_pair(seed=11, vocab_size=V)  # a draft good enough to be accepted often
    prompt = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(0))
    exact = exact_first_three(target, prompt, temperature, top_k, top_p)
    hotter = exact_first_three(target, prompt, temperature * 1.15, top_k, top_p)

    spec = speculative.Speculator(target, draft, tree_top_k=3, tree_depth=3, tree_tokens=10,
                                  temperature=temperature, top_k=top_k, top_p=top_p)
    round_fn = None
    if compiled:
        spec.setup(N, 5 + 3 + 2 * (spec.depth + 1))  # the shapes the graph is compiled for
        torch._dynamo.reset()  # every Speculator compiles the same code object: clear of the recompile limit
        round_fn = compile_round(spec, compile_prefill=False).round
    torch.manual_seed(123)
    ids, per_round = speculative.speculative_generate(spec, prompt.expand(N, -1), 3, round_fn=round_fn)
    first3 = torch.tensor([row[:3] for row in ids])
    counts = torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3)
    first_round = torch.tensor([r[0] for r in per_round])
    assert (first_round > 1).float().mean() > 0.3 and (first_round == 1).float().mean() > 0.05  # both paths
    assert chi_square_p_value(counts, N * exact) > 1e-3
    assert chi_square_p_value(counts, N * hotter) < 1e-3  # the test can tell a wrong law
    if method == "eagle3":  # tokens the draft cannot say were emitted, as often as vanilla emits them
        outside = torch.isin(first3, outside_vocab)
        assert outside.any(dim=1).float().mean() > 0.1
