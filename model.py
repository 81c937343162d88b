"""A LLaMA-family decoder (LLaMA-2/3/3.1, Vicuna, Mistral, Mixtral, Qwen2, SmolLM2) with a static KV cache.

One file, read top to bottom: config, KV cache, tree masks, transformer, attention, feed-forward
(dense or mixture of experts), RMSNorm, RoPE. It imports nothing of this project: what adapts the
model to a device or a mode is applied from outside, as gpt-fast does it (attention.py sets each
Attention's kernel, quantize.py and cpu.py swap linears, tp.py shards weights and hooks an
all-reduce onto layers, invariant.py puts the model in batch-invariant mode).

The forward pass takes three things that plain decoding conflates, separately:

    input_pos  [B, T]  the RoPE position of each token
    cache_pos  [B, T]  the KV-cache slot each token's K/V is written to
    mask       [B, T, S] which of the S cache slots each token attends to (or a TreeMask)

For prefill and one-token decode they coincide (slot = position, causal mask). Tree verification
is why they are separate: a tree of T candidate tokens sits in T fixed slots at the end of the
cache (its tree region), but its positions are prefix_len + depth and each node sees the prefix
and its own ancestors only. Positions and slots are per row of the batch, so rows may hold
prefixes of different lengths (batched speculative decoding).

Weights are laid out as in Hugging Face checkpoints: q/k use the rotate-half RoPE convention.
"""
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

CONFIG_FILE = "model_config.json"  # written by convert_hf_checkpoint.py beside model.pth


