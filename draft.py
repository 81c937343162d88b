"""The EAGLE-1/2 draft model, and the trees of candidate tokens it grows.

The draft predicts the target's next feature (its final post-norm hidden state) one step ahead:

    x_t      = fc([embed(tok_{t+1}); f_t])          fc: Linear(2*dim -> dim), bias per checkpoint
    f^_{t+1} = decoder_layer(x_t)                   LLaMA layer without its input RMSNorm
    logits   = lm_head(f^_{t+1})                    the target's own LM head, no final norm

Draft position t holds (f_t, tok_{t+1}). The target's embedding and LM head are reused, frozen,
and not stored in the draft checkpoint. Tree-growing functions here take them as arguments.

A draft checkpoint is a folder with draft_config.json (the layer's shape) and draft.safetensors.
"""
import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import KVCache, ModelArgs, TransformerBlock, TreeMask, precompute_rope
from tree import StaticTree, Tree, expand, rerank, tree_structure

DRAFT_CONFIG = "draft_config.json"
DRAFT_WEIGHTS = "draft.safetensors"


class EagleDraft(nn.Module):
    def __init__(self, config: ModelArgs, fc_bias: bool = True):
        super().__init__()
        if config.n_layer != 1:
            raise ValueError(f"an EAGLE draft has one decoder layer, config says n_layer={config.n_layer}")
        self.config, self.fc_bias = config, fc_bias
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=fc_bias)
        self.layer = TransformerBlock(config)
        self.layer.attention_norm = nn.Identity()  # fc's output feeds attention directly
        self.max_batch_size = self.max_seq_length = -1

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        c = self.config
        norm = self.layer.ffn_norm.weight  # fc may be quantized (int8 weight): a norm has the float dtype
        dtype, device = norm.dtype, norm.device
        self.layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, c.n_local_heads, c.head_dim, dtype).to(device)
        cos, sin = precompute_rope(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(self, embeds: Tensor, features: Tensor, input_pos: Tensor, cache_pos: Optional[Tensor] = None,
                mask=None) -> Tensor:
        """embeds [B, n, dim] = target embedding of tok_{t+1}; features [B, n, dim] = f_t (true or
        predicted). Positions, slots and mask (dense or TreeMask) as in Transformer.forward.
        Returns f^_{t+1} [B, n, dim]."""
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        B, n, _ = embeds.shape
        input_pos = input_pos.expand(B, n)
        cache_pos = input_pos if cache_pos is None else cache_pos.expand(B, n)
        if mask is None:
            mask = torch.arange(self.max_seq_length, device=embeds.device) <= cache_pos[..., None]
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        return self.layer(x, self.rope_cos[input_pos], self.rope_sin[input_pos], cache_pos, mask)


def draft_config_for(target: ModelArgs, **overrides) -> ModelArgs:
    """The default draft shape for a target: one layer shaped like the target's own layers."""
    fields = dict(target.to_dict(), n_layer=1, num_experts=0)
    fields.update(overrides)
    return ModelArgs(**fields)


def save_draft(draft: EagleDraft, folder, dtype: Optional[torch.dtype] = None):
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(folder / DRAFT_WEIGHTS))
    (folder / DRAFT_CONFIG).write_text(json.dumps({"model": draft.config.to_dict(), "fc_bias": draft.fc_bias}, indent=1))
    return folder


