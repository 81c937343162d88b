"""Batch-invariant mode: every token's logits come out bit for bit the same from a one-token decode
step and from a verify of any tree, so that greedy speculative output equals plain decoding's in
bfloat16 and float16 too (docs/batch_invariance.md). enable(model) applies it from outside:

    attention    each query attends over a layout fixed by its position alone (WindowMask): old
                 cache slots in place, the W + 1 recent positions gathered in order. On a CPU via
                 ATen's flash kernel (invariant_attention); on CUDA via gpu_kernels/invariant.py.
    linears      compiled on a CPU, Inductor's C++ GEMM templates only or, where cpu.onednn_gemms,
                 oneDNN's with one-token steps run as two tokens (step_as_two); quantized layers via
                 quantize.set_row_invariant; on CUDA, gpu_kernels/invariant.py's (use_invariant_kernels).
    torch's      GEMMs (eager, or oneDNN's compiled) keep rows invariant only up to a row count that
                 depends on the CPU and shape: gemm_invariant_rows asks them, larger trees are refused.

A prefill keeps the usual kernels: plain and speculative decoding prefill with the same code and
shapes, so its rows need equal no other's.
"""
import functools
import types
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

import compiling
from attention import LIVE_BLOCK, live_slots
from cpu import PackedLinear, onednn_gemms
from model import FeedForward, RMSNorm, Transformer, TransformerBlock, TreeMask
from quantize import WeightOnlyInt4Linear, WeightOnlyInt8Linear, set_row_invariant

try:  # the CUDA kernels need Triton; without it the mode runs on CPUs only
    from gpu_kernels import invariant as cuda_kernels
except (ImportError, AttributeError) as e:
    cuda_kernels, CUDA_KERNELS_MISSING = None, f"{type(e).__name__}: {e}"

# The recent positions each query gathers in order: it bounds a verified tree's depth (with lookup's
# chain), and each step gathers this many keys more than it would otherwise.
WINDOW = 32
# ATen's CPU flash-attention kernel computes query rows in blocks and gives a row the same bits
# whatever shares its block, except where a block's size sends its matmuls down another path. Which
# sizes do depends on dtype, head dim, CPU and torch build, so flash_rows asks the kernel per shape.
FLASH_BLOCK = 32
# Over fewer keys than one key block it can round bf16 rows of large calls apart for every row
# count, so the mode's cache on a CPU is never shorter than this.
MIN_SLOTS = 512
# The recent part's softmax rows span a multiple of this many columns (its KV head's G old keys, the
# W + 1 recent ones, padding): whole vectors of ATen's elementwise loops, so that eager as compiled,
# no row's exp falls in a loop's scalar tail.
KEYS_ROW = 32
# The most rows gemm_invariant_rows tries (compiled, tests/test_invariant.py checks as many).
ROWS_PROBED = 64


def enable(model: Transformer, window: int = WINDOW) -> Transformer:
    """Put the target in batch-invariant mode, in place; a forward pre-hook turns the masks of steps
    and verifies into WindowMasks. model.invariant_window marks the mode (a Speculator checks its
    trees' depth against it; compiling.py compiles in the mode's settings)."""
    if model.config.sliding_window is not None:
        raise ValueError("batch-invariant attention does not support a sliding window")
    cuda = model.tok_embeddings.weight.is_cuda
    if cuda and cuda_kernels is None:
        raise ValueError(f"batch-invariant mode on CUDA needs Triton: {CUDA_KERNELS_MISSING}")
    first = getattr(model, "invariant_window", None) is None
    model.invariant_window = window
    torch.compiler.assume_constant_result(flash_rows)  # dynamo asks it while tracing: a constant
    if not first:
        return model
    if not cuda:  # the cache never shorter than MIN_SLOTS (a cache set up before grows now)
        model.setup_caches = types.MethodType(_setup_caches_of_min_slots, model)  # (a deepcopy rebinds it)
        if model.max_seq_length > 0:
            model.setup_caches(model.max_batch_size, model.max_seq_length)
    for layer in model.layers:
        layer.attention.attend = functools.partial(_mode_attention, layer.attention.attend)
    model.register_forward_pre_hook(_window_masks, with_kwargs=True)
    model.register_forward_hook(_after_prefill, always_call=True)  # an exception inside too
    set_row_invariant(model)
    if cuda:
        use_invariant_kernels(model)
    elif onednn_gemms(model.tok_embeddings.weight.dtype):
        model.forward = types.MethodType(step_as_two, model)  # (a deepcopy rebinds it)
    return model