@dataclass
class ModelArgs:
    block_size: int = 4096  # longest context the model was trained for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1  # key/value heads (GQA); -1 means n_head
    head_dim: Optional[int] = None  # defaults to dim // n_head
    rope_base: float = 10000.0
    rope_scaling: Optional[dict] = None  # llama-3.1 style {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v
    tie_embeddings: bool = False  # LM head shares the embedding matrix (SmolLM2, small Qwen2)
    sliding_window: Optional[int] = None  # Mistral-7B-v0.1
    num_experts: int = 0  # > 0: Mixtral sparse mixture-of-experts feed-forward
    num_activated_experts: int = 2

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size is None:
            # LLaMA's rule: 2/3 of 4*dim, rounded up to a multiple of 256.
            hidden = int(2 * (4 * self.dim) / 3)
            self.intermediate_size = 256 * ((hidden + 255) // 256)
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_local_heads={self.n_local_heads}")
        if self.num_experts and not 1 <= self.num_activated_experts <= self.num_experts:
            raise ValueError(f"num_activated_experts={self.num_activated_experts} must be in [1, num_experts="
                             f"{self.num_experts}]")

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """gpt-fast convention: the longest known config name contained in `name` (case-insensitive)."""
        hits = [k for k in transformer_configs if k.lower() in name.lower()]
        if not hits:
            raise ValueError(f"unknown model name {name!r} and no {CONFIG_FILE} beside the checkpoint; convert it with "
                             f"convert_hf_checkpoint.py or name its folder after one of: {', '.join(sorted(transformer_configs))}")
        return cls(**transformer_configs[max(hits, key=len)])

    @classmethod
    def from_checkpoint(cls, checkpoint_path) -> "ModelArgs":
        """The config the converter wrote beside the weights, else the one named by the folder."""
        folder = Path(checkpoint_path).parent
        config_file = folder / CONFIG_FILE
        if config_file.is_file():
            return cls(**json.loads(config_file.read_text())["model"])
        return cls.from_name(folder.name)

    def to_dict(self) -> dict:
        return asdict(self)


_LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

transformer_configs = {
    # LLaMA-2 and Vicuna (v1.3 is LLaMA-1 based: 2k context, eps 1e-6)
    "llama-2-7b": dict(block_size=4096, n_layer=32, n_head=32, dim=4096, intermediate_size=11008),
    "llama-2-13b": dict(block_size=4096, n_layer=40, n_head=40, dim=5120, intermediate_size=13824),
    "llama-2-70b": dict(block_size=4096, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672),
    "vicuna-7b": dict(block_size=2048, n_layer=32, n_head=32, dim=4096, intermediate_size=11008, norm_eps=1e-6),
    "vicuna-13b": dict(block_size=2048, n_layer=40, n_head=40, dim=5120, intermediate_size=13824, norm_eps=1e-6),
    "vicuna-33b": dict(block_size=2048, n_layer=60, n_head=52, dim=6656, intermediate_size=17920, norm_eps=1e-6),
    # LLaMA-3 / 3.1
    "llama-3-8b": dict(block_size=8192, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                       vocab_size=128256, rope_base=500000.0),
    "llama-3-70b": dict(block_size=8192, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
                        vocab_size=128256, rope_base=500000.0),
    "llama-3.1-8b": dict(block_size=131072, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                         vocab_size=128256, rope_base=500000.0, rope_scaling=_LLAMA31_ROPE),
    "llama-3.1-70b": dict(block_size=131072, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672,
                          vocab_size=128256, rope_base=500000.0, rope_scaling=_LLAMA31_ROPE),
    # Mistral (v0.1: sliding-window attention over 4096 tokens)
    "mistral-7b": dict(block_size=32768, n_layer=32, n_head=32, n_local_heads=8, dim=4096, intermediate_size=14336,
                       sliding_window=4096),
    # Mixtral (sparse mixture of experts: 8 SwiGLU experts per layer, 2 active per token)
    "Mixtral-8x7B-v0.1": dict(block_size=32768, n_layer=32, n_head=32, n_local_heads=8, dim=4096,
                              intermediate_size=14336, rope_base=1000000.0, num_experts=8, num_activated_experts=2),
    # SmolLM2 (tied embeddings)
    "SmolLM2-135M": dict(block_size=8192, n_layer=30, n_head=9, n_local_heads=3, dim=576, intermediate_size=1536,
                         vocab_size=49152, rope_base=100000.0, tie_embeddings=True),
    "SmolLM2-360M": dict(block_size=8192, n_layer=32, n_head=15, n_local_heads=5, dim=960, intermediate_size=2560,
                         vocab_size=49152, rope_base=100000.0, tie_embeddings=True),
    "SmolLM2-1.7B": dict(block_size=8192, n_layer=24, n_head=32, n_local_heads=32, dim=2048, intermediate_size=8192,
                         vocab_size=49152, rope_base=130000.0, tie_embeddings=True),
    # Qwen2.5 (q/k/v biases; small ones tie embeddings); the Coder models share these shapes
    "Qwen2.5-0.5B": dict(block_size=32768, n_layer=24, n_head=14, n_local_heads=2, dim=896, intermediate_size=4864,
                         vocab_size=151936, rope_base=1000000.0, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True),
    "Qwen2.5-1.5B": dict(block_size=32768, n_layer=28, n_head=12, n_local_heads=2, dim=1536, intermediate_size=8960,
                         vocab_size=151936, rope_base=1000000.0, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True),
    "Qwen2.5-7B": dict(block_size=32768, n_layer=28, n_head=28, n_local_heads=4, dim=3584, intermediate_size=18944,
                       vocab_size=152064, rope_base=1000000.0, norm_eps=1e-6, qkv_bias=True),
}
for _size in ("0.5B", "1.5B", "7B"):
    transformer_configs[f"Qwen2.5-Coder-{_size}"] = transformer_configs[f"Qwen2.5-{_size}"]
transformer_configs["Mixtral-8x7B-Instruct-v0.1"] = transformer_configs["Mixtral-8x7B-v0.1"]


class KVCache(nn.Module):
    """Keys and values of one layer in buffers of fixed shape [B, n_kv_heads, S, head_dim], allocated
    once (static shapes: CUDA graphs, no re-allocation): views of the Transformer's kv_storage."""

    def __init__(self, storage: Tensor):
        super().__init__()
        # detach(): unbind's views may not be written in place once grad mode is on
        k_cache, v_cache = (t.detach() for t in storage.unbind())
        self.register_buffer("k_cache", k_cache, persistent=False)
        self.register_buffer("v_cache", v_cache, persistent=False)

    def update(self, cache_pos: Tensor, k: Tensor, v: Tensor):
        # cache_pos [B, T]; k, v [B, H, T, D]: row b's tokens go to row b's own slots (indexed
        # assignment: the same as scatter_ on a GPU, faster in bf16 on a CPU)
        rows = torch.arange(k.size(0), device=k.device)[:, None]
        self.k_cache[rows, :, cache_pos] = k.transpose(1, 2)
        self.v_cache[rows, :, cache_pos] = v.transpose(1, 2)
        return self.k_cache[:k.size(0)], self.v_cache[:k.size(0)]


def copy_slots(model: "Transformer", src: Tensor, dst: Tensor):
    """Copy row b's entries in slots src[b] to slots dst[b] (both [B, n]), keys and values of every
    layer; all reads come before any write, so the two may overlap. Speculative decoding moves
    accepted tree nodes down to the end of the prefix with this. Eager, one gather and one scatter
    over kv_storage move every layer at once. Compiled, or with caches that are not its views
    (torch.func.functional_call's), the copy goes through each layer's caches, which Inductor fuses:
    a graph mutating kv_storage and the views overlapping it would get them merged into one
    synthetic base, losing their static marks (no CUDA graph)."""
    rows = torch.arange(src.size(0), device=src.device)[:, None]
    if not torch.compiler.is_compiling() and model._caches_are_views():
        model.kv_storage[:, :, rows, :, dst] = model.kv_storage[:, :, rows, :, src]
        return
    for layer in model.layers:
        cache = layer.attention.kv_cache
        k, v = cache.k_cache[rows, :, src], cache.v_cache[rows, :, src]
        cache.k_cache[rows, :, dst] = k
        cache.v_cache[rows, :, dst] = v


class TreeMask(NamedTuple):
    """The mask of tree queries, compact. Query i of row b sees the prefix, slots < prefix_len[b],
    and those slots of the tree region, the last R = visible.size(-1) slots of the cache, that
    visible[b, i] marks; never the slots in between. Accepted wherever a dense [B, T, S] mask is:
    a fused kernel takes it as it is (gpu_kernels/tree_attention.py), sdpa() as dense()."""
    prefix_len: Tensor  # [B] long
    visible: Tensor     # [B, T, R] bool

    def dense(self, cache_len: int) -> Tensor:
        """The same mask as [B, T, cache_len] bool."""
        B, n, R = self.visible.shape
        prefix = torch.arange(cache_len - R, device=self.visible.device) < self.prefix_len[:, None]
        return torch.cat([prefix[:, None, :].expand(B, n, cache_len - R), self.visible], dim=-1)


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size, self.max_seq_length = -1, -1
        self.register_buffer("kv_storage", None, persistent=False)  # [n_layer, 2, B, KV, S, head_dim]: setup_caches

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        """Allocate the KV cache and the RoPE table once; later calls with sizes that fit are free.
        Every layer's cache is a view of kv_storage (copy_slots moves entries in all of them at once)."""
        if self.max_seq_length < max_seq_length or self.max_batch_size < max_batch_size:
            self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
            c = self.config
            dtype, device = self.norm.weight.dtype, self.norm.weight.device
            kv_heads = self.layers[0].attention.n_local_heads  # this rank's share under tensor parallelism (tp.py)
            self.register_buffer("kv_storage", torch.zeros(c.n_layer, 2, max_batch_size, kv_heads, max_seq_length,
                                                           c.head_dim, dtype=dtype, device=device), persistent=False)
            cos, sin = precompute_rope(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling)
            self.register_buffer("rope_cos", cos.to(device), persistent=False)
            self.register_buffer("rope_sin", sin.to(device), persistent=False)
        elif self._caches_are_views():  # else .to() or .float() after setup copied each buffer apart
            return
        for layer, storage in zip(self.layers, self.kv_storage):
            layer.attention.kv_cache = KVCache(storage)

    def _caches_are_views(self) -> bool:
        first = self.layers[0].attention.kv_cache.k_cache
        return first.device == self.kv_storage.device and first.data_ptr() == self.kv_storage.data_ptr()

    def forward(self, idx: Tensor, input_pos: Tensor, cache_pos: Optional[Tensor] = None,
                mask=None, return_features: bool = False, layer_ids=(), kv_len: Optional[int] = None,
                last_logits: bool = False):
        """idx [B, T] token ids; input_pos [B, T] (or [T], shared by all rows) RoPE positions;
        cache_pos: slots to write, default = input_pos; mask [B, T, S] bool or a TreeMask (or
        another mask object that the attention kernels in use know), default causal by slot.
        kv_len: a host int promising that no query sees a slot >= kv_len, so that attention reads
        only the cache's first kv_len slots instead of all S. last_logits: the LM head reads the last
        position only (a prefill samples from it alone; all L would be an L x vocab tensor).

        Returns logits [B, T, vocab]; with return_features or layer_ids, the tuple
        (logits, features, layer_inputs): features is the final post-norm hidden state that the
        LM head reads (the EAGLE feature), layer_inputs the residual stream entering each layer
        in layer_ids (EAGLE-3 fuses layers 2, L//2 and L-3)."""
        if self.max_seq_length < 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        B, T = idx.shape
        input_pos = input_pos.expand(B, T)
        cache_pos = input_pos if cache_pos is None else cache_pos.expand(B, T)
        if any(not 0 <= i < len(self.layers) for i in layer_ids):
            raise ValueError(f"layer_ids {tuple(layer_ids)} name layers the model does not have (it has {len(self.layers)})")
        if kv_len is not None and (not (mask is None or isinstance(mask, Tensor)) or not 0 < kv_len <= self.max_seq_length):
            raise ValueError(f"kv_len must be in [1, {self.max_seq_length}] and comes with a dense mask or none, got {kv_len}")
        slots = torch.arange(self.max_seq_length if kv_len is None else kv_len, device=idx.device)
        if mask is None:
            mask = slots <= cache_pos[..., None]
        elif kv_len is not None:
            mask = mask[..., :kv_len]
        if self.config.sliding_window is not None:
            if isinstance(mask, TreeMask):  # a kernel for compact tree masks knows no window: dense
                mask = mask.dense(self.max_seq_length)
            # Keys older than the window are hidden. A prefix slot's position is its index; the
            # tree region's slots lie past every position and pass, as the newest tokens should.
            mask = mask & (slots > input_pos[..., None] - self.config.sliding_window)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [B, T, head_dim]

        x = self.tok_embeddings(idx)
        seen = {}  # layer index -> the residual stream entering it
        for i, layer in enumerate(self.layers):
            if i in layer_ids:
                seen[i] = x
            x = layer(x, cos, sin, cache_pos, mask, kv_len)
        features = self.norm(x)
        logits = self.output(features[:, -1:] if last_logits else features)
        if return_features or layer_ids:
            return logits, features, [seen[i] for i in layer_ids]  # in the order asked for
        return logits


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = MoEFeedForward(config) if config.num_experts else FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, cos, sin, cache_pos, mask, kv_len=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, cache_pos, mask, kv_len)
        return h + self.feed_forward(self.ffn_norm(h))


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """Attention of queries q [B, H, T, D] over the cache k, v [B, KV, S, D] (GQA: H a multiple of
    KV) under mask [B, T, S] bool or a TreeMask: PyTorch's scaled_dot_product_attention. Every
    Attention calls its `attend`, this function unless attention.py or invariant.py set another."""
    if isinstance(mask, TreeMask):
        mask = mask.dense(k.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.size(1) != k.size(1))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs, in_dim: Optional[int] = None):
        """in_dim: the width of the input that q, k and v are computed from; config.dim except in
        EAGLE-3's draft layer, which reads a token embedding and a feature side by side."""
        super().__init__()
        # Tensor parallelism (tp.py) makes these this rank's share of the heads.
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        # q, k and v in one matmul: one weight read per decode step instead of three.
        qkv_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(in_dim or config.dim, qkv_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None
        self.attend = sdpa  # (q, k, v, mask) -> [B, H, T, D]: the kernel, chosen from outside (attention.py)

    def forward(self, x, cos, sin, cache_pos, mask, kv_len=None):
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = self.kv_cache.update(cache_pos, k, v)
        if kv_len is not None:  # the slots past it are invisible: do not read them
            k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        return self.wo(self.attend(q, k, v, mask).transpose(1, 2).reshape(B, T, q_size))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate_proj, w3 = up_proj, w2 = down_proj."""

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """Mixtral's sparse mixture of experts: a router (gate) picks num_activated_experts (k) of the
    num_experts (E) SwiGLU experts for each token and mixes their outputs; w1, w3, w2 hold the
    experts' gate_proj, up_proj, down_proj, each stacked into one Experts. Shapes never depend on
    the routing (one graph, no host sync), so the experts run one of two ways, whichever reads
    fewer weights: `gathered` reads each token's k experts (a decode step), `dense` runs all E on
    every token and zeroes the unchosen (a verify or a prefill, whose tokens hit nearly every
    expert anyway)."""

    def __init__(self, config: ModelArgs):
        super().__init__()
        E, D, I = config.num_experts, config.dim, config.intermediate_size
        self.num_experts, self.top_k = E, config.num_activated_experts
        self.gate = nn.Linear(D, E, bias=False)
        self.w1, self.w3, self.w2 = Experts(E, D, I), Experts(E, D, I), Experts(E, I, D)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]: the tokens of all rows
        # Mixtral's routing: softmax over all experts in float32, keep the top k, renormalise them.
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        if x.size(0) * self.top_k < self.num_experts:
            return self.gathered(x, experts, weights).view(shape)
        return self.dense(x, experts, weights).view(shape)

    def gathered(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """x [N, D], experts and weights [N, k] -> [N, D], reading each token's k experts."""
        x = x[:, None].expand(-1, self.top_k, -1)  # [N, k, D]
        h = F.silu(self.w1.gathered(x, experts)) * self.w3.gathered(x, experts)
        return torch.einsum("nkd,nk->nd", self.w2.gathered(h, experts), weights)

    def dense(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """x [N, D], experts and weights [N, k] -> [N, D], running all E experts on all tokens."""
        routing = torch.zeros(x.size(0), self.num_experts, dtype=x.dtype, device=x.device)
        routing = routing.scatter(1, experts, weights)  # [N, E]
        x = x.expand(self.num_experts, -1, -1)  # [E, N, D]
        h = F.silu(self.w1.dense(x)) * self.w3.dense(x)
        return torch.einsum("end,ne->nd", self.w2.dense(h), routing)


class Experts(nn.Module):
    """E bias-free linear maps of one shape, weight [E, out, in]: the mixture-of-experts analogue of
    nn.Linear, and like it a module of its own so that quantize.py can swap it for an int8 one."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        nn.init.uniform_(self.weight, -in_features ** -0.5, in_features ** -0.5)  # nn.Linear's default

    def gathered(self, x: Tensor, experts: Tensor) -> Tensor:
        """x [N, k, in]: each token's input to each of its experts, experts [N, k] -> [N, k, out]."""
        return torch.einsum("nki,nkoi->nko", x, self.weight[experts])

    def dense(self, x: Tensor) -> Tensor:
        """x [E, N, in]: every token's input to every expert -> [E, N, out]."""
        return torch.einsum("eni,eoi->eno", x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 as the reference implementations do, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def precompute_rope(seq_len: int, head_dim: int, base: float, scaling: Optional[dict] = None):
    """cos/sin tables [seq_len, head_dim] in float32, rotate-half layout (both halves repeat)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = _llama31_scale(inv_freq, **scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _llama31_scale(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """LLaMA-3.1 RoPE scaling: long wavelengths are slowed by `factor`, short ones kept,
    and the band in between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D] in float32. Rotate-half convention (Hugging Face layout)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).type_as(x)
