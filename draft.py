"""The EAGLE draft models (EAGLE-1/2 and EAGLE-3), and the trees of candidate tokens they grow.

EAGLE-1/2 (EagleDraft) predicts the target's next feature, its final post-norm hidden state f:

    x_t      = fc([embed(tok_{t+1}); f_t])          fc: Linear(2*dim -> dim), bias per checkpoint
    f^_{t+1} = decoder_layer(x_t)                   LLaMA layer without its input RMSNorm
    logits   = target_lm_head(f^_{t+1})             the target's own LM head, no final norm

EAGLE-3 (Eagle3Draft) reads richer features and has a head of its own over a reduced vocabulary:

    g_t      = fc([h^2_t; h^{L/2}_t; h^{L-3}_t])    the residual stream entering three target
                                                    layers; fc: Linear(3*dim -> dim), no bias
    a_t      = [input_norm(embed(tok_{t+1})); hidden_norm(g_t)]      (2*dim) feeds q, k and v
    o_t      = g_t + attention(a_t);  o_t = o_t + mlp(post_norm(o_t))   the layer's output
    logits   = lm_head(norm(o_t))                   over draft_vocab_size tokens; vocab[i] is the
                                                    target id of draft token i

Inside a tree, a node's own feature is the draft's output at its parent (f^ for EAGLE-1/2, the
raw layer output o for EAGLE-3, which is never fused again). Draft position t holds
(feature_t, tok_{t+1}). Both drafts use the target's embedding (and EAGLE-1/2 its LM head),
frozen and not stored in the draft checkpoint; tree-growing functions take them as arguments.
The two classes share one interface, which is all the rest of the code uses:

    draft(embeds, features, input_pos, cache_pos, mask)   -> hidden [B, n, dim]
    draft.log_probs(hidden, target_head)                  -> [B, n, draft vocabulary] float32
    draft.target_ids(draft_ids)                           -> target token ids
    draft.layer_ids, draft.select_features(final, layer_inputs)   which target features it reads

Files (draft_config.json + draft.safetensors) are read and written by checkpoint.py.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Attention, FeedForward, KVCache, ModelArgs, RMSNorm, TransformerBlock, TreeMask, precompute_rope
from trees import StaticTree, Tree, expand, rerank, tree_structure


class OneLayerDraft(nn.Module):
    """What both drafts share: their one layer's KV cache and RoPE tables."""
    max_batch_size = max_seq_length = -1  # no caches yet

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        """Later calls with sizes that already fit are free."""
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        c = self.config
        norm = self.layer.ffn_norm.weight  # fc may be quantized (int8 weight): a norm has the float dtype
        dtype, device = norm.dtype, norm.device
        shape = (2, max_batch_size, c.n_local_heads, max_seq_length, c.head_dim)
        self.layer.attention.kv_cache = KVCache(torch.zeros(shape, dtype=dtype, device=device))
        cos, sin = precompute_rope(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def positions(self, embeds: Tensor, input_pos: Tensor, cache_pos: Optional[Tensor], mask):
        """Transformer.forward's defaults for a draft forward: slots = positions, causal mask by slot.
        Returns the RoPE tables at input_pos, cache_pos and mask."""
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        B, n, _ = embeds.shape
        input_pos = input_pos.expand(B, n)
        cache_pos = input_pos if cache_pos is None else cache_pos.expand(B, n)
        if mask is None:
            mask = torch.arange(self.max_seq_length, device=embeds.device) <= cache_pos[..., None]
        return self.rope_cos[input_pos], self.rope_sin[input_pos], cache_pos, mask


class EagleDraft(OneLayerDraft):
    layer_ids = ()  # reads the target's final feature

    def __init__(self, config: ModelArgs, fc_bias: bool = True):
        super().__init__()
        if config.n_layer != 1:
            raise ValueError(f"an EAGLE draft has one decoder layer, config says n_layer={config.n_layer}")
        self.config, self.fc_bias = config, fc_bias
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=fc_bias)
        self.layer = TransformerBlock(config)
        self.layer.attention_norm = nn.Identity()  # fc's output feeds attention directly

    def forward(self, embeds: Tensor, features: Tensor, input_pos: Tensor, cache_pos: Optional[Tensor] = None,
                mask=None) -> Tensor:
        """embeds [B, n, dim] = target embedding of tok_{t+1}; features [B, n, dim] = f_t (true or
        predicted). Positions, slots and mask (dense or TreeMask) as in Transformer.forward.
        Returns f^_{t+1} [B, n, dim]."""
        cos, sin, cache_pos, mask = self.positions(embeds, input_pos, cache_pos, mask)
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        return self.layer(x, cos, sin, cache_pos, mask)

    def log_probs(self, hidden: Tensor, target_head) -> Tensor:
        return F.log_softmax(target_head(hidden).float(), dim=-1)

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids  # the draft's vocabulary is the target's

    def select_features(self, final: Tensor, layer_inputs: list) -> Tensor:
        return final


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads the normed token embedding and the normed feature
    side by side (2 * dim wide); the residual stream is the feature itself."""

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.input_norm = RMSNorm(config.dim, config.norm_eps)   # on the token embedding
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps)  # on the feature
        self.attention = Attention(config, in_dim=2 * config.dim)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)     # post-attention norm
        self.feed_forward = FeedForward(config)

    def forward(self, embeds, hidden, cos, sin, cache_pos, mask, kv_len=None):
        x = torch.cat([self.input_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.attention(x, cos, sin, cache_pos, mask, kv_len)
        return h + self.feed_forward(self.ffn_norm(h))


def eagle3_layer_ids(n_layer: int) -> tuple:
    """The target layers whose inputs EAGLE-3 fuses: a low, a middle and a high one, (2, L // 2,
    L - 3) as published (HF hidden_states[2], [L // 2], [L - 3]); clamped into range for the tiny
    test models, where they may repeat."""
    return tuple(min(max(i, 0), n_layer - 1) for i in (2, n_layer // 2, n_layer - 3))


class Eagle3Draft(OneLayerDraft):
    def __init__(self, config: ModelArgs, draft_vocab_size: int, layer_ids: Optional[tuple]):
        """layer_ids: the three target layers whose inputs it fuses; None while unknown (a published
        head names no target: checkpoint.load_draft fills them in for the target it is loaded for)."""
        super().__init__()
        if config.n_layer != 1:
            raise ValueError(f"an EAGLE-3 draft has one decoder layer, config says n_layer={config.n_layer}")
        if not 1 <= draft_vocab_size <= config.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {config.vocab_size}], got {draft_vocab_size}")
        if layer_ids is not None and len(layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got layer_ids {layer_ids}")
        self.config, self.draft_vocab_size = config, draft_vocab_size
        self.layer_ids = None if layer_ids is None else tuple(layer_ids)
        self.fc = nn.Linear(3 * config.dim, config.dim, bias=False)
        self.layer = Eagle3Layer(config)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, draft_vocab_size, bias=False)
        # vocab[i]: the target id of draft token i, ascending. (The reference stores the offsets
        # d2t[i] = vocab[i] - i and the mask t2d; convert_hf_checkpoint.py translates.)
        self.register_buffer("vocab", torch.arange(draft_vocab_size))

    def forward(self, embeds: Tensor, features: Tensor, input_pos: Tensor, cache_pos: Optional[Tensor] = None,
                mask=None) -> Tensor:
        """embeds [B, n, dim] = target embedding of tok_{t+1}; features [B, n, 3 * dim] = the
        target's fused layer inputs at t (fc is applied), or [B, n, dim] = the draft's own output
        at t's parent, inside a tree (used as it is). Returns the layer's output o [B, n, dim]."""
        cos, sin, cache_pos, mask = self.positions(embeds, input_pos, cache_pos, mask)
        # The draft may run in a lower precision than the target (--draft_dtype): its guesses only
        # decide how many tokens a round accepts, never which tokens come out (the target verifies).
        dtype = self.norm.weight.dtype
        embeds, features = embeds.to(dtype), features.to(dtype)
        if features.size(-1) != self.config.dim:  # the shape says which: no data-dependent branch
            features = self.fc(features)
        return self.layer(embeds, features, cos, sin, cache_pos, mask)

    def log_probs(self, hidden: Tensor, target_head=None) -> Tensor:
        return F.log_softmax(self.lm_head(self.norm(hidden)).float(), dim=-1)

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        return self.vocab[draft_ids]

    def select_features(self, final: Tensor, layer_inputs: list) -> Tensor:
        return torch.cat(layer_inputs, dim=-1)


def draft_config_for(target: ModelArgs, **overrides) -> ModelArgs:
    """The default draft shape for a target: one layer shaped like the target's own layers."""
    return ModelArgs(**{**target.to_dict(), "n_layer": 1, "num_experts": 0, **overrides})


# Growing a tree. The draft's cache keeps the accepted prefix in its first slots and the tree in
# a fixed region at its end; every tree node's entry sees the prefix and its ancestors' entries.
#   draft: EagleDraft or Eagle3Draft; embed: the target's embedding module; head: the target's
#   LM head (EAGLE-1/2 drafts read their logits through it).
#   root [B]: the last token chosen by the target; root_hidden [B, dim]: the draft's output at
#   the root's position (it predicts the feature after the root).
#   prefix_len [B]: tokens in the target's cache; the root is token prefix_len, a depth-d node is
#   token prefix_len + d, and its draft entry lives at draft position prefix_len + d - 1.
# Tokens in a tree are target ids: an EAGLE-3 draft's choices are mapped as they are made.
def dynamic_tree_slots(top_k: int, depth: int) -> int:
    """Draft cache slots an EAGLE-2 tree needs: top_k frontier entries for each of depth - 1 levels."""
    return top_k * (depth - 1)


def most_tokens(top_k: int, depth: int) -> int:
    """The largest tree an EAGLE-2 tree of this top_k and depth can keep, root included."""
    return 1 + top_k + (depth - 1) * top_k ** 2


class Pool(NamedTuple):
    """Every candidate a dynamic tree considered, in pool order (level by level, grouped by parent):
    what --tree_tokens auto reads to predict the acceptance of smaller trees."""
    scores: Tensor  # [B, N] cumulative draft log-probabilities
    depth: Tensor   # [N] the level of each candidate (1 = a child of the root)
    keep: Tensor    # [B, n_nodes - 1] pool indices of the tree's nodes 1 .. n_nodes - 1


def grow_dynamic_tree(draft, embed, head, root: Tensor, root_hidden: Tensor, prefix_len: Tensor,
                      top_k: int, depth: int, n_nodes: int, with_pool: bool = False):
    """EAGLE-2: expand the top_k most probable nodes of each level, then keep the best n_nodes - 1.

    Level 1 holds the root's top_k children. For each level d = 1 .. depth - 1, one draft forward
    over its top_k frontier nodes proposes top_k children each; a child's score is its parent's
    score plus its own draft log-probability (the log-probability of the whole path), and the
    top_k of those top_k^2 children form the next frontier. All children ever proposed stay
    candidates; at the end the n_nodes - 1 best scores become the tree (with the root in front).
    Level d's frontier entries occupy region slots (d - 1) * top_k ... of the draft cache.
    Returns the Tree, and with with_pool also the Pool of candidates."""
    B, k, device = root.size(0), top_k, root.device
    region = dynamic_tree_slots(k, depth)
    region_start = draft.max_seq_length - region
    tokens, scores = expand(torch.zeros(B, 1, device=device), draft.log_probs(root_hidden, head)[:, None], k)
    tokens = draft.target_ids(tokens)
    pool_tokens, pool_scores = [tokens], [scores]
    pool_parents = [torch.full((B, k), -1, dtype=torch.long, device=device)]
    frontier_pool = torch.arange(k, device=device).expand(B, k)  # pool indices of the frontier
    frontier_tokens, frontier_scores = tokens, scores
    frontier_features = root_hidden[:, None].expand(B, k, -1)  # the draft's output at each frontier node's parent
    frontier_sees = torch.zeros(B, k, region, dtype=torch.bool, device=device)  # ancestors' region slots
    own_slot = torch.eye(region, dtype=torch.bool, device=device)
    for d in range(1, depth):
        sees = frontier_sees | own_slot[(d - 1) * k: d * k]
        hidden = draft(embed(frontier_tokens), frontier_features, (prefix_len + d - 1)[:, None],
                       region_start + (d - 1) * k + torch.arange(k, device=device), TreeMask(prefix_len, sees))
        child_tokens, child_scores = expand(frontier_scores, draft.log_probs(hidden, head), k)  # [B, k * k]
        child_tokens = draft.target_ids(child_tokens)
        pool_tokens.append(child_tokens)
        pool_scores.append(child_scores)
        pool_parents.append(frontier_pool.repeat_interleave(k, dim=1))
        best = child_scores.topk(k, dim=-1).indices  # [B, k] within this level's k * k children
        parent = best // k  # which frontier node proposed it
        frontier_pool = k + (d - 1) * k * k + best  # the pool holds k at level 1, then k * k per level
        frontier_tokens, frontier_scores = child_tokens.gather(1, best), child_scores.gather(1, best)
        frontier_features = hidden.gather(1, parent[..., None].expand(-1, -1, hidden.size(-1)))
        frontier_sees = sees.gather(1, parent[..., None].expand(-1, -1, region))
    pool_tokens, pool_scores = torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1)
    keep, parents = rerank(pool_scores, torch.cat(pool_parents, 1), n_nodes - 1)
    tokens = torch.cat([root[:, None], pool_tokens.gather(1, keep)], dim=1)
    tree = Tree(tokens, parents, *tree_structure(parents, depth))
    if not with_pool:
        return tree
    levels = torch.repeat_interleave(torch.arange(1, depth + 1, device=device),
                                     torch.tensor([k] + [k * k] * (depth - 1), device=device))
    return tree, Pool(pool_scores, levels, keep)


def grow_static_tree(draft, embed, head, tree: StaticTree, root: Tensor, root_hidden: Tensor,
                     prefix_len: Tensor) -> Tree:
    """EAGLE-1: fill a fixed tree shape (its tensors on root's device: StaticTree.to). Level by
    level: the draft's ranked guesses after every node of level d - 1 (one LM-head pass per node,
    however many children it has), node i of level d takes its parent's ranks[i]-th guess, and
    one draft forward over level d gives the outputs its children are guessed from. Node i's
    entry occupies region slot i - 1 of the draft cache."""
    B, T, device = root.size(0), tree.parents.numel(), root.device
    region_start = draft.max_seq_length - (T - 1)
    sees_all = tree.ancestors[:, 1:]  # region slot j holds node j + 1; the root is in the prefix
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    tokens[:, 0] = root
    hidden = torch.zeros(B, T, draft.config.dim, dtype=root_hidden.dtype, device=device)  # output after each node
    hidden[:, 0] = root_hidden
    for d in range(1, tree.max_depth + 1):
        level, above = tree.levels[d], tree.levels[d - 1]
        guesses = draft.log_probs(hidden[:, above.start:above.stop], head).topk(tree.n_ranks, dim=-1).indices
        parent_at = tree.parents[level.start:level.stop] - above.start  # [n] index within level d - 1
        picked = guesses[:, parent_at, tree.ranks[level.start:level.stop]]  # [B, n]
        tokens[:, level.start:level.stop] = draft.target_ids(picked)
        if d == tree.max_depth:
            break
        idx = torch.arange(level.start, level.stop, device=device)
        hidden[:, level.start:level.stop] = draft(
            embed(tokens[:, level.start:level.stop]), hidden[:, tree.parents[level.start:level.stop]],
            (prefix_len + d - 1)[:, None], region_start + idx - 1,
            TreeMask(prefix_len, sees_all[idx].expand(B, -1, -1)))
    return Tree(tokens, tree.parents.expand(B, T), tree.depth.expand(B, T), tree.ancestors.expand(B, T, T),
                tree.paths.expand(B, T, -1))


# Prompt lookup: a draft without a model. The text so far often repeats itself (code, lists,
# quotes of the prompt, a model stuck in a loop): after the longest n-gram that ends the text and
# occurred before, guess that what followed it then follows again. Static shapes, no host sync:
# it runs inside a compiled round, over a history buffer of fixed size.
def lookup_continuation(history: Tensor, length: Tensor, k: int, max_ngram: int = 4):
    """history [B, H] token ids, of which the first length[b] are row b's text. For every earlier
    position i, n(i) = how many tokens ending at i equal the tokens ending the text (up to
    max_ngram); the match is the i with the largest n(i) >= 1, the most recent among those.
    Returns (tokens [B, k]: the k tokens after the match, n_valid [B]: how many of them the text
    really has (the rest are filler: any proposal is lossless), ngram [B]: n of the match, 0 when
    there is none (the tokens are then filler too))."""
    B, H = history.shape
    idx = torch.arange(H, device=history.device)
    last = length - 1
    run = torch.ones_like(history, dtype=torch.bool)  # the n-gram ending at i matches so far
    n = torch.zeros_like(history, dtype=torch.long)
    for j in range(max_ngram):
        here = history.gather(1, (idx - j).clamp(min=0).expand(B, H))       # token i - j
        there = history.gather(1, (last - j).clamp(min=0)[:, None])          # token last - j
        run = run & (here == there) & (idx >= j)[None] & (last >= j)[:, None]
        n = n + run
    earlier = idx[None] < last[:, None]  # the text's own end matches itself: not a match
    score = torch.where(earlier & (n > 0), n * H + idx, -1)
    best = score.max(1)
    ngram = torch.where(best.values >= 0, n.gather(1, best.indices[:, None])[:, 0], 0)
    start = best.indices + 1
    tokens = history.gather(1, (start[:, None] + torch.arange(k, device=history.device)).clamp(max=H - 1))
    n_valid = torch.where(ngram > 0, (length - start).clamp(0, k), 0)
    return tokens, n_valid, ngram