def load_draft(path, target_config: ModelArgs, device="cpu", dtype=torch.float32) -> EagleDraft:
    """A draft folder (its draft.safetensors), or one weights file in it: draft.safetensors as
    written by save_draft or convert_hf_checkpoint.py --eagle_dir, or draft_int8.safetensors /
    draft_int4.gNN.safetensors written by quantize.py --draft. Checks that it fits the target."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    import quantize

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config_file, weights = folder / DRAFT_CONFIG, (folder / DRAFT_WEIGHTS if path.is_dir() else path)
    if not config_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"no EAGLE draft at {path}: expected {DRAFT_CONFIG} and {weights.name} in {folder}")
    meta = json.loads(config_file.read_text())
    config = ModelArgs(**meta["model"])
    if config.dim != target_config.dim:
        raise ValueError(f"draft {folder} has hidden size {config.dim}, the target has {target_config.dim}")
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"draft {folder} was made for a vocabulary of {config.vocab_size} tokens, "
                         f"the target has {target_config.vocab_size}")
    with torch.device("meta"):
        draft = EagleDraft(config, fc_bias=meta["fc_bias"])
    try:
        state_dict = load_file(str(weights))
        quantize.prepare_for_loading(draft, state_dict, weights)  # int8/int4 layers, when the file has them
        draft.load_state_dict(state_dict, assign=True)
    except (RuntimeError, SafetensorError) as e:
        raise ValueError(f"{weights} does not match {config_file}: {e}") from None
    return quantize.pack_int4(draft.to(device=device, dtype=dtype).eval())


# ---------------------------------------------------------------------------------------------
# Growing a tree. The draft's cache keeps the accepted prefix in its first slots and the tree in
# a fixed region at its end; every tree node's entry sees the prefix and its ancestors' entries.
#   embed: the target's embedding module; head: the target's LM head.
#   root [B]: the last token chosen by the target; root_hidden [B, dim]: the draft's output at
#   the root's position (it predicts the feature after the root).
#   prefix_len [B]: tokens in the target's cache; the root is token prefix_len, a depth-d node is
#   token prefix_len + d, and its draft entry lives at draft position prefix_len + d - 1.
# ---------------------------------------------------------------------------------------------
def _draft_logp(head, hidden: Tensor) -> Tensor:
    return F.log_softmax(head(hidden).float(), dim=-1)


def dynamic_tree_slots(top_k: int, depth: int) -> int:
    """Draft cache slots an EAGLE-2 tree needs: top_k frontier entries for each of depth - 1 levels."""
    return top_k * (depth - 1)


def grow_dynamic_tree(draft: EagleDraft, embed, head, root: Tensor, root_hidden: Tensor, prefix_len: Tensor,
                      top_k: int, depth: int, n_nodes: int) -> Tree:
    """EAGLE-2: expand the top_k most probable nodes of each level, then keep the best n_nodes - 1.

    Level 1 holds the root's top_k children. For each level d = 1 .. depth - 1, one draft forward
    over its top_k frontier nodes proposes top_k children each; a child's score is its parent's
    score plus its own draft log-probability (the log-probability of the whole path), and the
    top_k of those top_k^2 children form the next frontier. All children ever proposed stay
    candidates; at the end the n_nodes - 1 best scores become the tree (with the root in front).
    Level d's frontier entries occupy region slots (d - 1) * top_k ... of the draft cache."""
    B = root.size(0)
    k, device = top_k, root.device
    region = dynamic_tree_slots(k, depth)
    region_start = draft.max_seq_length - region
    tokens, scores = expand(torch.zeros(B, 1, device=device), _draft_logp(head, root_hidden)[:, None], k)
    pool_tokens, pool_scores = [tokens], [scores]
    pool_parents = [torch.full((B, k), -1, dtype=torch.long, device=device)]
    frontier_pool = torch.arange(k, device=device).expand(B, k)  # pool indices of the frontier
    frontier_tokens, frontier_scores = tokens, scores
    frontier_features = root_hidden[:, None].expand(B, k, -1)  # f^ at each frontier node's parent
    frontier_sees = torch.zeros(B, k, region, dtype=torch.bool, device=device)  # ancestors' region slots
    own_slot = torch.eye(region, dtype=torch.bool, device=device)
    pool_size = k
    for d in range(1, depth):
        sees = frontier_sees | own_slot[(d - 1) * k: d * k]
        hidden = draft(embed(frontier_tokens), frontier_features, (prefix_len + d - 1)[:, None],
                       region_start + (d - 1) * k + torch.arange(k, device=device), TreeMask(prefix_len, sees))
        child_tokens, child_scores = expand(frontier_scores, _draft_logp(head, hidden), k)  # [B, k * k]
        pool_tokens.append(child_tokens)
        pool_scores.append(child_scores)
        pool_parents.append(frontier_pool.repeat_interleave(k, dim=1))
        best = child_scores.topk(k, dim=-1).indices  # [B, k] within this level's k * k children
        parent = best // k  # which frontier node proposed it
        frontier_pool = pool_size + best
        frontier_tokens, frontier_scores = child_tokens.gather(1, best), child_scores.gather(1, best)
        frontier_features = hidden.gather(1, parent[..., None].expand(-1, -1, hidden.size(-1)))
        frontier_sees = sees.gather(1, parent[..., None].expand(-1, -1, region))
        pool_size += k * k
    pool_tokens = torch.cat(pool_tokens, 1)
    keep, parents = rerank(torch.cat(pool_scores, 1), torch.cat(pool_parents, 1), n_nodes - 1)
    tokens = torch.cat([root[:, None], pool_tokens.gather(1, keep)], dim=1)
    node_depth, ancestors, paths = tree_structure(parents, depth)
    return Tree(tokens, parents, node_depth, ancestors, paths)


def grow_static_tree(draft: EagleDraft, embed, head, tree: StaticTree, root: Tensor, root_hidden: Tensor,
                     prefix_len: Tensor) -> Tree:
    """EAGLE-1: fill a fixed tree shape. Level by level, one draft forward over the nodes of level d
    gives their ranked children; node i takes its parent's ranks[i]-th most probable token.
    Node i's entry occupies region slot i - 1 of the draft cache."""
    B, T = root.size(0), tree.parents.numel()
    device = root.device
    region_start = draft.max_seq_length - (T - 1)
    n_ranks = int(tree.ranks.max()) + 1
    parents, ranks = tree.parents.to(device), tree.ranks.to(device)
    sees_all = tree.ancestors[:, 1:].to(device)  # region slot j holds node j + 1; the root is in the prefix
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    tokens[:, 0] = root
    hidden = torch.zeros(B, T, draft.config.dim, dtype=root_hidden.dtype, device=device)  # f^ after each node
    hidden[:, 0] = root_hidden
    for d in range(1, tree.max_depth + 1):
        level = tree.levels[d]
        # this level's tokens: ranked children of their parents (all at depth d - 1, already expanded)
        top = head(hidden[:, parents[level.start:level.stop]]).topk(n_ranks, dim=-1).indices  # [B, n, n_ranks]
        tokens[:, level.start:level.stop] = top.gather(2, ranks[level.start:level.stop].expand(B, -1)[..., None])[..., 0]
        if d == tree.max_depth:
            break
        idx = torch.arange(level.start, level.stop, device=device)
        hidden[:, level.start:level.stop] = draft(
            embed(tokens[:, level.start:level.stop]), hidden[:, parents[level.start:level.stop]],
            (prefix_len + d - 1)[:, None], region_start + idx - 1,
            TreeMask(prefix_len, sees_all[idx].expand(B, -1, -1)))
    node_depth = tree.depth.to(device).expand(B, T)
    return Tree(tokens, parents.expand(B, T), node_depth, tree.ancestors.to(device).expand(B, T, T),
                tree.paths.to(device).expand(B, T, -1))
