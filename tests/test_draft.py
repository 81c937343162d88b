"""draft.py: the EAGLE draft layer, the trees it grows (checked against a brute-force search that
runs the draft one token at a time), and loading/saving."""
import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import random_draft, random_eagle3_draft, tiny_target
from checkpoint import DRAFT_CONFIG, load_draft, save_draft
from draft import EagleDraft, draft_config_for, grow_dynamic_tree, grow_static_tree, lookup_continuation
from trees import MIN_STEP, mc_sim_7b_63, static_tree


def test_draft_layer_has_no_input_norm_and_fuses_embedding_then_feature():
    target = tiny_target()
    draft = random_draft(target)
    assert isinstance(draft.layer.attention_norm, torch.nn.Identity)
    assert draft.fc.weight.shape == (64, 128) and draft.fc.bias is not None
    assert random_draft(target, fc_bias=False).fc.bias is None
    with pytest.raises(ValueError, match="one decoder layer"):
        EagleDraft(target.config)  # two layers
    # The fc input is [embedding; feature]: zeroing the feature half of fc leaves the output
    # independent of the features.
    draft.setup_caches(1, 16)
    with torch.no_grad():
        draft.fc.weight[:, 64:] = 0
        emb = torch.randn(1, 3, 64)
        a = draft(emb, torch.randn(1, 3, 64), torch.arange(3))
        b = draft(emb, torch.randn(1, 3, 64), torch.arange(3))
    torch.testing.assert_close(a, b)


class DraftSetup:
    """A target (for its embedding and head), a random draft holding a prefix of L entries, and
    brute-force helpers that run the draft one token at a time from a copy of that state."""

    def __init__(self, L=9, region=64, seed=0):
        torch.manual_seed(seed)
        self.target = tiny_target("tiny-llama", seed)
        self.draft = random_draft(self.target, std=0.25)
        self.L = L
        self.draft.setup_caches(1, L + 8 + region)
        with torch.no_grad():
            tokens = torch.randint(0, 512, (1, L))
            features = torch.randn(1, L, 64)
            hidden = self.draft(self.target.tok_embeddings(tokens), features, torch.arange(L))
            # Draft logits with a spread of about 3: neither near-ties (flat) nor one token that
            # no change in attention could dislodge (peaked).
            self.target.output.weight.mul_(3 / self.target.output(hidden).std())
        self.root_hidden = hidden[:, -1]
        self.prefilled = copy.deepcopy(self.draft)

    def hidden_after(self, path):
        """The draft's output after the tree node reached by `path` (tokens below the root)."""
        draft = copy.deepcopy(self.prefilled)
        h = self.root_hidden[:, None]
        for d, token in enumerate(path):
            h = draft(self.target.tok_embeddings(torch.tensor([[token]])), h, torch.tensor([self.L + d]))
        return h[:, -1]

    def logp_after(self, path):
        return F.log_softmax(self.target.output(self.hidden_after(path)).float(), -1)[0]


def tree_paths(tree):
    """{node: tuple of tokens below the root} for batch row 0."""
    out = {}
    for i, path in enumerate(tree.paths[0].tolist()):
        out[i] = tuple(int(tree.tokens[0, n]) for n in path[1:] if n >= 0)
    return out


