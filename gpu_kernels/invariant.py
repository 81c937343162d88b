"""Batch-invariant kernels for CUDA: what --batch_invariant runs on a GPU.

A token's row of the logits must come out bit for bit the same from a one-token step and from a
verify (invariant.py). On CUDA, cuBLAS picks a GEMM kernel by the row count, and PyTorch's
reductions split a row differently as the row count changes. These kernels give every row one
launch configuration whatever the row count, so a row's reduction order depends on the row alone:

    invariant_linear   x @ w^T (+ bias): fixed blocks for every M, K walked in order; a narrow
                       layer's K in fixed ranges (by the weight's shape), added in range order.
                       w in x's dtype, int8 or int4, dequantized tile by tile inside the K loop
    rms_norm           one program per row
    window_attention   one program per query: the old part in fixed chunks from slot 0, folded in
                       chunk order, then the W + 1 recent positions in order (invariant.WindowMask)

Each is a torch custom op, so a compiled graph neither fuses into nor retiles it, and it launches
without a host sync (a CUDA graph captures it). Split-K and the chunks keep a latency-bound step
from leaving the GPU idle (benchmarks/RESULTS.md, "GPU"). On a CPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1 at import), as the tests do.
"""
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")

# The linear's one launch configuration per dtype size: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages). float32 runs on FMA units ("ieee", no TF32) with small tiles that do not spill.
LINEAR_CONFIG = {2: (32, 64, 64, 4, 3), 4: (16, 32, 32, 8, 2)}
# Split-K for narrow layers, which give a latency-bound step too few programs: a launch of fewer
# column blocks than this cuts K into ranges (by the weight's shape alone, never the row count) and
# a second launch adds their float32 sums in range order. 0: one pass over K.
LINEAR_SPLIT_PROGRAMS = 132
# Split-K in one launch: each range stores its sums and counts itself in on a per-tile counter; the
# tile's last range to arrive adds all ranges in order (the same bits as the second launch) and
# re-arms the counter. Correct by the GPU's memory model (a block barrier, an acquire-release atomic
# at GPU scope, sums read past L1), checked in the interpreter and the PTX; off until run on a GPU.
LINEAR_FOLD_SPLITS = False
FOLD_TILES = 4096  # counters a device keeps for it: a launch of more output tiles (a long prefill) takes two launches
# With FUSE_NORMS the linears a norm feeds compute their rows' RMS themselves (the same order for
# any M) and the norm launches nothing: two launches fewer a layer. The sums of squares are added in
# another order than rms_norm's, so the logits change in the last bits (verifies still equal steps).
# Read at every call; off until timed on a GPU.
FUSE_NORMS = False
ATTENTION_BLOCK_N = 64  # cache slots per block of window_attention's old part
ATTENTION_WARPS = 4
# Flash-decoding with a fixed chunk: the old part in chunks of this many slots from slot 0, one
# program each, folded in chunk order by a second launch. Chunks are fixed by slot numbers, so a
# query's sums do not depend on other queries. 0: one program walks the whole old part.
ATTENTION_CHUNK = 128


def _check_device(*tensors: Tensor) -> None:
    if not (all(t.is_cuda for t in tensors) or INTERPRETED):
        raise ValueError("the batch-invariant kernels run on CUDA tensors; to run them on the CPU, set "
                         "TRITON_INTERPRET=1 before invariant_kernels is imported")


