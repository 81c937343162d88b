"""Fused tree attention: a Triton kernel for the queries of a candidate tree, and its PyTorch reference.

Speculative decoding verifies T tree nodes (T <= 64 or so) in one forward. Each node attends to

    the prefix        cache slots 0 .. prefix_len[b] - 1, all visible, the same for every node
    the tree region   the last R slots of the cache, where the tree's own K/V were written; node i
                      sees the slots that visible[b, i] marks (its ancestors and itself)

and never to the slots in between. A dense [B, T, S] mask plus SDPA reads a mask as large as the
cache; this kernel reads prefix_len (a device tensor: the kernel loops up to it, the host never
looks, so one launch fits in the CUDA graph of a round) and the small [B, T, R] mask.

Layout of the work, one program per (batch row, KV head, block of query rows, prefix split):
  * GQA: the H // KV query heads that share a KV head are stacked as rows of one block, so a K/V
    block is read once for all of them (never a repeated K/V tensor). Row r of the stack is query
    head kv * G + r // T, tree node r % T.
  * online softmax over the program's share of the prefix in BLOCK_N-slot blocks, then over the
    region with the mask; fp32 accumulation whatever the input dtype.
  * split-K: with few programs (one KV head per row at batch 1 leaves most SMs idle) the prefix is
    cut into n_splits equal shares of prefix_len; each share writes a normalised partial output and
    its log-sum-exp, and a few torch ops merge them. n_splits comes from the shapes only.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from tree import tree_attention_mask

# triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when this module is
# imported: then the kernel runs in triton's interpreter (NumPy, any device), as the tests do on
# a CPU. Otherwise it is compiled and needs CUDA tensors.
INTERPRETED = bool(triton.knobs.runtime.interpret)

# Launch constants, chosen for Hopper (H100) and still to be tuned there. BLOCK_M = 64 rows and 4
# warps (one warpgroup) is the smallest tile of Hopper's wgmma; 64 slots per K/V block keeps a bf16
# K and V block at 16 KiB each for head_dim 128, so two pipeline stages fit in shared memory easily.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
# Split the prefix until about this many programs run (an H100 has 132 SMs), but give every split
# at least MIN_SPLIT_SLOTS cache slots: below that its fixed costs (loading q, writing a partial
# output, the merge) outweigh the parallelism it adds.
TARGET_PROGRAMS = 132
MIN_SPLIT_SLOTS = 512
MAX_SPLITS = 16


def reference(q: Tensor, k: Tensor, v: Tensor, prefix_len: Tensor, visible: Tensor) -> Tensor:
    """The kernel's semantics, by the book: the dense mask of tree.tree_attention_mask and SDPA."""
    mask = tree_attention_mask(visible, prefix_len, k.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.size(1) != k.size(1))


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_len: Tensor, visible: Tensor,
                   n_splits: Optional[int] = None) -> Tensor:
    """q [B, H, T, D]; k, v [B, KV, S, D] (the static cache, H a multiple of KV); prefix_len [B]
    integer; visible [B, T, R] bool over the last R slots of the cache. Returns [B, H, T, D] in q's
    dtype, softmax scale 1 / sqrt(D) as SDPA. A query that sees no slot at all gets zeros (as SDPA).
    n_splits: how many shares the prefix is cut into; default from the shapes (num_splits)."""
    _check(q, k, v, prefix_len, visible)
    B, H, T, D = q.shape
    KV, S, R = k.size(1), k.size(2), visible.size(-1)
    q, k, v = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
    rows = (H // KV) * T  # query rows that share one KV head
    block_m = min(64, _pow2_at_least(rows))
    m_blocks = -(-rows // block_m)
    if n_splits is None:
        n_splits = num_splits(B * KV * m_blocks, S - R)
    if n_splits < 1:
        raise ValueError(f"n_splits must be >= 1, got {n_splits}")
    # Outputs are [B, T, H, D] in memory and handed back as [B, H, T, D] views: the caller's
    # transpose(1, 2).reshape(B, T, H * D) is then free. With split-K the kernel writes each share's
    # normalised partial output in float32 and its log-sum-exp, merged below.
    out = torch.empty(n_splits, B, T, H, D, dtype=q.dtype if n_splits == 1 else torch.float32, device=q.device)
    lse = torch.empty(n_splits, B, T, H, dtype=torch.float32, device=q.device)
    visible = visible.view(torch.uint8)  # triton loads bytes; a bool is one byte
    _tree_attention_kernel[(B * KV, m_blocks, n_splits)](
        q, k, v, prefix_len, visible, out, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], prefix_len.stride(0), *visible.stride(),
        out.stride(0), out.stride(1), out.stride(3), out.stride(2),  # share, b, h, t
        lse.stride(0), lse.stride(1), lse.stride(3), lse.stride(2),
        KV, H // KV, T, S, R, D, D ** -0.5,
        N_SPLITS=n_splits, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=_pow2_at_least(D),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if n_splits == 1:
        return out[0].transpose(1, 2)
    # Merge: out = sum_j exp(lse_j - lse) * out_j with lse = log sum_j exp(lse_j). A query that saw
    # nothing has lse = -inf in every share and all-zero partials: keep its weights finite (zero).
    total = lse.logsumexp(0)
    weight = (lse - total.masked_fill(total == float("-inf"), 0.0)).exp()
    return (weight[..., None] * out).sum(0).to(q.dtype).transpose(1, 2)


def num_splits(programs: int, prefix_slots: int) -> int:
    """How many shares to cut the prefix into, from the shapes: enough to bring `programs` (one per
    batch row, KV head and query block) up to about TARGET_PROGRAMS, as long as every share of a
    full cache has MIN_SPLIT_SLOTS slots."""
    return max(1, min(TARGET_PROGRAMS // programs, prefix_slots // MIN_SPLIT_SLOTS, MAX_SPLITS))


def _pow2_at_least(n: int) -> int:
    """The smallest power of two >= n, and >= 16: tl.dot wants every dimension at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def _check(q, k, v, prefix_len, visible):
    """Clear errors for what would otherwise fail deep inside the launch, or silently read garbage."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"tree_attention wants q [B, H, T, D] and k, v [B, KV, S, D] of one shape, "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (B, H, T, D), (_, KV, S, _) = q.shape, k.shape
    if k.size(0) != B or k.size(3) != D or H % KV:
        raise ValueError(f"q {tuple(q.shape)} does not fit k/v {tuple(k.shape)}: the batch and head_dim must "
                         f"match and the {H} query heads must be a multiple of the {KV} KV heads")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"tree_attention wants q, k, v all float16, bfloat16 or float32, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if visible.dtype != torch.bool or visible.dim() != 3 or visible.shape[:2] != (B, T) or visible.size(2) > S:
        raise ValueError(f"visible must be a bool [B={B}, T={T}, R] mask over the last R <= {S} cache slots, "
                         f"got {visible.dtype} {tuple(visible.shape)}")
    if prefix_len.shape != (B,) or prefix_len.is_floating_point():
        raise ValueError(f"prefix_len must be an integer tensor [B={B}], "
                         f"got {prefix_len.dtype} {tuple(prefix_len.shape)}")
    if any(t.device != q.device for t in (k, v, prefix_len, visible)):
        raise ValueError("q, k, v, prefix_len and visible must be on one device")
    if not (q.is_cuda or INTERPRETED):
        raise ValueError(f"the Triton tree-attention kernel runs on CUDA tensors, got {q.device}; to run it "
                         f"on the CPU, set TRITON_INTERPRET=1 before tree_attention is imported")


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, slots, slot_ok, seen, d, d_ok, qk_scale):
    """One online-softmax step over a block of cache slots. seen [BLOCK_M, BLOCK_N] (or [1, BLOCK_N])
    says which (row, slot) pairs count; m_i is the running maximum in log2 units, l_i the running sum."""
    kv_mask = slot_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + slots[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # "ieee": no TF32 for float32 inputs
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    v = tl.load(v_base + slots[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, alpha * l_i + tl.sum(p, 1)


@triton.jit
def _tree_attention_kernel(
    Q, K, V, PrefixLen, Visible, Out, Lse,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_p, stride_mb, stride_mt, stride_mr,
    stride_os, stride_ob, stride_oh, stride_ot, stride_ls, stride_lb, stride_lh, stride_lt,
    KV, G, T, S, R, D, sm_scale,
    N_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bkv, m_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv = (bkv // KV).to(tl.int64), bkv % KV  # int64: b * stride_kb passes 2**31 for large caches
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # stacked (query head in the group, tree node)
    row_ok = rows < G * T
    head, node = kv * G + rows // T, rows % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + node[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base, v_base = K + b * stride_kb + kv * stride_kh, V + b * stride_vb + kv * stride_vh
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # This split's share of the prefix: equal shares of prefix_len, whole blocks each. The prefix
    # never reaches into the region (a prefix_len beyond it is clamped, as in the dense mask).
    prefix_end = tl.minimum(tl.load(PrefixLen + b * stride_p).to(tl.int32), S - R)
    share = tl.cdiv(tl.cdiv(prefix_end, N_SPLITS), BLOCK_N) * BLOCK_N
    start = split * share
    end = tl.minimum(start + share, prefix_end)
    for n0 in range(start, end, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        slot_ok = slots < end
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, slots, slot_ok,
                                slot_ok[None, :], d, d_ok, qk_scale)

    # The tree region, masked, in the last split (a few dozen slots: one or two blocks).
    if split == N_SPLITS - 1:
        for r0 in range(0, R, BLOCK_N):
            cols = r0 + tl.arange(0, BLOCK_N)
            col_ok = cols < R
            seen = tl.load(Visible + b * stride_mb + node[:, None] * stride_mt + cols[None, :] * stride_mr,
                           mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, S - R + cols, col_ok,
                                    seen, d, d_ok, qk_scale)

    # Normalise; a row that saw nothing (l = 0, m = -inf) gets zeros and lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = (Out + split * stride_os + b * stride_ob + head[:, None] * stride_oh + node[:, None] * stride_ot
              + d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # back to natural log
    tl.store(Lse + split * stride_ls + b * stride_lb + head * stride_lh + node * stride_lt, lse, mask=row_ok)