def step_as_two(model: Transformer, idx: Tensor, input_pos: Tensor, cache_pos=None, mask=None, **kwargs):
    """The target's forward in the mode where its GEMMs run on oneDNN, which can round a one-row call
    apart from calls of 2 or more rows, which agree (gemm_invariant_rows finds it): a one-token step runs
    as two copies of its token at its position (both write the same cache entry) and keeps the first.
    So a step is a two-node verify, and compiled, its graph fuses what a verify's does."""
    if idx.size(1) != 1 or not isinstance(mask, WindowMask):  # (_window_masks gives a step its WindowMask)
        return Transformer.forward(model, idx, input_pos, cache_pos, mask, **kwargs)
    def two(t):
        return t.expand(t.size(0), 2, *t.shape[2:])
    out = Transformer.forward(model, two(idx), two(input_pos), two(cache_pos), WindowMask(*map(two, mask)), **kwargs)
    return pytree.tree_map(lambda t: t[:, :1], out)


def _setup_caches_of_min_slots(model: Transformer, max_batch_size: int, max_seq_length: int):
    Transformer.setup_caches(model, max_batch_size, max(max_seq_length, MIN_SLOTS))


def _mode_attention(usual, q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """A WindowMask through the mode's attention; any other (a prefill's) through the usual kernel."""
    if isinstance(mask, WindowMask):
        return cuda_kernels.window_attention(q, k, v, mask) if q.is_cuda else invariant_attention(q, k, v, mask)
    return usual(q, k, v, mask)


def _window_masks(model: Transformer, args: tuple, kwargs: dict):
    """Forward pre-hook: a one-token step or a verify (TreeMask) gets its WindowMask. An eager prefill
    runs its quantized layers outside the mode (_after_prefill restores them): no rows need equal it."""
    idx, input_pos, *rest = args
    cache_pos = rest.pop(0) if rest else kwargs.pop("cache_pos", None)
    mask = rest.pop(0) if rest else kwargs.pop("mask", None)
    B, T = idx.shape
    if T == 1 or isinstance(mask, TreeMask):
        input_pos = input_pos.expand(B, T)
        cache_pos = input_pos if cache_pos is None else cache_pos.expand(B, T)
        mask = window_mask(mask, input_pos, cache_pos, model.max_seq_length, model.invariant_window)
        kwargs["kv_len"] = None
    elif mask is None and not torch.compiler.is_compiling():
        set_row_invariant(model, False)
        model.in_prefill = True
    return (idx, input_pos, cache_pos, mask, *rest), kwargs


def _after_prefill(model: Transformer, args, output):
    if getattr(model, "in_prefill", False):
        set_row_invariant(model)
        model.in_prefill = False


def problem(device: str, dtype: str, compile: bool, quantized: Optional[str], tensor_parallel: bool) -> Optional[str]:
    """Why the mode does not hold for this run, in one line, or None where it does (as the row tests
    in tests/test_model.py and tests/test_quantize.py show)."""
    if tensor_parallel:
        return "--batch_invariant is built for one process, not under torchrun"
    if device.startswith("cuda"):
        return None
    if device != "cpu":
        return f"--batch_invariant is built for a CPU or CUDA, not --device {device}"
    if quantized is not None and dtype != "bfloat16":
        return f"--batch_invariant with a quantized file is built for bfloat16, not {dtype}"
    if not compile and dtype != "bfloat16":
        return (f"--batch_invariant in {dtype} needs --compile (eager {dtype} GEMMs round a verify's rows apart "
                f"from a one-token step's); eager, use --dtype bfloat16")
    return None


def gemm_invariant_rows(model: nn.Module, most: int = ROWS_PROBED) -> int:
    """The most rows (up to most) every float linear of model computes with each row's bits those of a
    one-token step, eagerly, as the model holds them (PackedLinear) and steps (step_as_two). Smallest
    shape first, and only up to the answer so far, so that the costly LM head probe stops early."""
    as_two = getattr(model.forward, "__func__", None) is step_as_two
    shapes = sorted({(m.weight.dtype, m.out_features, m.in_features, type(m) is PackedLinear)
                     for m in model.modules() if type(m) in (nn.Linear, PackedLinear) and m.weight.is_floating_point()
                     and m.weight.device.type == "cpu"},
                    key=lambda shape: (shape[1] * shape[2], str(shape[0]), shape[3]))
    rows = min(most, ROWS_PROBED)
    for dtype, out_features, in_features, packed in shapes:
        rows = _linear_rows(dtype, out_features, in_features, most=rows, packed=packed, as_two=as_two,
                            threads=torch.get_num_threads())
    return rows


def check_tree(model: nn.Module, nodes: int, compiled: bool):
    """A one-line ValueError where model is in the mode, torch's GEMMs run its verifies (eager, or
    compiled where compiling.gemms_on_onednn), and they give a verify of `nodes` rows (tree tokens +
    lookup) other bits than one-token steps; nodes=2 (a root and one guess) asks whether any tree fits."""
    if getattr(model, "invariant_window", None) is None or compiled and not compiling.gemms_on_onednn((model,)):
        return
    rows, fix = gemm_invariant_rows(model, most=nodes), "" if compiled else "compile, or "
    if nodes > rows:
        raise ValueError(f"--batch_invariant: this CPU's GEMMs round a verify's rows apart from one-token steps "
                         + (f"for every tree: {fix}speculate without --batch_invariant" if rows < 2 else
                            f"in trees of over {rows} nodes (tree tokens + lookup), this one has {nodes}: "
                            f"{fix}pass a smaller --tree / --lookup"))


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _linear_rows(dtype: torch.dtype, out_features: int, in_features: int, most: int = ROWS_PROBED, *,
                 packed: bool = False, as_two: bool = False, threads: int) -> int:
    """The largest m <= most such that calls of 1 .. m rows give every row the bits it gets alone, each
    count tried on many rows of seeded data (a path that rounds apart may touch only a few rows); as_two:
    alone is a call of the row twice (step_as_two). threads is a cache key only: the thread split can
    decide rounding."""
    if most <= 1:
        return most
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, dtype=dtype)
    linear.weight.copy_(torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
    if packed:
        linear = PackedLinear(linear)
    x = torch.randn(max(ROWS_PROBED, -(-65536 // out_features)), in_features, generator=g).to(dtype)
    alone = torch.cat([linear(row.repeat(2, 1))[:1] if as_two else linear(row) for row in x.split(1)])
    for m in range(2, most + 1):
        if not torch.equal(torch.cat([linear(rows) for rows in x.split(m)]), alone):
            return m - 1
    return most


# Attention over a layout fixed by each query's position.
class WindowMask(NamedTuple):
    """The mask of batch-invariant attention (W = the model's invariant_window): the query at position
    p sees two parts whose layout depends on p only, never on how many queries come together or
    where a tree put their ancestors.
        old     cache slots < old_end[b, t] = p - W (committed text: slot = position), in place
        recent  the W + 1 positions p - W .. p, gathered from wherever they sit into that order
                (recent_slots[b, t, j], valid where recent_ok: positions below 0 are not)"""
    old_end: Tensor       # [B, T] long
    recent_slots: Tensor  # [B, T, W + 1] long
    recent_ok: Tensor     # [B, T, W + 1] bool


def window_mask(mask, input_pos: Tensor, cache_pos: Tensor, cache_len: int, window: int) -> WindowMask:
    """The WindowMask of a one-token step (mask None) or a verify (TreeMask). A tree's positions past
    the prefix are its ancestors, found by depth (nodes seen, less one), so numbering does not matter."""
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


def flash_rows(dtype: torch.dtype, head_dim: int, keys: int, rows: int,
               bias_dtype: Optional[torch.dtype] = None) -> int:
    """_flash_rows_probe's answer; dynamo keeps it as a graph constant (assume_constant_result)."""
    return _flash_rows_probe(dtype, head_dim, keys, rows, bias_dtype or dtype, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
@torch.no_grad()
def _flash_rows_probe(dtype: torch.dtype, head_dim: int, keys: int, rows: int, bias_dtype: torch.dtype,
                      threads: int) -> int:
    """The fewest rows >= rows for which ATen's CPU flash kernel over `keys` keys computes every row
    as a lone FLASH_BLOCK call does with the row elsewhere in its block (output and log-sum-exp, on
    many rows of seeded data). Padding every call to this count makes a row's result independent of
    how many rows come with it. threads: a cache key only, as for _linear_rows."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    g = torch.Generator().manual_seed(0)  # not the global generator: sampling must not see the probe
    heads = 64  # each head is a block of its own: 64 samples a call

    def call(q, k, v, bias):
        return op(q, k, v, attn_mask=bias, scale=head_dim ** -0.5)[:2]

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
                good &= torch.equal(out[:, :, b:b + r], ref_out[:, :, :r])
                good &= torch.equal(lse[:, :, b:b + r], ref_lse[:, :, :r])
        if good:
            return m
    raise RuntimeError(f"batch-invariant attention: ATen's CPU flash-attention kernel rounds {dtype} rows of head "
                       f"dim {head_dim} over {keys} keys apart for every row count from {rows} to "
                       f"{rows + 2 * FLASH_BLOCK - 1} in this torch build: run without --batch_invariant")


def _flash(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, slots: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """ATen's CPU flash kernel over q [B, KV, M, D] padded to flash_rows' count, with an additive bias;
    returns the output and the log-sum-exp [B, KV, M] (which F.scaled_dot_product_attention hides).
    slots: the cache's length where k, v are its first live_slots, which flash_rows probes."""
    M, D = q.size(2), q.size(3)
    pad = flash_rows(q.dtype, D, slots or k.size(2), M, bias.dtype) - M
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        F.pad(q, (0, 0, 0, pad)), k, v, attn_mask=F.pad(bias, (0, 0, 0, pad)), scale=D ** -0.5)
    return out[:, :, :M], lse[:, :, :M]


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, mask: WindowMask) -> Tensor:
    """Attention whose every query row is computed bit for bit the same however many rows come
    together and wherever a tree keeps their keys (usual attention is not: its matmuls round by row
    count, and a tree's keys sit in another order):
        old     slots below p - W in place: one call of ATen's CPU flash kernel whose rows are each
                KV head's (query head, query) pairs, each masked to its own old_end, padded as
                flash_rows says, over the slots below the latest old_end in whole blocks
                (attention.live_slots)
        recent  per query, the W + 1 positions p - W .. p gathered in order, in float32, plus one
                key per query head standing for its old part: score its log-sum-exp, value its
                output, so that one softmax merges the two. Elementwise and reductions over each
                row alone, of a length fixed by W (KEYS_ROW), whatever the rows' count.
    The merge is inside that softmax because merged outside it is not invariant compiled: Inductor
    picks a vector or a scalar exp loop by the shape of a tensor of rows, and they differ in the last bit.
    q [B, H, T, D]; k, v: the whole cache [B, KV, S, D]."""
    B, H, T, D = q.shape
    KV, S, W1 = k.size(1), k.size(2), mask.recent_slots.size(-1)
    G = H // KV
    neg_inf = float("-inf")
    n = live_slots(mask.old_end, S) if S > LIVE_BLOCK else S  # the old slots any query sees, in whole blocks
    hidden = torch.arange(n, device=q.device) >= mask.old_end[:, None, :, None]  # [B, 1, T, n]
    bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(hidden, neg_inf)
    bias = bias.expand(B, G, T, n).reshape(B, 1, G * T, n)  # rows (head g, query t) as q's below
    out_old, lse_old = _flash(q.reshape(B, KV, G * T, D), k[:, :, :n], v[:, :, :n], bias, S)
    # a query that sees no old slot gets output 0 and log-sum-exp 0 from the kernel: it must weigh 0
    lse_old = lse_old.view(B, KV, G, T).masked_fill(mask.old_end[:, None, None] <= 0, neg_inf)

    # The recent part in float32, one softmax per query row (KEYS_ROW): the G old keys (score: the
    # old call's log-sum-exp, row g's own only; value: its output), the W + 1 recent ones, padding.
    rows = torch.arange(B, device=q.device)[:, None, None]
    k_recent = k[rows, :, mask.recent_slots].permute(0, 1, 3, 2, 4).reshape(B * T, KV, 1, W1, D).float()
    v_recent = v[rows, :, mask.recent_slots].permute(0, 1, 3, 2, 4).reshape(B * T, KV, W1, D).float()
    v_old = out_old.view(B, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, KV, G, D).float()
    pad = -(G + W1) % KEYS_ROW
    q_rows = q.view(B, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, KV, G, 1, D).float()
    recent = (q_rows * k_recent).sum(-1) * D ** -0.5  # [B * T, KV, G, W + 1]
    recent = recent.masked_fill(~mask.recent_ok.reshape(B * T, 1, 1, W1), neg_inf)
    old = torch.where(torch.eye(G, dtype=torch.bool, device=q.device), lse_old.permute(0, 3, 1, 2)
                      .reshape(B * T, KV, G, 1), neg_inf)
    scores = torch.cat([old, recent, recent.new_full((B * T, KV, G, pad), neg_inf)], -1)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    values = torch.cat([v_old, v_recent, v_recent.new_zeros(B * T, KV, pad, D)], 2)
    out = (weights[..., None] * values[:, :, None]).sum(-2) / weights.sum(-1, keepdim=True)
    return out.to(q.dtype).view(B, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, H, T, D)


# On CUDA: the target's linears and norms on gpu_kernels/invariant.py's kernels.
class InvariantLinear(nn.Module):
    """A float, int8 or int4 linear through the invariant_linear kernel, on the layer's own tensors
    (tied weights stay tied); an int4 layer's weight here is its portable nibbles, not torch's packing."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        # the InvariantRMSNorm computed inside the kernel while FUSE_NORMS: a plain reference, not a
        # submodule, so that its weight keeps its one state-dict key in the block
        self.__dict__["norm"] = None
        self.in_features, self.out_features, self.bias = linear.in_features, linear.out_features, linear.bias
        self.groupsize = 0
        if isinstance(linear, WeightOnlyInt8Linear):
            self.register_buffer("weight", linear.weight)
            self.register_buffer("scales", linear.scales)
        elif isinstance(linear, WeightOnlyInt4Linear):
            nibbles = linear.weight if linear.packed_for is None else getattr(linear, "nibbles", None)
            if nibbles is None:
                raise ValueError(f"an int4 layer packed for {linear.packed_for} keeps no nibbles for the "
                                 "batch-invariant kernels: switch the mode on before quantize.pack_int4, or on CUDA")
            self.register_buffer("weight", nibbles)
            self.register_buffer("scales_and_zeros", linear.scales_and_zeros)
            self.groupsize = linear.groupsize
        else:
            self.weight, self.scales = linear.weight, None

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        fused = self.norm is not None and cuda_kernels.FUSE_NORMS
        norm_weight, eps = (self.norm.weight, self.norm.eps) if fused else (None, 0.0)
        if self.groupsize:  # int4: the nibbles may hold padding rows (to a multiple of 16), cut here
            y = cuda_kernels.invariant_linear(x2, self.weight, None, self.scales_and_zeros, self.groupsize,
                                              norm_weight, eps)[:, :self.out_features]
            y = y if self.bias is None else y + self.bias
        else:
            y = cuda_kernels.invariant_linear(x2, self.weight, self.bias, self.scales, 0, norm_weight, eps)
        return y.reshape(*x.shape[:-1], self.out_features)


class InvariantRMSNorm(nn.Module):
    """model.RMSNorm through the rms_norm kernel. A norm fused into the linears it feeds passes x on
    unchanged while FUSE_NORMS: they normalise it themselves."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.eps, self.weight = norm.eps, norm.weight
        self.fused_into_linears = False

    def forward(self, x: Tensor) -> Tensor:
        if self.fused_into_linears and cuda_kernels.FUSE_NORMS:
            return x
        return cuda_kernels.rms_norm(x.reshape(-1, x.size(-1)), self.weight, self.eps).view(x.shape)


def use_invariant_kernels(model: nn.Module) -> nn.Module:
    """Swap the target's linears and RMSNorms for InvariantLinear and InvariantRMSNorm in place (keys
    and tied weights unchanged), fusing each block's two norms into the linears they alone feed."""
    if model.config.num_experts:
        raise ValueError("batch-invariant mode on CUDA has no kernel for mixture-of-experts layers")
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear or isinstance(child, (WeightOnlyInt8Linear, WeightOnlyInt4Linear)):
                setattr(parent, name, InvariantLinear(child))
            elif isinstance(child, RMSNorm):
                setattr(parent, name, InvariantRMSNorm(child))
    for block in model.modules():
        if isinstance(block, TransformerBlock) and type(block.feed_forward) is FeedForward:
            for norm, linears in ((block.attention_norm, [block.attention.wqkv]),
                                  (block.ffn_norm, [block.feed_forward.w1, block.feed_forward.w3])):
                norm.fused_into_linears = True
                for linear in linears:
                    linear.__dict__["norm"] = norm
    return model
