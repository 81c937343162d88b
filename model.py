"""A LLaMA-family decoder (LLaMA-2/3/3.1, Vicuna, Mistral, Mixtral, Qwen2, SmolLM2) with a static KV cache.

One file, read top to bottom: config, KV cache, transformer, attention, feed-forward (dense or
mixture of experts), RoPE.

The forward pass takes three things that plain decoding conflates, separately:

    input_pos  [B, T]  the RoPE position of each token
    cache_pos  [B, T]  the KV-cache slot each token's K/V is written to
    mask       [B, T, S] which of the S cache slots each token attends to (or a TreeMask)

For prefill and one-token decode they coincide (slot = position, causal mask). Tree verification
is why they are separate: a tree of T candidate tokens sits in T fixed slots at the end of the
cache (its tree region), but its positions are prefix_len + depth and each node sees the prefix
and its own ancestors only. Positions and slots are per row of the batch, so rows may hold prefixes of
different lengths (batched speculative decoding).

Weights are laid out as in Hugging Face checkpoints: q/k use the rotate-half RoPE convention.
"""
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# torch._dynamo skips a module named "tree" (it takes it for the dm-tree library): compile a forward
# that is given a TreeMask under torch._dynamo.dont_skip_tracing, as generate.compile_round does.
from tree import tree_attention_mask

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
        if name in transformer_configs:
            return cls(**transformer_configs[name])
        hits = [k for k in transformer_configs if k.lower() in name.lower()]
        if not hits:
            raise ValueError(
                f"unknown model name {name!r} and no {CONFIG_FILE} beside the checkpoint; "
                f"convert it with convert_hf_checkpoint.py or name its folder after one of: "
                f"{', '.join(sorted(transformer_configs))}"
            )
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
    # Tiny configs for tests: every feature switched on somewhere, sizes that run in milliseconds on a CPU.
    "tiny-llama": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                       vocab_size=512),
    "tiny-llama-3.1": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                           vocab_size=512, rope_base=500000.0,
                           rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=64)),
    "tiny-qwen2": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                       vocab_size=512, qkv_bias=True, tie_embeddings=True, norm_eps=1e-6),
    "tiny-mixtral": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                         vocab_size=512, rope_base=1000000.0, num_experts=4, num_activated_experts=2),
}
for _size in ("0.5B", "1.5B", "7B"):
    transformer_configs[f"Qwen2.5-Coder-{_size}"] = transformer_configs[f"Qwen2.5-{_size}"]
transformer_configs["Mixtral-8x7B-Instruct-v0.1"] = transformer_configs["Mixtral-8x7B-v0.1"]


class KVCache(nn.Module):
    """Keys and values of one layer in buffers of fixed shape [B, n_kv_heads, S, head_dim], allocated
    once, so decode steps have static shapes (CUDA graphs, no re-allocation). They are views of
    storage [2, B, n_kv_heads, S, head_dim]; a Transformer keeps all its layers' storage in one
    tensor (kv_storage), so that copy_slots moves entries in every layer at once."""

    def __init__(self, storage: Tensor):
        super().__init__()
        # detach(): unbind's views may not be written in place once grad mode is on (a forward
        # outside no_grad); indexing storage[0] would work too but cannot run on fake CUDA tensors.
        k_cache, v_cache = (t.detach() for t in storage.unbind())
        self.register_buffer("k_cache", k_cache, persistent=False)
        self.register_buffer("v_cache", v_cache, persistent=False)

    def update(self, cache_pos: Tensor, k: Tensor, v: Tensor):
        # cache_pos [B, T]; k, v [B, H, T, D]: row b's tokens go to row b's own slots. (Indexed
        # assignment rather than scatter_: the same on GPU, and 50x faster in bf16 on CPU.)
        rows = torch.arange(k.size(0), device=k.device)[:, None]
        self.k_cache[rows, :, cache_pos] = k.transpose(1, 2)
        self.v_cache[rows, :, cache_pos] = v.transpose(1, 2)
        return self.k_cache[:k.size(0)], self.v_cache[:k.size(0)]


