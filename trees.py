"""Candidate trees for speculative decoding, as pure tensor functions of fixed shape.

A tree holds T nodes; node 0 is the root, the last token already chosen by the target, and
every other node is a draft guess for the token after its parent. Nodes are numbered so that a
parent comes before its children and siblings come in the draft's rank order (most probable
first). Example with T = 6:

        0            tokens   [r, a, b, c, d, e]
       / \\           parents  [-1, 0, 0, 1, 1, 2]
      1   2          depth    [0, 1, 1, 2, 2, 2]
     / \\   \\         ancestors (row i: the nodes that node i sees; itself included)
    3   4   5          0: 0          3: 0 1 3
                       1: 0 1        4: 0 1 4
                       2: 0 2        5: 0 2 5
                     paths (root-to-node, -1 padded): row 4 = [0, 1, 4]

The target verifies all T nodes in one forward. They sit in the last T slots of its KV cache (the
tree region, node i in slot R + i) at RoPE positions prefix_len + depth[i], and each attends to
the prefix and to its own ancestors. Accepted nodes are then copied down to the slots right
after the prefix. A fixed region keeps every index of the round independent of the prefix length
and hands an attention kernel its natural split: a prefix that is fully visible up to
prefix_len, and a small [T, T] mask.

Everything here has a batch dimension B in front and shapes that depend only on the tree's
budget, never on the data, so one speculative round compiles into a single graph.
"""
from typing import List, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

# EAGLE-1's static tree for 7B models: 25 draft nodes + root, depth 5. Each entry is a path of
# child ranks from the root: [0, 1] is the second most probable child of the most probable child.
mc_sim_7b_63 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


class Tree(NamedTuple):
    tokens: Tensor     # [B, T] long
    parents: Tensor    # [B, T] long, -1 for the root
    depth: Tensor      # [B, T] long, 0 for the root
    ancestors: Tensor  # [B, T, T] bool, ancestors[b, i, j]: node j is node i or one of its ancestors
    paths: Tensor      # [B, T, max_depth + 1] long: root-to-node path of every node, -1 padded


def tree_structure(parents: Tensor, max_depth: int):
    """depth, ancestor mask and root-to-node paths from parent links [B, T] (parents before children).

    Pointer jumping: after k steps `up` holds every node's k-th ancestor (the root stays the root),
    so max_depth gathers find all ancestors, and a node's k-th ancestor sits at depth - k of its path."""
    B, T = parents.shape
    idx = torch.arange(T, device=parents.device).expand(B, T)
    parent = parents.clamp(min=0)  # the root is its own parent
    up = idx
    chain = [idx]
    for _ in range(max_depth):
        up = parent.gather(1, up)
        chain.append(up)
    chain = torch.stack(chain, dim=-1)  # [B, T, max_depth + 1]: k-th ancestor, the root repeating at the end
    depth = (chain != 0).sum(-1)  # ancestors before reaching the root
    ancestors = torch.zeros(B, T, T, dtype=torch.bool, device=parents.device)
    ancestors.scatter_(2, chain, True)
    # path[d] = ancestor at depth d = (depth - d)-th ancestor; positions past the node's depth are -1.
    d = torch.arange(max_depth + 1, device=parents.device)
    k = depth[..., None] - d
    paths = chain.gather(2, k.clamp(min=0)).masked_fill(k < 0, -1)
    return depth, ancestors, paths


# Static trees (EAGLE-1)
class StaticTree(nn.Module):
    """A tree whose shape is fixed in advance; only the tokens are filled in each round. Without a
    batch dimension: the same shape serves every row. Its tensors are buffers, so that .to(device)
    moves them and a compiled round keeps them as constants (a package cannot build from tensors a
    graph captures from plain attributes)."""

    def __init__(self, parents: Tensor, ranks: Tensor, depth: Tensor, ancestors: Tensor, paths: Tensor,
                 levels: List[range]):
        super().__init__()
        # parents, depth [T]; ranks [T]: node i is the ranks[i]-th most probable child of its parent
        # (root: 0); ancestors [T, T]; paths [T, max_depth + 1]
        for name, t in dict(parents=parents, ranks=ranks, depth=depth, ancestors=ancestors, paths=paths).items():
            self.register_buffer(name, t, persistent=False)
        self.levels = levels  # node indices of each depth: levels[d] = nodes at depth d
        self.max_depth = len(levels) - 1
        self.n_ranks = int(ranks.max()) + 1  # how many guesses per node the tree reads