@pytest.mark.parametrize("k, depth, n_nodes", [(2, 3, 6), (3, 3, 10), (4, 2, 12), (3, 4, 14)])
@torch.no_grad()
def test_dynamic_tree_equals_brute_force_eagle2(k, depth, n_nodes):
    s = DraftSetup(region=k * (depth - 1))
    calls = []  # every draft forward of the growth: (embeds, features, output)
    hook = s.draft.register_forward_hook(lambda module, args, out: calls.append((args[0][0], args[1][0], out[0])))
    tree = grow_dynamic_tree(s.draft, s.target.tok_embeddings, s.target.output, torch.tensor([7]),
                             s.root_hidden, torch.tensor([s.L]), k, depth, n_nodes)
    hook.remove()

    # Each frontier entry's output equals the draft run one token at a time along its path: this
    # checks positions, slots and the tree mask of every level.
    assert len(calls) == depth - 1
    known = [(s.root_hidden[0], ())]  # (draft output, path) of nodes expanded so far
    emb = s.target.tok_embeddings.weight
    for embeds, features, out in calls:
        level = []
        for j in range(embeds.size(0)):
            token = int((embeds[j] == emb).all(-1).nonzero())
            parent_path = next(p for h, p in known if torch.equal(h, features[j]))
            path = parent_path + (token,)
            torch.testing.assert_close(out[j], s.hidden_after(path)[0], atol=1e-3, rtol=1e-3)
            level.append((out[j], path))
        known = level

    # Brute force: every candidate's score is the sum of its path's draft log-probs, each draft
    # distribution computed by running the draft along the path one token at a time.
    logp = s.logp_after(())
    values, tokens = logp.topk(k)
    level = [((int(t),), float(v.clamp(max=-MIN_STEP))) for v, t in zip(values, tokens)]
    pool = list(level)
    for _ in range(1, depth):
        frontier = sorted(level, key=lambda c: -c[1])[:k]
        level = []
        for path, score in frontier:
            values, tokens = s.logp_after(path).topk(k)
            level += [(path + (int(t),), score + float(v.clamp(max=-MIN_STEP))) for v, t in zip(values, tokens)]
        pool += level
    expected = {path for path, _ in sorted(pool, key=lambda c: -c[1])[:n_nodes - 1]}

    paths = tree_paths(tree)
    assert tree.tokens.shape == (1, n_nodes) and tree.tokens[0, 0] == 7
    assert set(paths.values()) - {()} == expected
    assert len(set(paths.values())) == n_nodes  # no duplicates
    # parents before children, siblings in draft rank order, depths and positions consistent
    for i in range(1, n_nodes):
        parent = int(tree.parents[0, i])
        assert parent < i and paths[parent] == paths[i][:-1] and tree.depth[0, i] == len(paths[i])
    for i in range(n_nodes):
        siblings = [j for j in range(n_nodes) if tree.parents[0, j] == i]
        ranked = s.logp_after(paths[i])[tree.tokens[0, siblings]]
        assert ranked.tolist() == sorted(ranked.tolist(), reverse=True)


@torch.no_grad()
def test_static_tree_takes_the_ranked_children():
    st = static_tree(mc_sim_7b_63)
    s = DraftSetup(region=st.parents.numel() - 1)
    outputs = []
    hook = s.draft.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    tree = grow_static_tree(s.draft, s.target.tok_embeddings, s.target.output, st, torch.tensor([7]),
                            s.root_hidden, torch.tensor([s.L]))
    hook.remove()
    paths = tree_paths(tree)
    # one draft forward per level but the deepest, its rows the nodes of that level in order
    assert len(outputs) == st.max_depth - 1
    for d, out in enumerate(outputs, start=1):
        for j, node in enumerate(st.levels[d]):
            torch.testing.assert_close(out[j], s.hidden_after(paths[node])[0], atol=1e-3, rtol=1e-3)
    assert tree.tokens[0, 0] == 7 and torch.equal(tree.parents[0], st.parents)
    for i in range(1, st.parents.numel()):
        parent = int(st.parents[i])
        ranked = s.logp_after(paths[parent]).topk(int(st.ranks.max()) + 1).indices
        assert tree.tokens[0, i] == ranked[st.ranks[i]]


def test_save_and_load_round_trip(tmp_path):
    target = tiny_target()
    draft = random_draft(target)
    save_draft(draft, tmp_path / "eagle")
    loaded = load_draft(tmp_path / "eagle", target.config)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.fc_bias and loaded.config == draft.config
    # the file path works as well as the folder
    assert load_draft(tmp_path / "eagle" / "draft.safetensors", target.config).config == draft.config