def copy_slots(model: "Transformer", src: Tensor, dst: Tensor):
    """Copy row b's entries in slots src[b] to slots dst[b] (both [B, n]), keys and values of every
    layer. All reads happen before any write, so sources and destinations may overlap. Speculative
    decoding moves accepted tree nodes down to the end of the prefix with this.

    Eager, one gather and one scatter over model.kv_storage [n_layer, 2, B, H, S, D] move every
    layer at once, where a loop over the layers would launch four small kernels per layer (128
    for a 7B). Inside a compiled graph the copy goes through each layer's own cache views instead,
    and Inductor fuses the loop: a graph that mutated kv_storage as well as the views that overlap
    it would take them as aliased inputs, which AOTAutograd merges into one synthetic base; the
    inputs then lose their static marks (no CUDA graph), the whole storage is copied every call,
    and freezing maps parameters to the wrong inputs."""
    rows = torch.arange(src.size(0), device=src.device)[:, None]
    if not torch.compiler.is_compiling():
        model.kv_storage[:, :, rows, :, dst] = model.kv_storage[:, :, rows, :, src]
        return
    for layer in model.layers:
        cache = layer.attention.kv_cache
        k, v = cache.k_cache[rows, :, src], cache.v_cache[rows, :, src]
        cache.k_cache[rows, :, dst] = k
        cache.v_cache[rows, :, dst] = v


# Batch-invariant mode's window (Transformer.invariant_window): the recent positions each query
# gathers in order. It bounds the depth of a verified tree (tree depth + prompt lookup's chain: 11
# with the compiled CPU defaults, 16 with EAGLE-3's on a GPU); each decode step gathers this many
# keys more than it would read otherwise.
INVARIANT_WINDOW = 32
# Eager, the mode holds for verifies of at most eager_invariant_rows(model) tree nodes: the most
# rows for which torch's eager CPU GEMMs give each row a one-row call's bits, which depends on
# the CPU and the shape (torch 2.13, bf16, SmolLM2's shapes: 32 on a Xeon with AMX, not 48 or 64;
# 1 on an AMD EPYC without AMX, where the 1536 -> 576 down projection rounds ~10 % of the rows of
# any call of 2 or more apart from one-row calls, as F.linear and as a PackedLinear); compiled,
# the C++ GEMM templates do for 1 to 64 everywhere measured (tests/test_model.py).
EAGER_ROWS_PROBED = 64


def eager_invariant_rows(model: nn.Module, most: int = EAGER_ROWS_PROBED) -> int:
    """The most rows (up to most) that every floating-point linear of model computes, eagerly,
    with each row's bits those of a one-row call: _eager_linear_rows over its shapes, as the model
    holds them (an nn.Linear, or a PackedLinear: oneDNN's packed weights round by row count in
    shapes of their own), the smallest weights first, each probed only up to the answer so far (the
    LM head's probe, the costly one: ~12 s to 64 rows for SmolLM2's on a 2-core Zen 3, stops early
    where a small layer failed)."""
    shapes = sorted({(m.weight.dtype, m.out_features, m.in_features, type(m) is PackedLinear) for m in model.modules()
                     if type(m) in (nn.Linear, PackedLinear) and m.weight.is_floating_point()
                     and m.weight.device.type == "cpu"},
                    key=lambda shape: (shape[1] * shape[2], str(shape[0]), shape[3]))
    rows = min(most, EAGER_ROWS_PROBED)
    for dtype, out_features, in_features, packed in shapes:
        rows = _eager_linear_rows(dtype, out_features, in_features, most=rows, packed=packed,
                                  threads=torch.get_num_threads())
    return rows