# Linear.
def linear_config(dtype: torch.dtype) -> dict:
    """The launch constants of invariant_linear for inputs of dtype: the same for every row count."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"invariant_linear takes float16, bfloat16 or float32, got {dtype}")
    block_m, block_n, block_k, warps, stages = LINEAR_CONFIG[dtype.itemsize]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


@torch.library.custom_op("eagle_gpt_fast::invariant_linear", mutates_args=())
def invariant_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, scales: Optional[Tensor] = None,
                     groupsize: int = 0, norm_weight: Optional[Tensor] = None, norm_eps: float = 0.0) -> Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N], in x's dtype (fp32 sums); row i is the same bits for any
    M. The weight is one of
        x's dtype [N, K]                  scales None, groupsize 0
        int8 [N, K]                       scales [N]: y = (x @ q^T) * scales + bias
        uint8 [N, Kp / 2], int4 nibbles   scales = scales_and_zeros [Kp / groupsize, N, 2]
    dequantized inside the K loop. With norm_weight, x is first RMS-normalised as rms_norm would."""
    problem = _linear_problem(x, weight, bias, scales, groupsize, norm_weight)
    if problem:
        raise ValueError(f"invariant_linear wants {problem}")
    _check_device(x, weight)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    (M, K), N = x.shape, weight.size(0)
    quant = 0 if scales is None else 4 if groupsize else 8
    scales_arg = weight if scales is None else scales.contiguous()  # (weight: a pointer the kernel never reads)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    launch = linear_config(x.dtype)
    splits, k_per = linear_splits(N, K, launch)
    grid = (triton.cdiv(N, launch["BLOCK_N"]), triton.cdiv(M, launch["BLOCK_M"]))
    bias_arg = weight if bias is None else bias
    norm = dict(NORM=norm_weight is not None)
    norm_arg = weight if norm_weight is None else norm_weight
    if splits == 1:
        _linear_kernel[grid](x, weight, scales_arg, bias_arg, norm_arg, y, M, N, K, x.stride(0), weight.stride(0),
                             y.stride(0), norm_eps, HAS_BIAS=bias is not None, QUANT=quant, GROUP=max(groupsize, 1),
                             **norm, **launch)
        return y
    partial = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    fold = LINEAR_FOLD_SPLITS and grid[0] * grid[1] <= FOLD_TILES
    counts = tile_counters(x.device) if fold else partial  # (partial: a pointer the kernel never reads)
    _linear_partial_kernel[grid + (splits,)](x, weight, scales_arg, bias_arg, norm_arg, partial, y, counts, M, N, K,
                                             k_per, splits, x.stride(0), weight.stride(0), y.stride(0), norm_eps,
                                             FOLD=fold, HAS_BIAS=bias is not None, QUANT=quant,
                                             GROUP=max(groupsize, 1), **norm, **launch)
    if not fold:
        _split_sum_kernel[(M, triton.cdiv(N, SUM_BLOCK))](partial, scales_arg, bias_arg, y, M, N, y.stride(0), splits,
                                                          HAS_BIAS=bias is not None, SCALED=quant == 8, BLOCK=SUM_BLOCK)
    return y


