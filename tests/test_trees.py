"""trees.py: static trees from choice lists, tree structure from parent links, EAGLE-2 reranking,
and the attention mask of the tree region (model.TreeMask)."""
import random

import pytest
import torch

from model import TreeMask
from trees import MIN_STEP, Tree, expand, mc_sim_7b_63, rerank, static_tree, tree_structure


def brute_force_structure(parents):
    """depth, ancestor sets and root-to-node paths by walking parent links one node at a time."""
    T = len(parents)
    depth, ancestors, paths = [], torch.zeros(T, T, dtype=torch.bool), []
    for i in range(T):
        path, node = [], i
        while node >= 0:
            path.insert(0, node)
            ancestors[i, node] = True
            node = parents[node]
        depth.append(len(path) - 1)
        paths.append(path)
    return depth, ancestors, paths


def random_parents(T, rng):
    """Random tree with parents before children."""
    return [-1] + [rng.randrange(i) for i in range(1, T)]


def check_structure(parents, depth, ancestors, paths):
    exp_depth, exp_anc, exp_paths = brute_force_structure(parents)
    assert depth.tolist() == exp_depth
    assert torch.equal(ancestors, exp_anc)
    for i, p in enumerate(exp_paths):
        assert paths[i].tolist() == p + [-1] * (paths.size(-1) - len(p))


def test_mc_sim_7b_63():
    tree = static_tree(mc_sim_7b_63)
    assert tree.parents.numel() == 26 and tree.max_depth == 5
    assert [len(level) for level in tree.levels] == [1, 4, 8, 8, 3, 2]
    check_structure(tree.parents.tolist(), tree.depth, tree.ancestors, tree.paths)
    # every node is its parent's ranks[i]-th child, as the choice list says
    node_of = {(): 0}
    for i, choice in enumerate(sorted(map(tuple, mc_sim_7b_63), key=lambda c: (len(c), c)), start=1):
        node_of[choice] = i
        assert tree.parents[i] == node_of[choice[:-1]] and tree.ranks[i] == choice[-1]
    assert tree.paths[node_of[(0, 0, 0, 0, 1)]].tolist() == [0, 1, 5, 13, 21, 25]


def test_static_tree_rejects_bad_choices():
    with pytest.raises(ValueError, match="parent"):
        static_tree([[0], [0, 1, 0]])
    with pytest.raises(ValueError, match="non-empty"):
        static_tree([])
    with pytest.raises(ValueError, match="non-empty"):
        static_tree([[0], [-1]])


@pytest.mark.parametrize("T, seed", [(1, 0), (2, 0), (7, 1), (26, 2), (60, 3), (60, 4)])
def test_tree_structure_of_random_trees(T, seed):
    rng = random.Random(seed)
    batch = [random_parents(T, rng) for _ in range(3)]
    max_depth = max(max(brute_force_structure(p)[0]) for p in batch)
    depth, ancestors, paths = tree_structure(torch.tensor(batch), max_depth)
    for b, parents in enumerate(batch):
        check_structure(parents, depth[b], ancestors[b], paths[b])


def test_expand_scores_are_cumulative_and_strictly_decreasing():
    logp = torch.log_softmax(torch.randn(2, 3, 50), -1)
    logp[0, 0, 7] = 0.0  # a draft probability that rounds to 1
    frontier = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    tokens, scores = expand(frontier, logp, 4)
    assert tokens.shape == scores.shape == (2, 12)
    best = logp.topk(4, -1)
    assert torch.equal(tokens.view(2, 3, 4), best.indices)
    torch.testing.assert_close(scores.view(2, 3, 4), frontier[..., None] + best.values.clamp(max=-MIN_STEP))
    assert (scores.view(2, 3, 4) < frontier[..., None]).all()