@functools.lru_cache(maxsize=None)
def _eager_linear_rows(dtype: torch.dtype, out_features: int, in_features: int, most: int = EAGER_ROWS_PROBED, *,
                       packed: bool = False, threads: int) -> int:
    """The largest m <= most such that a linear (F.linear, or a PackedLinear if packed) in calls of
    1, 2, ..., m rows gives every row the bits it gets alone. Each count is tried on all of 64 or
    more rows of random data (a fixed seed, its own generator; at least 65,536 outputs): a path that
    rounds apart may touch only a few rows in ten (measured). threads: torch's thread count, a key
    of the cache only: how a kernel splits its work among threads can decide how it rounds, and a
    process may change the count (the test suite does)."""
    if most <= 1:
        return most
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
    if packed:
        linear = PackedLinear(linear)
    x = torch.randn(max(EAGER_ROWS_PROBED, -(-65536 // out_features)), in_features, generator=g).to(dtype)
    with torch.no_grad():
        alone = torch.cat([linear(row) for row in x.split(1)])
        for m in range(2, most + 1):
            if not torch.equal(torch.cat([linear(rows) for rows in x.split(m)]), alone):
                return m - 1
    return most


class WindowMask(NamedTuple):
    """The mask of batch-invariant attention (Transformer.invariant_window = W; window_mask builds
    it, for one-token steps and tree verifies): the query at position p sees two parts, kept apart
    so that their layout depends on p only, never on how many queries are computed together or
    where a tree put their ancestors.
        old     cache slots < old_end[b, t] = p - W (committed text: slot = position), in place
        recent  the W + 1 positions p - W .. p, gathered from wherever they sit into that order
                (recent_slots[b, t, j], valid where recent_ok: positions below 0 are not)"""
    old_end: Tensor       # [B, T] long
    recent_slots: Tensor  # [B, T, W + 1] long
    recent_ok: Tensor     # [B, T, W + 1] bool


class TreeMask(NamedTuple):
    """The mask of tree queries, compact. Query i of row b sees the prefix, slots < prefix_len[b],
    and those slots of the tree region, the last R = visible.size(-1) slots of the cache, that
    visible[b, i] marks; never the slots in between. Accepted wherever a dense [B, T, S] mask is:
    attention() hands it to the fused kernel (tree_attention.py) or materialises it for SDPA."""
    prefix_len: Tensor  # [B] long
    visible: Tensor     # [B, T, R] bool


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
        self.max_batch_size = -1
        self.max_seq_length = -1
        # Batch-invariant attention (WindowMask): None, or W, the window of recent positions every
        # query gathers in order; a verified tree must be at most W deep. Set by generate.py's
        # --batch_invariant.
        self.invariant_window: Optional[int] = None
        self.register_buffer("kv_storage", None, persistent=False)  # [n_layer, 2, B, KV, S, head_dim]: setup_caches

    def setup_caches(self, max_batch_size: int, max_seq_length: int):
        """Allocate the KV cache and the RoPE table once; later calls with the same sizes are free.
        Every layer's cache is a view of kv_storage (copy_slots moves entries in all of them at once).
        In batch-invariant mode on a CPU the cache holds at least INVARIANT_MIN_SLOTS slots."""
        if self.invariant_window is not None and self.norm.weight.device.type == "cpu":
            max_seq_length = max(max_seq_length, INVARIANT_MIN_SLOTS)
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            if not self._caches_are_views():  # .to() or .float() after setup copied each buffer apart
                for layer, storage in zip(self.layers, self.kv_storage):
                    layer.attention.kv_cache = KVCache(storage)
            return
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        c = self.config
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        kv_heads = self.layers[0].attention.n_local_heads  # this rank's share under tensor parallelism (tp.py)
        self.register_buffer("kv_storage", torch.zeros(c.n_layer, 2, max_batch_size, kv_heads, max_seq_length,
                                                       c.head_dim, dtype=dtype, device=device), persistent=False)
        for layer, storage in zip(self.layers, self.kv_storage):
            layer.attention.kv_cache = KVCache(storage)
        cos, sin = precompute_rope(max_seq_length, c.head_dim, c.rope_base, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def _caches_are_views(self) -> bool:
        first = self.layers[0].attention.kv_cache.k_cache
        return first.device == self.kv_storage.device and first.data_ptr() == self.kv_storage.data_ptr()

    def forward(self, idx: Tensor, input_pos: Tensor, cache_pos: Optional[Tensor] = None,
                mask=None, return_features: bool = False, layer_ids=(), kv_len: Optional[int] = None):
        """idx [B, T] token ids; input_pos [B, T] (or [T], shared by all rows) RoPE positions;
        cache_pos: slots to write, default = input_pos; mask [B, T, S] bool or a TreeMask, default
        causal by slot. kv_len: a host int promising that no query sees a slot >= kv_len, so that
        attention reads only the cache's first kv_len slots instead of all S. Eager on a CPU the
        default causal mask finds it itself (live_kv_len); compiled, the static S is kept.

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
        if kv_len is not None and (isinstance(mask, TreeMask) or not 0 < kv_len <= self.max_seq_length):
            raise ValueError(f"kv_len must be in [1, {self.max_seq_length}] and comes without a TreeMask, got {kv_len}")
        # Batch invariance is for the forwards whose rows decoding compares: a one-token step and a
        # verify (a TreeMask). A multi-token causal forward is a prefill, which plain and speculative
        # decoding share as it is (the same prompt, the same shapes, the same rounding): it keeps
        # the usual attention, many times faster than the window form over hundreds of rows.
        if self.invariant_window is not None and (T == 1 or isinstance(mask, TreeMask)):
            if self.config.sliding_window is not None:
                raise ValueError("batch-invariant attention does not support a sliding window")
            mask, kv_len = window_mask(mask, input_pos, cache_pos, self.max_seq_length, self.invariant_window), None
        elif kv_len is None and mask is None:
            kv_len = live_kv_len(cache_pos)
        slots = torch.arange(self.max_seq_length if kv_len is None else kv_len, device=idx.device)
        if mask is None:
            mask = slots <= cache_pos[..., None]
        elif kv_len is not None:
            mask = mask[..., :kv_len]
        if self.config.sliding_window is not None:
            if isinstance(mask, TreeMask):  # the fused kernel knows no window: the dense path
                mask = tree_attention_mask(mask.visible, mask.prefix_len, self.max_seq_length)
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
        logits = self.output(features)
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


class Attention(nn.Module):
    def __init__(self, config: ModelArgs, in_dim: Optional[int] = None):
        """in_dim: the width of the input that q, k and v are computed from; config.dim except in
        EAGLE-3's draft layer, which reads a token embedding and a feature side by side."""
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        # q, k and v in one matmul: one weight read per decode step instead of three.
        qkv_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(in_dim or config.dim, qkv_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None
        # Tensor parallelism (tp.py) gives this rank a share of the heads (n_head, n_local_heads
        # above become the local counts) and an all-reduce that sums the ranks' partial outputs.
        self.tp_reduce: Optional[Callable[[Tensor], Tensor]] = None

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
        y = self.wo(attention(q, k, v, mask).transpose(1, 2).reshape(B, T, q_size))
        return y if self.tp_reduce is None else self.tp_reduce(y)


# The attention backend, one switch for the process (generate.py sets it from --attention): while
# it is "triton" this holds the tree_attention module, whose fused kernel then serves every TreeMask
# on CUDA tensors (and on any device under TRITON_INTERPRET=1, as in the tests); otherwise None.
_tree_kernel = None


def set_attention_backend(backend: str, device="cuda") -> str:
    """"sdpa": SDPA over dense masks everywhere; "triton": the fused tree kernel for TreeMasks;
    "auto": triton when device is CUDA and tree_attention imports, else sdpa. Returns the backend chosen."""
    global _tree_kernel
    if backend not in ("auto", "sdpa", "triton"):
        raise ValueError(f"attention backend must be auto, sdpa or triton, got {backend!r}")
    _tree_kernel = None
    if backend == "sdpa" or (backend == "auto" and not str(device).startswith("cuda")):
        return "sdpa"
    try:
        import tree_attention
    except (ImportError, AttributeError) as e:  # AttributeError: a Triton too old for what the kernel uses
        if backend == "auto":
            print(f"--attention auto: the triton kernel is unavailable ({type(e).__name__}: {e}); using sdpa",
                  file=sys.stderr)
            return "sdpa"
        raise ValueError(f"the triton attention backend needs triton (Linux x86-64 with CUDA): {e}") from None
    _tree_kernel = tree_attention
    return "triton"


def live_kv_len(cache_pos: Tensor) -> Optional[int]:
    """For a causal mask, the slots past the newest one written are invisible. Eager on a CPU the
    host may read cache_pos for free (there is no device to wait for), so attention need not read
    the whole static cache; compiled or on a GPU, where that would be a graph break or a sync,
    None: all slots."""
    if cache_pos.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return int(cache_pos.max()) + 1


def attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """The one place where queries meet the cache. q [B, H, T, D]; k, v [B, KV, S, D] (GQA: H is a
    multiple of KV, never materialised); mask [B, T, S] bool or a TreeMask. Every attention call
    goes through here, so a fused kernel can replace it for all callers at once."""
    if isinstance(mask, WindowMask):
        if q.is_cuda:  # PyTorch's CUDA reductions split a row by the number of rows: the kernel does not
            from invariant_kernels import window_attention
            return window_attention(q, k, v, mask)
        return invariant_attention(q, k, v, mask)
    if isinstance(mask, TreeMask):
        if _tree_kernel is not None and (q.is_cuda or _tree_kernel.INTERPRETED):
            return _tree_kernel.tree_attention(q, k, v, mask.prefix_len, mask.visible)
        R, S = mask.visible.size(-1), k.size(2)
        if q.device.type == "cpu" and not torch.compiler.is_compiling():
            # Eager on a CPU, as in live_kv_len: read the live prefix and the tree region only.
            P = min(int(mask.prefix_len.max()), S - R)
            k, v = torch.cat([k[:, :, :P], k[:, :, S - R:]], dim=2), torch.cat([v[:, :, :P], v[:, :, S - R:]], dim=2)
            S = P + R
        mask = tree_attention_mask(mask.visible, mask.prefix_len, S)
    if (q.device.type == "cpu" and q.dtype != torch.float32 and not torch.compiler.is_compiling()
            and q.numel() // q.size(-1) * k.size(2) < MATMUL_ATTENTION_MAX_SCORES):
        return _matmul_attention(q, k, v, mask)
    # Compiled, SDPA stays ATen's flash-attention kernel for the CPU. The matmul form would not:
    # max-autotune gives its q @ k^T to the AMX GEMM template, which then repacks the whole K
    # cache into the template's layout on every call (measured: 154 us a layer, a third of a step).
    if q.device.type == "cpu" and q.shape[1] != k.shape[1]:
        return _grouped_sdpa(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.shape[1] != k.shape[1])


def _grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA with GQA on a CPU: the G = H // KV query heads that share a KV head are stacked as G * T
    query rows of one call per KV head, each row with its query's mask. ATen's CPU flash kernel
    with enable_gqa handles each query head apart and, in bf16/fp16, packs that head's K and V
    blocks again: a one-token bf16 step over 512 slots took 0.30 ms a layer that way and 0.06 ms
    stacked (SmolLM2-135M's 9 query and 3 KV heads, torch 2.13, AMD EPYC, 2 threads; half of a
    compiled decode step went to it). 12 query rows cost the same either way."""
    B, H, T, D = q.shape
    KV, S = k.size(1), k.size(2)
    G = H // KV
    rows = q.reshape(B, KV, G * T, D)  # query head h = kv * G + g reads KV head kv, as enable_gqa
    row_mask = mask[:, None, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)
    return F.scaled_dot_product_attention(rows, k, v, attn_mask=row_mask).view(B, H, T, D)


# Eager bf16/fp16 attention on a CPU: up to this many scores (B * H * T * S) the matmul form below
# is the faster one (one-token steps over long caches, verifies); past it, a prefill of hundreds of
# rows or a batch of them (EAGLE-3's teacher-forced features: 16 x 512 rows), SDPA's flash kernel
# is, because the matmul form writes and rereads every score in float32 (measured, torch 2.13, AMD
# EPYC: 16 x 300 rows 110 vs 38 ms a layer, 256 rows over 1,024 keys 18 vs 6.5 ms; alike near here).
MATMUL_ATTENTION_MAX_SCORES = 2 ** 21


def _matmul_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention as two matmuls and a float32 softmax, for bf16/fp16 in eager mode on CPU, where SDPA
    with a mask is up to 3x slower for few query rows (torch 2.13, AVX512: a step over 1,024 keys). The
    H // KV query heads that share a KV head are stacked as rows of one matmul, so K/V are not repeated."""
    B, H, T, D = q.shape
    KV = k.size(1)
    scores = (q.reshape(B, KV, H // KV * T, D) @ k.transpose(-1, -2)).float() * D ** -0.5
    scores = scores.view(B, KV, H // KV, T, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, KV, H // KV * T, -1)
    return (probs @ v).view(B, H, T, D)


def window_mask(mask, input_pos: Tensor, cache_pos: Tensor, cache_len: int, window: int) -> WindowMask:
    """The WindowMask of a forward whose mask is None (causal by slot: a one-token decode step) or a
    TreeMask (a verify: query i is node i of the tree region, at position prefix_len + its depth).
    A tree's positions past the prefix are its ancestors, found by depth (the number of nodes a
    node sees, less one), so node numbering does not matter."""
    steps = torch.arange(window + 1, device=input_pos.device)
    if mask is None:
        recent = cache_pos[..., None] - window + steps  # slots are positions in committed text
        return WindowMask(cache_pos - window, recent.clamp(0, cache_len - 1), recent >= 0)
    if not isinstance(mask, TreeMask):
        raise ValueError("batch-invariant attention takes a causal mask (None) or a TreeMask, not a dense mask")
    B, T, R = mask.visible.shape
    if T != R:
        raise ValueError(f"batch-invariant attention needs one query per tree node, got {T} queries for {R} nodes")
    depth = mask.visible.sum(-1) - 1  # [B, R]
    # ancestors[b, i, d]: node i's ancestor at depth d (a spare column W + 1 takes the rest)
    at = torch.where(mask.visible, depth[:, None, :], window + 1).clamp(max=window + 1)
    ancestors = torch.zeros(B, T, window + 2, dtype=torch.long, device=at.device)
    ancestors.scatter_(2, at, torch.arange(R, device=at.device).expand(B, T, R))
    positions = input_pos[..., None] - window + steps
    prefix_len = mask.prefix_len[:, None, None]
    in_tree = cache_len - R + ancestors.gather(2, (positions - prefix_len).clamp(0, window))
    recent = torch.where(positions < prefix_len, positions, in_tree)
    return WindowMask(input_pos - window, recent.clamp(0, cache_len - 1), positions >= 0)


# ATen's flash-attention kernel for the CPU computes a call's query rows in blocks of 32 (64 for
# calls of 192 rows or more) and gives a row the same bits whatever rows share its block, except
# where the block's size sends its matmuls down another path. Which sizes do depends on the dtype,
# the head dimension, the CPU and the torch build (measured, torch 2.13 on AMX: a last block of 1
# row in bf16, 2 in fp16, 1-2 in float32 with head_dim 64 and 1-5 with 128), so rather than keep a
# table, flash_rows asks the kernel once per shape which row count to pad a call to.
FLASH_BLOCK = 32
# ... and over fewer than 512 keys (one key block, of the cache's own length) it also rounds bf16
# rows of calls of 64 rows or more apart from a lone block's, in some lengths (measured: 65, 200,
# 300 apart; 64, 128, 256, 511 alike): no row count would do, so the mode's cache is never shorter.
INVARIANT_MIN_SLOTS = 512


def flash_rows(dtype: torch.dtype, head_dim: int, keys: int, rows: int,
               bias_dtype: Optional[torch.dtype] = None) -> int:
    """_flash_rows_probe's answer. Compiled, dynamo calls this while it traces and keeps the answer
    as a constant of the graph: speculative.compile_function marks it with
    torch.compiler.assume_constant_result (marked here, at import, it would import dynamo and
    Triton with every `import model`: a second more for every script)."""
    return _flash_rows_probe(dtype, head_dim, keys, rows, bias_dtype or dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _flash_rows_probe(dtype: torch.dtype, head_dim: int, keys: int, rows: int, bias_dtype: torch.dtype,
                      threads: int) -> int:
    """The fewest rows >= rows for which a call of ATen's CPU flash-attention kernel over `keys`
    keys computes every row bit for bit as a lone call of FLASH_BLOCK rows does with the row
    elsewhere in its block (each block of the call checked against one of its rows in reverse
    order; output and log-sum-exp; random data of a fixed seed; 2,048 rows or more in all: a path
    that rounds apart shows in 0.1-20 % of rows, measured). Padding every call to
    this count makes a row's result independent of how many rows come with it and where.
    threads: a key of the cache only, as for _eager_linear_rows."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    g = torch.Generator().manual_seed(0)  # not the global generator: sampling must not see the probe
    heads = 64  # each head is a block of its own: 64 samples a call

    def call(q, k, v, bias):
        return op(q, k, v, attn_mask=bias, scale=head_dim ** -0.5)[:2]

    with torch.no_grad():
        for m in range(rows, rows + 2 * FLASH_BLOCK):
            n = -(-m // FLASH_BLOCK) * FLASH_BLOCK
            good = True
            for _ in range(max(2, -(-2048 // (heads * m)))):
                q = torch.randn(1, heads, n, head_dim, generator=g).to(dtype)
                k, v = (torch.randn(1, heads, keys, head_dim, generator=g).to(dtype) for _ in range(2))
                ends = torch.randint(1, keys + 1, (n, 1), generator=g)  # each row sees its first `end` keys
                bias = torch.zeros(1, 1, n, keys, dtype=bias_dtype).masked_fill(torch.arange(keys) >= ends, float("-inf"))
                out, lse = call(q[:, :, :m], k, v, bias[:, :, :m])
                for b in range(0, m, FLASH_BLOCK):
                    block = torch.arange(b, b + FLASH_BLOCK).flip(0)
                    ref_out, ref_lse = (t.flip(2) for t in call(q[:, :, block], k, v, bias[:, :, block]))
                    r = min(FLASH_BLOCK, m - b)
                    good &= torch.equal(out[:, :, b:b + r], ref_out[:, :, :r]) and torch.equal(lse[:, :, b:b + r], ref_lse[:, :, :r])
            if good:
                return m
    raise RuntimeError(f"batch-invariant attention: ATen's CPU flash-attention kernel rounds {dtype} rows of head "
                       f"dim {head_dim} over {keys} keys apart for every row count from {rows} to "
                       f"{rows + 2 * FLASH_BLOCK - 1} in this torch build: run without --batch_invariant")


def _flash(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """ATen's CPU flash-attention kernel over the rows of q [B, KV, M, D], with zero rows padded up
    to flash_rows' count; bias [B, 1 or KV, M, S] additive, in q's dtype or float32. Returns the
    output [B, KV, M, D] and the log-sum-exp of the scaled scores [B, KV, M] (float32), which
    F.scaled_dot_product_attention does not return."""
    M, D = q.size(2), q.size(3)
    pad = flash_rows(q.dtype, D, k.size(2), M, bias.dtype) - M
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        F.pad(q, (0, 0, 0, pad)), k, v, attn_mask=F.pad(bias, (0, 0, 0, pad)), scale=D ** -0.5)
    return out[:, :, :M], lse[:, :, :M]


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, mask: WindowMask) -> Tensor:
    """Attention whose every query row is computed bit for bit the same however many rows come
    together and wherever a tree keeps their keys, over a layout fixed by the row's position alone,
    in two calls of ATen's CPU flash-attention kernel:
        old     every cache slot below p - W in place: one call for all queries, whose rows are the
                (query head, query) pairs of each KV head, each masked to its own old_end, padded
                to a row count whose blocks the kernel computes alike (flash_rows)
        recent  per query, a batch entry of H // KV rows a KV head over the W + 1 positions
                p - W .. p gathered in order (a tree keeps them wherever it put them), in float32,
                padded as above, and before them one key per query head that stands for its old part: key 0
                (score 0) with the old call's log-sum-exp as its bias and its output as the value,
                so the kernel's softmax weighs the old part as a merge through the two
                log-sum-exps would, for H // KV more keys of W + 1.
    The merge happens inside the kernel because merged outside, elementwise, it is not invariant
    compiled: Inductor computes exp in a vector loop or a scalar tail loop by the shape of the
    tensor (std::exp and Sleef's differ in the last bit), and for a merge over [KV, G, T] that
    choice depended on T (measured: float32 on an AMD EPYC, 121 of the 131 rows of calls of 1 to 32
    queries differed from one-query calls). Merged inside, it costs what the merge outside did
    (compiled bf16, SmolLM2's heads over 512 slots: 122 against 121 us a layer for one query, 261
    for 12 either way). (The usual attention over all T rows together is not invariant either: the
    kernel's matmuls round by row count, and a tree's keys sit in another order than the committed
    text's.) q [B, H, T, D]; k, v: the whole cache [B, KV, S, D]."""
    B, H, T, D = q.shape
    KV, S, W1 = k.size(1), k.size(2), mask.recent_slots.size(-1)
    G = H // KV
    neg_inf = float("-inf")
    hidden = torch.arange(S, device=q.device) >= mask.old_end[:, None, :, None]  # [B, 1, T, S]
    bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(hidden, neg_inf)
    bias = bias.expand(B, G, T, S).reshape(B, 1, G * T, S)  # rows (head g, query t) as q's below
    out_old, lse_old = _flash(q.reshape(B, KV, G * T, D), k, v, bias)
    # a query that sees no old slot gets output 0 and log-sum-exp 0 from the kernel: it must weigh 0
    lse_old = lse_old.view(B, KV, G, T).masked_fill(mask.old_end[:, None, None] <= 0, neg_inf)

    # The recent call in float32 whatever the model's dtype: a batch entry per query of a few rows by
    # W + 1 keys costs the kernel about the same per entry whatever its size, and its float32 path
    # less than its bf16/fp16 one. Measured on an AMD EPYC (Zen 4, no AMX), SmolLM2's 3 KV heads of
    # 3 rows by 36 keys: eager 28.0 against 17.5 us for 4 queries, 15.1 against 11.4 for 1; a
    # compiled 4-token round of the int4 file 0.29 ms faster, of a float16 model 0.87 ms
    # (benchmarks/README.md). With AMX, where bf16 matmuls are fast, not measured.
    rows = torch.arange(B, device=q.device)[:, None, None]
    k_recent = k[rows, :, mask.recent_slots].permute(0, 1, 3, 2, 4).reshape(B * T, KV, W1, D).float()
    v_recent = v[rows, :, mask.recent_slots].permute(0, 1, 3, 2, 4).reshape(B * T, KV, W1, D).float()
    v_old = out_old.view(B, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, KV, G, D).float()
    keys = torch.cat([k_recent.new_zeros(B * T, KV, G, D), k_recent], 2)
    values = torch.cat([v_old, v_recent], 2)
    # float32 bias: the old part's log-sum-exp enters unrounded; row g sees old key g only
    own = torch.eye(G, dtype=torch.bool, device=q.device)
    old_bias = torch.where(own, lse_old.permute(0, 3, 1, 2).reshape(B * T, KV, G, 1), neg_inf)
    recent_bias = torch.zeros((), device=q.device).masked_fill(~mask.recent_ok, neg_inf)
    recent_bias = recent_bias.view(B * T, 1, 1, W1).expand(B * T, KV, G, W1)
    q_rows = q.view(B, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, KV, G, D).float()
    out, _ = _flash(q_rows, keys, values, torch.cat([old_bias, recent_bias], -1))
    return out.to(q.dtype).view(B, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, H, T, D)


class PackedLinear(nn.Module):
    """nn.Linear with its bf16/fp16 weight reordered once into oneDNN's blocked layout, for eager
    decoding on a CPU: torch's eager bf16 matmul reorders the weight on every call, which costs
    about as much as the product itself (measured 1.5-2x slower for 1 to 64 rows on AVX512-BF16 /
    AMX). torch.compile with inductor's freezing does the same reordering itself, and cannot trace
    these opaque weights, so compiled runs keep plain nn.Linear (pack_linears is for eager runs)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def can_pack_linears(dtype: torch.dtype, device) -> bool:
    """Whether PackedLinear serves this dtype on this device: half precision on a CPU with oneDNN
    bf16/fp16 support (float32 keeps torch's own kernels: packing gains little there, and float32
    runs are the reference that speculative output is checked against)."""
    if str(device) != "cpu" or dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return False
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    return bool(getattr(torch.ops.mkldnn, supported, lambda: False)())


def pack_linears(module: nn.Module) -> int:
    """Replace every plain nn.Linear of module (a Transformer or a draft) by a PackedLinear, in place,
    when can_pack_linears says it pays; returns how many. A tied LM head is packed as its own copy
    (the embedding keeps the plain table). Quantized layers are left alone."""
    swapped = 0
    for name, m in list(module.named_modules()):
        if type(m) is nn.Linear and can_pack_linears(m.weight.dtype, m.weight.device):
            module.set_submodule(name, PackedLinear(m))
            swapped += 1
    return swapped


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 = gate_proj, w3 = up_proj, w2 = down_proj."""

    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)
        self.tp_reduce: Optional[Callable[[Tensor], Tensor]] = None  # tensor parallelism: as in Attention

    def forward(self, x: Tensor) -> Tensor:
        y = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return y if self.tp_reduce is None else self.tp_reduce(y)


class MoEFeedForward(nn.Module):
    """Mixtral's sparse mixture of experts: a router (gate) picks num_activated_experts (k) of the
    num_experts (E) SwiGLU experts for each token and mixes their outputs; w1, w3, w2 hold the
    experts' gate_proj, up_proj, down_proj, as in FeedForward, each stacked into one Experts.

    The experts run one of two ways, chosen from static shapes, so both are free of data-dependent
    shapes and host syncs and compile into the same single graph:
      gathered  index each token's k experts and apply them: reads N * k expert matrices for N
                tokens (a token reads its experts even when another token shares them: shapes
                cannot depend on which experts were chosen).
      dense     run every expert on every token and weight the outputs by the routing weights,
                zero except for each token's k experts: reads each expert once, at E / k times
                the useful arithmetic.
    At batch size 1 decoding is bound by reading weights, so the rule is: whichever reads fewer.
    A decode step (N = 1) gathers 2 of 8 experts; tree verification (N = 60 tokens, which hit
    nearly every expert anyway) and prefill run dense. For a long prefill that is 4x the FFN
    arithmetic, a one-off cost per prompt; grouping tokens by expert, as serving systems do,
    would need data-dependent shapes."""

    def __init__(self, config: ModelArgs):
        super().__init__()
        E, D, I = config.num_experts, config.dim, config.intermediate_size
        self.num_experts, self.top_k = E, config.num_activated_experts
        self.gate = nn.Linear(D, E, bias=False)
        self.w1, self.w3, self.w2 = Experts(E, D, I), Experts(E, D, I), Experts(E, I, D)
        self.tp_reduce: Optional[Callable[[Tensor], Tensor]] = None  # tensor parallelism: as in Attention

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]: the tokens of all rows
        # Mixtral's routing: softmax over all experts in float32, keep the top k, renormalise them.
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        if x.size(0) * self.top_k < self.num_experts:
            y = self.gathered(x, experts, weights).view(shape)
        else:
            y = self.dense(x, experts, weights).view(shape)
        return y if self.tp_reduce is None else self.tp_reduce(y)

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