def static_tree(choices: List[List[int]]) -> StaticTree:
    """Build a static tree from a list of child-rank paths (every path's prefixes must be listed)."""
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if not paths or any(len(c) == 0 or min(c) < 0 for c in paths):
        raise ValueError("a tree is a non-empty list of non-empty paths of child ranks >= 0, e.g. [[0], [1], [0, 0]]")
    index = {(): 0}
    parents, ranks = [-1], [0]
    for c in paths:
        if c[:-1] not in index:
            raise ValueError(f"tree path {list(c)} is listed but its parent {list(c[:-1])} is not")
        index[c] = len(parents)
        parents.append(index[c[:-1]])
        ranks.append(c[-1])
    max_depth = max(len(c) for c in paths)
    parents_t = torch.tensor(parents)
    depth, ancestors, node_paths = tree_structure(parents_t[None], max_depth)
    levels = [range(0, 1)]
    for d in range(1, max_depth + 1):
        at_d = [i for i, c in enumerate([()] + paths) if len(c) == d]
        levels.append(range(at_d[0], at_d[-1] + 1))
    return StaticTree(parents_t, torch.tensor(ranks), depth[0], ancestors[0], node_paths[0], levels)


# Dynamic trees (EAGLE-2)
# Scores are cumulative draft log-probabilities. A child's score must be strictly below its
# parent's, so that keeping the best nodes never keeps a child without its parent; a draft
# probability that rounds to 1 would otherwise make them tie.
MIN_STEP = 1e-4


def expand(frontier_scores: Tensor, child_logp: Tensor, top_k: int):
    """Each frontier node proposes its top_k children.

    frontier_scores [B, F]; child_logp [B, F, V] (draft log-probabilities after each frontier node).
    Returns tokens [B, F * top_k] and scores [B, F * top_k], grouped by parent, best child first."""
    logp, tokens = child_logp.topk(top_k, dim=-1)
    scores = frontier_scores[..., None] + logp.clamp(max=-MIN_STEP)
    return tokens.flatten(1), scores.flatten(1)


def rerank(pool_scores: Tensor, pool_parents: Tensor, n_keep: int):
    """Keep the n_keep best candidates of the pool and number them as tree nodes 1..n_keep.

    The pool lists candidates level by level, each level grouped by parent in rank order, so
    sorting the kept pool indices puts parents before children and siblings in rank order.
    pool_parents [B, N] are pool indices (-1: child of the root). Returns the kept pool indices
    [B, n_keep] and the tree's parent links [B, n_keep + 1] in node numbering."""
    B, N = pool_scores.shape
    keep = pool_scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values
    node_of = torch.zeros(B, N + 1, dtype=torch.long, device=pool_scores.device)  # pool index + 1 -> node
    node_of.scatter_(1, keep + 1, torch.arange(1, n_keep + 1, device=pool_scores.device).expand(B, n_keep))
    parents = node_of.gather(1, pool_parents.gather(1, keep) + 1)  # the root's children get node 0
    root = torch.full((B, 1), -1, dtype=torch.long, device=pool_scores.device)
    return keep, torch.cat([root, parents], dim=1)


# Hybrid trees: a chain of guesses from elsewhere (prompt lookup) grafted onto a tree
def graft_chain(tree: Tree, chain: Tensor, k: int) -> Tree:
    """The tree with k more nodes: chain [B, D + k] guesses the tokens after the root in order
    (D = the tree's depth). Its longest prefix that the tree already holds as a path from the root
    is not repeated (it would be verified twice, and a duplicate sibling is never accepted); the
    next k chain tokens hang below that path's last node, one under the other. The new nodes come
    after the old ones (parents still precede children); the tree gets D + k levels."""
    B, T = tree.tokens.shape
    D = tree.paths.size(-1) - 1
    steps = torch.arange(D, device=chain.device)
    path_tokens = tree.tokens.gather(1, tree.paths.clamp(min=0).flatten(1)).view(B, T, D + 1)[:, :, 1:]
    spells = ((path_tokens == chain[:, None, :D]) | (steps >= tree.depth[..., None])).all(-1)  # path = chain[:depth]
    anchor = (tree.depth * spells).argmax(1)  # the deepest such node; the root always qualifies
    matched = tree.depth.gather(1, anchor[:, None])  # [B, 1]
    new = torch.arange(k, device=chain.device)
    tokens = torch.cat([tree.tokens, chain.gather(1, matched + new)], 1)
    parents = torch.cat([tree.parents, torch.cat([anchor[:, None], (T + new[:-1]).expand(B, k - 1)], 1)], 1)
    return Tree(tokens, parents, *tree_structure(parents, D + k))