@pytest.mark.parametrize("k, depth, n_keep, seed", [(2, 3, 5, 0), (3, 4, 12, 1), (10, 6, 59, 2), (4, 2, 20, 3)])
def test_rerank_keeps_the_best_and_their_ancestors(k, depth, n_keep, seed):
    """Build an EAGLE-2 pool the way draft.grow_dynamic_tree does, with random draft log-probs."""
    torch.manual_seed(seed)
    B, V = 2, 30
    tokens, scores = expand(torch.zeros(B, 1), torch.log_softmax(3 * torch.randn(B, 1, V), -1), k)
    pool_tokens, pool_scores, pool_parents = [tokens], [scores], [torch.full((B, k), -1)]
    frontier_pool, frontier_scores, size = torch.arange(k).expand(B, k), scores, k
    for _ in range(1, depth):
        child_tokens, child_scores = expand(frontier_scores, torch.log_softmax(3 * torch.randn(B, k, V), -1), k)
        pool_tokens.append(child_tokens)
        pool_scores.append(child_scores)
        pool_parents.append(frontier_pool.repeat_interleave(k, dim=1))
        best = child_scores.topk(k, -1).indices
        frontier_pool, frontier_scores, size = size + best, child_scores.gather(1, best), size + k * k
    pool_scores, pool_parents = torch.cat(pool_scores, 1), torch.cat(pool_parents, 1)
    keep, parents = rerank(pool_scores, pool_parents, n_keep)
    assert parents.shape == (B, n_keep + 1) and parents[:, 0].eq(-1).all()
    for b in range(B):
        kept = keep[b].tolist()
        assert kept == sorted(kept)
        assert set(kept) == set(pool_scores[b].topk(n_keep).indices.tolist())
        for node, pool_index in enumerate(kept, start=1):
            parent_pool = int(pool_parents[b, pool_index])
            expected = 0 if parent_pool < 0 else kept.index(parent_pool) + 1  # the parent is kept
            assert parents[b, node] == expected and expected < node


def test_tree_attention_mask():
    ancestors = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool).expand(2, 3, 3)
    mask = TreeMask(torch.tensor([2, 4]), ancestors).dense(10)
    assert mask.shape == (2, 3, 10)
    assert mask[0, :, :7].sum(-1).tolist() == [2, 2, 2] and mask[0, :, :2].all()  # prefix of 2 only
    assert mask[1, :, :7].sum(-1).tolist() == [4, 4, 4] and mask[1, :, :4].all()
    assert torch.equal(mask[:, :, 7:], ancestors)  # the region: the last 3 slots


def test_graft_chain_continues_the_path_it_repeats():
    """A lookup chain that starts like an existing path is not verified twice: its rest hangs
    below that path's last node; a chain the tree does not start goes below the root."""
    from trees import graft_chain

    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    tree = Tree(torch.tensor([[9, 1, 2, 3, 4, 5]]), parents, *tree_structure(parents, 2))
    grown = graft_chain(tree, torch.tensor([[1, 4, 7, 8, 6]]), 3)  # 1 -> 4 exists (node 4)
    assert grown.tokens[0].tolist() == [9, 1, 2, 3, 4, 5, 7, 8, 6]
    assert grown.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 4, 6, 7]
    assert grown.depth[0].tolist() == [0, 1, 1, 2, 2, 2, 3, 4, 5]
    assert grown.paths[0, 8].tolist() == [0, 1, 4, 6, 7, 8]
    assert grown.ancestors[0, 8].nonzero().flatten().tolist() == [0, 1, 4, 6, 7, 8]
    grown = graft_chain(tree, torch.tensor([[7, 7, 7, 7, 7]]), 3)  # no path starts with 7
    assert grown.parents[0, 6:].tolist() == [0, 6, 7] and grown.depth[0, 6:].tolist() == [1, 2, 3]
    grown = graft_chain(tree, torch.tensor([[2, 6, 6, 6, 6]]), 2)  # 2 exists, 2 -> 6 does not
    assert grown.parents[0, 6:].tolist() == [2, 6] and grown.tokens[0, 6:].tolist() == [6, 6]