def _linear_problem(x, weight, bias, scales, groupsize, norm_weight=None) -> Optional[str]:
    """What is wrong with invariant_linear's arguments, in words, or None."""
    got = (f"got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
           + ("" if bias is None else f", bias {tuple(bias.shape)} {bias.dtype}")
           + ("" if norm_weight is None else f", norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype}")
           + ("" if scales is None else f", scales {tuple(scales.shape)} {scales.dtype}, groupsize {groupsize}"))
    if x.dim() != 2 or weight.dim() != 2 or not x.is_floating_point():
        return f"x [M, K] and weight [N, ...] as matrices, x in floating point; {got}"
    N = weight.size(0)
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        return f"bias [N] in x's dtype; {got}"
    if norm_weight is not None and (norm_weight.shape != (x.size(1),) or norm_weight.dtype != x.dtype):
        return f"norm_weight [K] in x's dtype; {got}"
    if scales is None:
        if groupsize or weight.shape != (N, x.size(1)) or weight.dtype != x.dtype:
            return f"x [M, K] and weight [N, K] of one dtype (or int8/int4 weights with scales); {got}"
    elif groupsize == 0:
        if weight.dtype != torch.int8 or weight.size(1) != x.size(1) or scales.shape != (N,):
            return f"an int8 weight [N, K] with scales [N]; {got}"
    elif weight.dtype != torch.uint8 or groupsize <= 0 or scales.shape != (weight.size(1) * 2 // groupsize, N, 2) \
            or weight.size(1) * 2 % groupsize or not 0 <= weight.size(1) * 2 - x.size(1) < groupsize:
        return (f"int4 nibbles uint8 [N, Kp / 2] with scales_and_zeros [Kp / groupsize, N, 2], Kp = K padded to "
                f"a group; {got}")
    return None


SUM_BLOCK = 256  # columns per program of _split_sum_kernel


def linear_splits(N: int, K: int, launch: dict) -> tuple:
    """(ranges of K, columns in each) for an [N, K] weight: by shape only, the same for every M."""
    n_blocks, k_blocks = triton.cdiv(N, launch["BLOCK_N"]), triton.cdiv(K, launch["BLOCK_K"])
    if LINEAR_SPLIT_PROGRAMS <= 0 or n_blocks >= LINEAR_SPLIT_PROGRAMS:
        return 1, K
    k_per = triton.cdiv(k_blocks, min(k_blocks, triton.cdiv(LINEAR_SPLIT_PROGRAMS, n_blocks))) * launch["BLOCK_K"]
    return triton.cdiv(K, k_per), k_per


_TILE_COUNTERS = {}  # device -> int32 [FOLD_TILES], all zero between launches


def tile_counters(device: torch.device) -> Tensor:
    """The device's split-K tile counters, made once and never replaced (a captured CUDA graph keeps
    their address). Each launch leaves them at zero, so launches in one stream share them."""
    device = torch.device(device)
    if device not in _TILE_COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("invariant_linear's split-K counters are made on the first call, which must not be "
                               "inside a CUDA graph capture: run the model once before capturing it")
        _TILE_COUNTERS[device] = torch.zeros(FOLD_TILES, dtype=torch.int32, device=device)
    return _TILE_COUNTERS[device]


@invariant_linear.register_fake
def _(x, weight, bias=None, scales=None, groupsize=0, norm_weight=None, norm_eps=0.0):
    return x.new_empty(x.size(0), weight.size(0))


# QUANT: 0 weights in x's dtype, 8 int8 (S [N], on the float32 sums), 4 int4 (S [K / GROUP, N, 2]).
@triton.jit
def _linear_kernel(X, W, S, Bias, NW, Y, M, N, K, stride_xm, stride_wn, stride_ym, eps, HAS_BIAS: tl.constexpr,
                   QUANT: tl.constexpr, GROUP: tl.constexpr, NORM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_M rows times BLOCK_N output channels, K in BLOCK_K steps from 0 up. A row
    is computed the same in any row block and any grid: nothing here depends on M but the mask."""
    n_block, m_block = tl.program_id(0), tl.program_id(1)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _dot_k_range(X, W, S, NW, rows, cols, M, N, K, 0, K, stride_xm, stride_wn, eps, QUANT, GROUP, NORM,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    acc = _scale_and_bias(acc, S, Bias, cols[None, :], cols[None, :] < N, QUANT == 8, HAS_BIAS)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _dot_k_range(X, W, S, NW, rows, cols, M, N, K, k_lo, k_hi, stride_xm, stride_wn, eps, QUANT: tl.constexpr,
                 GROUP: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """x[rows, k_lo:k_hi] @ w[cols, k_lo:k_hi]^T in float32, K in BLOCK_K steps from k_lo up (int8
    weights unscaled). NORM: x's rows RMS-normalised over all of K and times NW first."""
    ks = tl.arange(0, BLOCK_K)
    if NORM:
        inv_rms = _inverse_rms(X, rows, M, K, stride_xm, eps, BLOCK_M, BLOCK_K)
    x_ptrs = X + rows[:, None] * stride_xm + (k_lo + ks[None, :])   # [BLOCK_M, BLOCK_K], moved along K
    w_ptrs = W + cols[None, :] * stride_wn + (k_lo + ks[:, None])   # [BLOCK_K, BLOCK_N]: w^T's block
    x_live, w_live = rows[:, None] < M, cols[None, :] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_left = k_hi - k0
        x = tl.load(x_ptrs, mask=x_live & (ks[None, :] < k_left), other=0.0)
        if NORM:  # rms_norm's roundings: normalised to x's dtype, then times the weight in float32
            normed = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype)
            nw = tl.load(NW + k0 + ks, mask=ks < k_left, other=0.0).to(tl.float32)
            x = (nw[None, :] * normed.to(tl.float32)).to(x.dtype)
        if QUANT == 4:
            w_t = _int4_tile(W, S, cols, k0 + ks, w_live & (ks[:, None] < k_left), N, stride_wn, GROUP).to(x.dtype)
        else:  # an int8 weight's cast to x's dtype is exact
            w_t = tl.load(w_ptrs, mask=w_live & (ks[:, None] < k_left), other=0.0).to(x.dtype)
        acc += tl.dot(x, w_t, input_precision="ieee")  # "ieee": no TF32 for float32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _inverse_rms(X, rows, M, K, stride_xm, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS(x[rows]) in float32, squares summed a tile at a time from k = 0 (the same for any M)."""
    ks = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + rows[:, None] * stride_xm + (k0 + ks[None, :]),
                    mask=(rows[:, None] < M) & (k0 + ks[None, :] < K), other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    return tl.rsqrt(squares / K + tl.cast(eps, tl.float32))


@triton.jit
def _int4_tile(W, S, cols, k, live, N, stride_wn, GROUP: tl.constexpr):
    """w^T[k, cols] of int4 nibbles (even column high) in float32: (q - 8) * scale + zero of k's group."""
    byte = tl.load(W + cols[None, :] * stride_wn + k[:, None] // 2, mask=live, other=0).to(tl.int32)
    q = (byte >> ((1 - k[:, None] % 2) * 4)) & 15
    sz = S + ((k[:, None] // GROUP) * N + cols[None, :]) * 2
    scale = tl.load(sz, mask=live, other=0.0).to(tl.float32)
    zero = tl.load(sz + 1, mask=live, other=0.0).to(tl.float32)
    return (q.to(tl.float32) - 8.0) * scale + zero


@triton.jit
def _linear_partial_kernel(X, W, S, Bias, NW, P, Y, Counts, M, N, K, K_PER, SPLITS, stride_xm, stride_wn, stride_ym,
                           eps, FOLD: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                           NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Split-K, first launch: program (n, m, s) sums K range s into P[s] in float32. FOLD: the tile's
    last range to arrive then adds the ranges into Y; otherwise _split_sum_kernel does."""
    n_block, m_block, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = s * K_PER
    acc = _dot_k_range(X, W, S, NW, rows, cols, M, N, K, k_lo, tl.minimum(K, k_lo + K_PER), stride_xm, stride_wn,
                       eps, QUANT, GROUP, NORM, BLOCK_M, BLOCK_N, BLOCK_K)
    live = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(P + (s.to(tl.int64) * M + rows[:, None]) * N + cols[None, :], acc, mask=live)
    if FOLD:
        # Every thread's stores are issued before the count that publishes them (the barrier), and
        # the count releases them to, and acquires them for, whichever program counts last.
        tl.debug_barrier()
        tile = m_block * tl.num_programs(0) + n_block
        arrived = tl.atomic_add(Counts + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            y = _add_ranges(P, S, Bias, rows[:, None].to(tl.int64), cols[None, :], live, cols[None, :] < N, M, N,
                            SPLITS, HAS_BIAS, QUANT == 8)
            tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=live)
            tl.store(Counts + tile, 0)  # re-armed for the next launch, which stream order puts after this one


@triton.jit
def _add_ranges(P, S, Bias, rows, cols, live, cols_live, M, N, SPLITS, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):
    """P[0] + P[1] + ... in that order, scaled and biased. Loads go to L2 (.cg): a range summed on
    another SM is not in this one's L1."""
    acc = tl.load(P + rows * N + cols, mask=live, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLITS):
        acc += tl.load(P + (s * M + rows) * N + cols, mask=live, other=0.0, cache_modifier=".cg")
    return _scale_and_bias(acc, S, Bias, cols, cols_live, SCALED, HAS_BIAS)


@triton.jit
def _scale_and_bias(acc, S, Bias, cols, cols_live, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The float32 sums acc times an int8 weight's scales S[cols] (SCALED), + Bias[cols]."""
    if SCALED:
        acc *= tl.load(S + cols, mask=cols_live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=cols_live, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _split_sum_kernel(P, S, Bias, Y, M, N, stride_ym, SPLITS, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Split-K, second launch: one row's BLOCK columns, the ranges added in order."""
    row = tl.program_id(0).to(tl.int64)  # rows on the grid's first axis: a prefill's M may pass 65,535
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = _add_ranges(P, S, Bias, row, cols, ok, ok, M, N, SPLITS, HAS_BIAS, SCALED)
    tl.store(Y + row * stride_ym + cols, acc.to(Y.dtype.element_ty), mask=ok)


# RMSNorm.
@torch.library.custom_op("eagle_gpt_fast::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """model.RMSNorm's arithmetic, one program per row: normalise in float32, cast, times weight."""
    if x.dim() != 2 or weight.shape != (x.size(1),):
        raise ValueError(f"rms_norm wants x [M, N] and weight [N], got {tuple(x.shape)}, {tuple(weight.shape)}")
    _check_device(x, weight)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_norm_kernel[(x.size(0),)](x, weight, y, x.size(1), x.stride(0), y.stride(0), eps,
                                   BLOCK=triton.next_power_of_2(x.size(1)))
    return y


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@triton.jit
def _rms_norm_kernel(X, W, Y, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    # eps in float32 as the eager norm adds it (a compiled graph passes a Python float as fp64)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / N + tl.cast(eps, tl.float32))).to(x.dtype)
    w = tl.load(W + cols, mask=ok, other=0.0)
    # as torch multiplies two 16-bit tensors: in float32, rounded once to the result's dtype
    tl.store(Y + row * stride_y + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


# Attention over a WindowMask.
def window_attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """invariant.invariant_attention's semantics on CUDA: q [B, H, T, D]; k, v the whole cache."""
    return _window_attention(q, k, v, mask.old_end, mask.recent_slots, mask.recent_ok)


@torch.library.custom_op("eagle_gpt_fast::window_attention", mutates_args=())
def _window_attention(q: Tensor, k: Tensor, v: Tensor, old_end: Tensor, recent_slots: Tensor,
                      recent_ok: Tensor) -> Tensor:
    B, H, T, D = q.shape
    KV = k.size(1)
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.size(3) != D or H % KV or \
            old_end.shape != (B, T) or recent_slots.dim() != 3 or recent_slots.shape[:2] != (B, T) or \
            recent_ok.shape != recent_slots.shape:
        raise ValueError(f"window_attention wants q [B, H, T, D], k and v [B, KV, S, D] (H a multiple of KV), "
                         f"old_end [B, T] and recent_slots/recent_ok [B, T, W + 1], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(old_end.shape)}, {tuple(recent_slots.shape)}")
    _check_device(q, k, v, old_end, recent_slots, recent_ok)
    k, v = [x if x.stride(-1) == 1 else x.contiguous() for x in (k, v)]
    q = q if q.stride(-1) == 1 else q.contiguous()
    recent_slots, recent_ok = recent_slots.contiguous(), recent_ok.contiguous()
    W1 = recent_slots.size(-1)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)  # handed back as [B, H, T, D], as tree_attention
    BLOCK_D = triton.next_power_of_2(D)
    chunk = ATTENTION_CHUNK
    if chunk % ATTENTION_BLOCK_N:
        raise ValueError(f"ATTENTION_CHUNK ({chunk}) must be a multiple of ATTENTION_BLOCK_N ({ATTENTION_BLOCK_N})")
    # chunked: one program per chunk of the whole cache (those past a query's old part fold nothing)
    n_chunks = triton.cdiv(k.size(2), chunk) if chunk else 1
    part_acc = torch.empty(B * T * H * n_chunks if chunk else 1, BLOCK_D, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(2, part_acc.size(0), dtype=torch.float32, device=q.device)
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *old_end.stride())
    if chunk:
        _window_chunk_kernel[(T, H, B * n_chunks)](
            q, k, v, old_end, part_acc, part_ml, *common, H // KV, T, H, n_chunks, part_acc.size(0), D ** -0.5,
            D=D, BLOCK_D=BLOCK_D, BLOCK_N=ATTENTION_BLOCK_N, CHUNK=chunk, num_warps=ATTENTION_WARPS)
    _window_attention_kernel[(T, H, B)](
        q, k, v, old_end, recent_slots, recent_ok, out, part_acc, part_ml,
        *common, recent_slots.stride(0), recent_slots.stride(1), out.stride(0), out.stride(2), out.stride(1),
        H // KV, W1, D ** -0.5, T, H, n_chunks, part_acc.size(0),
        D=D, BLOCK_D=BLOCK_D, BLOCK_N=ATTENTION_BLOCK_N, BLOCK_R=triton.next_power_of_2(W1), CHUNK=chunk,
        num_warps=ATTENTION_WARPS)
    return out.transpose(1, 2)


@_window_attention.register_fake
def _(q, k, v, old_end, recent_slots, recent_ok):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, K_base, V_base, stride_ks, stride_vs, slots, ok, d, d_ok, sm_scale):
    """One block of slots' float32 scores folded into the running max m_i, sum l_i and output acc."""
    kv_mask = ok[:, None] & d_ok[None, :]
    k = tl.load(K_base + slots[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.where(ok, tl.sum(k * q[None, :], axis=1) * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every block the kernel folds has a live slot
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new)
    v = tl.load(V_base + slots[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    return acc * alpha + tl.sum(p[:, None] * v, axis=0), m_new, l_i * alpha + tl.sum(p, axis=0)


@triton.jit
def _window_chunk_kernel(
    Q, K, V, OldEnd, PartAcc, PartML,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_eb, stride_et, G, T, H, NC, NP, sm_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    """Chunked, first launch: program (query, head, batch row x chunk c) folds chunk c's slots below
    old_end into a partial (acc, max, sum); a chunk past old_end's partial is never read."""
    t, h, bc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c = (bc // NC).to(tl.int64), bc % NC
    sm_scale = tl.cast(sm_scale, tl.float32)  # a compiled graph passes it as fp64 (tree_attention.py: why)
    old_end = tl.load(OldEnd + b * stride_eb + t * stride_et)
    lo = c * CHUNK
    kv = h // G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + t * stride_qt + d, mask=d_ok, other=0.0).to(tl.float32)
    K_base, V_base = K + b * stride_kb + kv * stride_kh, V + b * stride_vb + kv * stride_vh
    # a chunk at or past old_end folds nothing (its partial is never read): no branch around the loop
    acc, m_i, l_i = _fold_slots(q, K_base, V_base, stride_ks, stride_vs, lo, tl.minimum(old_end, lo + CHUNK),
                                d, d_ok, sm_scale, BLOCK_D, BLOCK_N)
    part = ((b * T + t) * H + h) * NC + c
    tl.store(PartAcc + part * BLOCK_D + d, acc)
    tl.store(PartML + part, m_i)
    tl.store(PartML + NP + part, l_i)


@triton.jit
def _fold_slots(q, K_base, V_base, stride_ks, stride_vs, lo, hi, d, d_ok, sm_scale,
                BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slots lo .. hi - 1 in BLOCK_N blocks from lo: (acc, running max, sum) of the online softmax."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m_i = tl.full([], float("-inf"), dtype=tl.float32)
    l_i = tl.full([], 0.0, dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, K_base, V_base, stride_ks, stride_vs, slots,
                                             slots < hi, d, d_ok, sm_scale)
    return acc, m_i, l_i


@triton.jit
def _window_attention_kernel(
    Q, K, V, OldEnd, Recent, RecentOk, Out, PartAcc, PartML,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_eb, stride_et, stride_rb, stride_rt, stride_ob, stride_oh, stride_ot,
    G, W1, sm_scale, T, H, NC, NP,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program per (query, head, batch row): the old part from slot 0 (or the chunks' partials in
    order), then the W + 1 recent positions in order; every step depends on the query's position only."""
    t, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    sm_scale = tl.cast(sm_scale, tl.float32)  # a compiled graph passes it as fp64 (tree_attention.py: why)
    kv = h // G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + h * stride_qh + t * stride_qt + d, mask=d_ok, other=0.0).to(tl.float32)
    K_base, V_base = K + b * stride_kb + kv * stride_kh, V + b * stride_vb + kv * stride_vh
    old_end = tl.load(OldEnd + b * stride_eb + t * stride_et)
    if CHUNK == 0:
        acc, m_i, l_i = _fold_slots(q, K_base, V_base, stride_ks, stride_vs, 0, old_end, d, d_ok, sm_scale,
                                    BLOCK_D, BLOCK_N)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        m_i = tl.full([], float("-inf"), dtype=tl.float32)
        l_i = tl.full([], 0.0, dtype=tl.float32)
        first = ((b * T + t) * H + h) * NC
        for c in range(0, tl.cdiv(old_end, CHUNK)):
            m_c = tl.load(PartML + first + c)
            m_new = tl.maximum(m_i, m_c)  # finite: every chunk folded here has a live slot
            alpha, beta = tl.exp(m_i - m_new), tl.exp(m_c - m_new)
            acc = acc * alpha + tl.load(PartAcc + (first + c) * BLOCK_D + d) * beta
            l_i = l_i * alpha + tl.load(PartML + NP + first + c) * beta
            m_i = m_new
    j = tl.arange(0, BLOCK_R)
    row = b * stride_rb + t * stride_rt
    ok = tl.load(RecentOk + row + j, mask=j < W1, other=0) != 0
    slots = tl.load(Recent + row + j, mask=ok, other=0)
    acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, K_base, V_base, stride_ks, stride_vs, slots, ok, d, d_ok,
                                         sm_scale)
    tl.store(Out + b * stride_ob + h * stride_oh + t * stride_ot + d, (acc / l_i).to(Out.dtype.element_ty), mask=d_ok)
