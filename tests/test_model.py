"""model.py on its own: the KV cache, and the masked multi-token forward that tree verification needs."""
import pytest
import torch

from attention import use_attention
from model import ModelArgs, Transformer, copy_slots, transformer_configs

TINY = ["tiny-llama", "tiny-llama-3.1", "tiny-qwen2"]


def make_model(name, max_batch_size=1, max_seq_length=64, seed=0):
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.from_name(name)).eval()
    # Random biases: the default init leaves them at zero, which would hide a bias bug.
    for layer in model.layers:
        if layer.attention.wqkv.bias is not None:
            torch.nn.init.normal_(layer.attention.wqkv.bias, std=0.5)
    model.setup_caches(max_batch_size, max_seq_length)
    use_attention(model)
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