def test_load_errors(tmp_path):
    target = tiny_target()
    with pytest.raises(FileNotFoundError, match="no EAGLE draft"):
        load_draft(tmp_path / "missing", target.config)
    wide = tiny_target(dim=128, n_head=4)
    save_draft(random_draft(wide), tmp_path / "wide")
    with pytest.raises(ValueError, match="hidden size 128, the target has 64"):
        load_draft(tmp_path / "wide", target.config)
    other_vocab = tiny_target(vocab_size=1000)
    save_draft(random_draft(other_vocab), tmp_path / "vocab")
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        load_draft(tmp_path / "vocab", target.config)
    # weights that do not match the config
    save_draft(random_draft(target), tmp_path / "bad")
    cfg = draft_config_for(target.config, intermediate_size=96)
    (tmp_path / "bad" / DRAFT_CONFIG).write_text(
        (tmp_path / "bad" / DRAFT_CONFIG).read_text().replace('"intermediate_size": 128', '"intermediate_size": 96'))
    assert cfg.intermediate_size == 96
    with pytest.raises(ValueError, match="does not match"):
        load_draft(tmp_path / "bad", target.config)
    # a head of the other kind than the method runs (generate.py --speculate, benchmark.py's heads)
    save_draft(random_eagle3_draft(target), tmp_path / "eagle3")
    assert isinstance(load_draft(tmp_path / "vocab", other_vocab.config, arch="eagle"), EagleDraft)
    with pytest.raises(ValueError, match=r"holds an EAGLE-1/2 head: use --speculate eagle2 \(or eagle\)"):
        load_draft(tmp_path / "vocab", other_vocab.config, arch="eagle3")
    with pytest.raises(ValueError, match="holds an EAGLE-3 head: use --speculate eagle3"):
        load_draft(tmp_path / "eagle3", target.config, arch="eagle")
    config = tmp_path / "eagle3" / DRAFT_CONFIG  # an arch of neither kind is that, whatever the caller runs
    config.write_text(config.read_text().replace('"arch": "eagle3"', '"arch": "medusa"'))
    with pytest.raises(ValueError, match="unknown draft arch 'medusa'"):
        load_draft(tmp_path / "eagle3", target.config, arch="eagle")


# ---------------------------------------------------------------------------------------------
# Prompt lookup
# ---------------------------------------------------------------------------------------------
def lookup(seq, k=4, size=16, max_ngram=4):
    """draft.lookup_continuation on one hand-made sequence in a history of `size` slots."""
    history = torch.zeros(1, size, dtype=torch.long)
    history[0, :len(seq)] = torch.tensor(seq)
    tokens, n_valid, ngram = lookup_continuation(history, torch.tensor([len(seq)]), k, max_ngram)
    return tokens[0].tolist()[:int(n_valid[0])], int(ngram[0])


def test_lookup_finds_no_match_in_text_that_never_repeats():
    assert lookup([1, 2, 3, 4, 5]) == ([], 0)


def test_lookup_prefers_the_longest_ngram_then_the_most_recent():
    # ends with "3 9": "9" alone occurs at 1 and 5 (recent), but "3 9" only at 0..1: the bigram wins
    assert lookup([3, 9, 4, 1, 7, 9, 2, 3, 9]) == ([4, 1, 7, 9], 2)
    # ends with "4": two earlier 4s, no longer match: the most recent one's continuation
    assert lookup([4, 1, 4, 2, 4]) == ([2, 4], 1)
    # capped at max_ngram: a 6-token repeat counts as 3 with max_ngram 3, still the right place
    assert lookup([5, 6, 7, 8, 9, 1, 5, 6, 7, 8, 9], max_ngram=3) == ([1, 5, 6, 7], 3)


def test_lookup_match_at_the_very_end_has_a_short_continuation():
    # "7 7 7 7": the match ending at position 2 overlaps the text's end; only one token follows it
    assert lookup([7, 7, 7, 7]) == ([7], 3)
    assert lookup([1, 2, 1, 2, 1]) == ([2, 1], 3)  # "1 2 1" at 0..2 repeats at 2..4: "2 1" follows


def test_lookup_reads_each_row_up_to_its_own_length():
    history = torch.tensor([[1, 2, 3, 1, 2, 9, 9, 9], [5, 5, 6, 5, 0, 0, 0, 0]])
    tokens, n_valid, ngram = lookup_continuation(history, torch.tensor([5, 4]), 3)
    assert tokens[0].tolist() == [3, 1, 2] and ngram[0] == 2 and n_valid[0] == 3  # "1 2" at 0..1
    assert tokens[1, :1].tolist() == [6] and ngram[1] == 1 and n_valid[1] == 2  # "5" at 1: then 6, 5
