"""Fused tree attention: a Triton kernel for the queries of a candidate tree, and its PyTorch reference.

Speculative decoding verifies T tree nodes in one forward. Each node attends to

    the prefix        cache slots 0 .. prefix_len[b] - 1, all visible, the same for every node
    the tree region   the last R slots of the cache, where the tree's own K/V were written; node i
                      sees the slots that visible[b, i] marks (its ancestors and itself)

and never to the slots in between. Rather than a dense [B, T, S] mask as large as the cache, the
kernel reads prefix_len (a device tensor the host never looks at, so a launch fits in a round's CUDA
graph) and the small [B, T, R] mask.

One program per (block of query rows, prefix split, batch row and KV head):
  * GQA: the G = H // KV query heads sharing a KV head are stacked as rows of one block (row r:
    head kv * G + r // T, node r % T), so a K/V block is read once for all of them. Row blocks of
    one KV head and split launch side by side, so all but the first find their K/V blocks in L2.
  * online softmax over the program's share of the prefix, then over the region with the mask;
    fp32 accumulation whatever the input dtype.
  * split-K: with few programs the prefix is cut into up to n_splits shares (num_splits, from the
    launch), sized on the device from the live prefix but at least MIN_SPLIT_SLOTS each; empty
    shares read and write nothing. _merge_kernel combines the shares' partial outputs and lse.
"""
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from model import TreeMask

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel (at import): then the kernels run
# in its interpreter on any device, as the tests do on a CPU; otherwise they need CUDA tensors.
# Read from the environment, since older Tritons lack triton.knobs.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")

# Launch constants, read at every call (launch_config), so a tuning sweep can set them. 16-bit
# inputs: query blocks of 16 to MAX_BLOCK_M rows (tl.dot wants >= 16) and at most MAX_BLOCK_ELEMENTS
# query elements, one warp per ELEMENTS_PER_WARP, so the accumulator stays in registers; larger
# blocks spilled (tests/test_kernel_fit.py compiles every launch for the GPUs we target).
BLOCK_N = 64
MAX_BLOCK_M = 128
MAX_BLOCK_ELEMENTS = 64 * 128
ELEMENTS_PER_WARP = 1024
NUM_STAGES = 2  # K/V blocks in flight; launch_config takes fewer where shared memory is short
# float32 inputs get no tensor cores ("ieee": no TF32): tl.dot runs on FMA units with whole tiles in
# registers, so they take small tiles, which compile without spills.
FP32_MAX_BLOCK_M = 16
FP32_BLOCK_N = 32
FP32_NUM_WARPS = 8
# Split the prefix until about TARGET_PROGRAMS programs run (about one per SM), at most MAX_SPLITS
# ways, never into shares below MIN_SPLIT_SLOTS: there a share's fixed costs outweigh the parallelism.
TARGET_PROGRAMS = 132
MIN_SPLIT_SLOTS = 512
MAX_SPLITS = 16
MERGE_BLOCK_ROWS = 16  # (tree node, head) rows per program of the merge

# The opt-in shared memory per block by compute capability (CUDA C++ Programming Guide): what Triton
# checks a kernel against before launching it. A GPU's own figure is read at run time; the table
# serves tests/test_kernel_fit.py and a device that does not report it.
SHARED_MEMORY_PER_BLOCK = {(7, 0): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024,
                           (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
                           (12, 0): 99 * 1024}
INTERPRETER_CAPABILITY = (8, 6)  # the interpreter (no GPU) chooses as the tightest of the GPUs we target


def reference(q: Tensor, k: Tensor, v: Tensor, prefix_len: Tensor, visible: Tensor) -> Tensor:
    """The kernel's semantics, by the book: the dense mask of model.TreeMask and SDPA."""
    mask = TreeMask(prefix_len, visible).dense(k.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=q.size(1) != k.size(1))


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_len: Tensor, visible: Tensor,
                   n_splits: Optional[int] = None) -> Tensor:
    """q [B, H, T, D]; k, v [B, KV, S, D] (the static cache); prefix_len [B]; visible [B, T, R] over
    the last R slots. Returns [B, H, T, D] as SDPA would; a query that sees nothing gets zeros."""
    _check(q, k, v, prefix_len, visible)
    B, H, T, D = q.shape
    KV, S, R = k.size(1), k.size(2), visible.size(-1)
    q, k, v = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
    G = H // KV
    launch = launch_config(q.dtype, G * T, D, shared_memory_limit(q.device))
    block_m = launch["block_m"]
    m_blocks = -(-G * T // block_m)
    if n_splits is None:
        n_splits = num_splits(B * KV * m_blocks, S - R)
    if n_splits < 1:
        raise ValueError(f"n_splits must be >= 1, got {n_splits}")
    # Outputs are [B, T, H, D] in memory, handed back as [B, H, T, D] views: the caller's
    # transpose(1, 2).reshape(B, T, H * D) is then free. Split-K partials are float32.
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    if n_splits == 1:
        partial, lse = out[None], torch.empty(1, B, T, H, dtype=torch.float32, device=q.device)
    else:
        partial = torch.empty(n_splits, B, T, H, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(n_splits, B, T, H, dtype=torch.float32, device=q.device)
    split_consts = dict(N_SPLITS=n_splits, MIN_SHARE=MIN_SPLIT_SLOTS, BLOCK_N=launch["block_n"])
    _tree_attention_kernel[(m_blocks, n_splits, B * KV)](
        q, k, v, prefix_len, visible, partial, lse,  # visible goes as it is, bool (*i1): one byte each
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], prefix_len.stride(0), *visible.stride(),
        partial.stride(0), partial.stride(1), partial.stride(3), partial.stride(2),  # share, b, h, t
        lse.stride(0), lse.stride(1), lse.stride(3), lse.stride(2),
        KV, G, T, S, R, D ** -0.5,
        D=D, BLOCK_M=block_m, BLOCK_D=launch["block_d"], **split_consts,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    if n_splits > 1:
        rows = T * H  # partial, lse and out are contiguous: (node, head) rows of D values
        _merge_kernel[(triton.cdiv(rows, MERGE_BLOCK_ROWS), B)](
            partial, lse, prefix_len, out, partial.stride(0), partial.stride(1), lse.stride(0), lse.stride(1),
            prefix_len.stride(0), out.stride(0), rows, S, R,
            D=D, BLOCK_D=_pow2_at_least(D), BLOCK_R=MERGE_BLOCK_ROWS, **split_consts,
        )
    return out.transpose(1, 2)


def launch_config(dtype: torch.dtype, rows: int, head_dim: int, shared_limit: int) -> dict:
    """The launch constants for `rows` stacked query rows within shared_limit bytes: the module's
    constants, shrunk while shared_bytes says they might not fit. A pure function, so the
    ahead-of-time checks compile exactly what tree_attention() launches."""
    block_d = _pow2_at_least(head_dim)
    if dtype == torch.float32:
        block_m, block_n = min(FP32_MAX_BLOCK_M, _pow2_at_least(rows)), FP32_BLOCK_N
    else:
        block_m = min(MAX_BLOCK_M, max(16, MAX_BLOCK_ELEMENTS // block_d), _pow2_at_least(rows))
        block_n = BLOCK_N
    stages, elem = NUM_STAGES, dtype.itemsize
    while shared_bytes(block_m, block_n, block_d, stages, elem) > shared_limit:
        if block_n > 32:
            block_n //= 2
        elif stages > 1:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > 16:
            block_m //= 2
        else:
            raise ValueError(f"tree attention: no launch fits in {shared_limit} bytes of shared memory per block "
                             f"(head_dim {head_dim}, {dtype}); the smallest needs "
                             f"{shared_bytes(16, 16, block_d, 1, elem)}")
    warps = FP32_NUM_WARPS if dtype == torch.float32 else max(4, block_m * block_d // ELEMENTS_PER_WARP)
    return dict(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=warps, num_stages=stages)


def shared_bytes(block_m: int, block_n: int, block_d: int, stages: int, elem: int) -> int:
    """An upper bound on the kernel's shared memory (K/V stages, the query block, a float32 score
    tile); tests/test_kernel_fit.py holds it against what Triton's compiler reports."""
    return stages * 2 * block_n * block_d * elem + block_m * block_d * elem + block_m * block_n * 4


@torch.compiler.assume_constant_result
def shared_memory_limit(device: torch.device) -> int:
    """Shared memory one block may use on device; a constant to torch.compile (read at tracing)."""
    if device.type != "cuda":  # Triton's interpreter
        return SHARED_MEMORY_PER_BLOCK[INTERPRETER_CAPABILITY]
    props = torch.cuda.get_device_properties(device)
    return (getattr(props, "shared_memory_per_block_optin", 0)
            or SHARED_MEMORY_PER_BLOCK.get((props.major, props.minor)) or props.shared_memory_per_block)


def num_splits(programs: int, prefix_slots: int) -> int:
    """The most shares to cut the prefix into: enough to bring `programs` up to about TARGET_PROGRAMS,
    no more than a full cache fills. Which get work is decided on the device, from the live prefix."""
    return max(1, min(TARGET_PROGRAMS // programs, -(-prefix_slots // MIN_SPLIT_SLOTS), MAX_SPLITS))


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
def _prefix_share(PrefixLen, b, stride_p, S, R,
                  N_SPLITS: tl.constexpr, MIN_SHARE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(prefix_end, share): row b's live prefix, clamped short of the region as the dense mask does,
    and each split's share of it (at least MIN_SHARE, whole blocks). Both kernels use this."""
    prefix_end = tl.minimum(tl.load(PrefixLen + b * stride_p).to(tl.int32), S - R)
    share = tl.maximum(tl.cdiv(prefix_end, N_SPLITS), MIN_SHARE)
    return prefix_end, tl.cdiv(share, BLOCK_N) * BLOCK_N


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
    KV, G, T, S, R, sm_scale,
    D: tl.constexpr, N_SPLITS: tl.constexpr, MIN_SHARE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    m_block, split, bkv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv = (bkv // KV).to(tl.int64), bkv % KV  # int64: b * stride_kb passes 2**31 for large caches
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # stacked (query head in the group, tree node)
    row_ok = rows < G * T
    head, node = kv * G + rows // T, rows % T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D  # all true, and folded away, when D is a power of two
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + node[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base, v_base = K + b * stride_kb + kv * stride_kh, V + b * stride_vb + kv * stride_vh
    # float32 first: inside a torch.compile'd graph Inductor passes a Python float as fp64, which
    # would turn the accumulator fp64 (a compile error) and change the rounding of compiled launches
    qk_scale = tl.cast(sm_scale, tl.float32) * 1.4426950408889634  # exp(x) = exp2(x * log2(e))

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # This split's share of the live prefix (empty when the prefix is short: the loop does not run).
    prefix_end, share = _prefix_share(PrefixLen, b, stride_p, S, R, N_SPLITS, MIN_SHARE, BLOCK_N)
    start = split * share
    end = tl.minimum(start + share, prefix_end)
    for n0 in range(start, end, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        slot_ok = slots < end
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, slots, slot_ok,
                                slot_ok[None, :], d, d_ok, qk_scale)

    # The tree region, masked, in the last split (a few dozen slots: one or two blocks).
    last = split == N_SPLITS - 1
    if last:
        for r0 in range(0, R, BLOCK_N):
            cols = r0 + tl.arange(0, BLOCK_N)
            col_ok = cols < R
            seen = tl.load(Visible + b * stride_mb + node[:, None] * stride_mt + cols[None, :] * stride_mr,
                           mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, S - R + cols, col_ok,
                                    seen, d, d_ok, qk_scale)

    # Normalise; a row that saw nothing gets zeros and lse = -inf. An empty share stores nothing (the
    # merge never reads it). tl.where, since the interpreter rejects a mask of vector & scalar.
    store = tl.where((start < prefix_end) | last, row_ok, False)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = (Out + split * stride_os + b * stride_ob + head[:, None] * stride_oh + node[:, None] * stride_ot
              + d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=store[:, None] & d_ok[None, :])
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # back to natural log
    tl.store(Lse + split * stride_ls + b * stride_lb + head * stride_lh + node * stride_lt, lse, mask=store)


@triton.jit
def _merge_kernel(
    Partial, Lse, PrefixLen, Out, stride_ps, stride_pb, stride_ls, stride_lb, stride_p, stride_ob, ROWS, S, R,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    N_SPLITS: tl.constexpr, MIN_SHARE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out = sum_j exp(lse_j - lse) * out_j over the non-empty shares j, lse = log sum_j exp(lse_j);
    one program per BLOCK_R (node, head) rows of one batch row."""
    r_block, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    prefix_end, share = _prefix_share(PrefixLen, b, stride_p, S, R, N_SPLITS, MIN_SHARE, BLOCK_N)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for j in range(N_SPLITS):
        read = tl.where((j * share < prefix_end) | (j == N_SPLITS - 1), row_ok, False)  # what was stored
        lse_j = tl.load(Lse + j * stride_ls + b * stride_lb + rows, mask=read, other=float("-inf"))
        out_j = tl.load(Partial + j * stride_ps + b * stride_pb + rows[:, None] * D + d[None, :],
                        mask=read[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m, lse_j)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: weights 0, not NaN
        alpha, w = tl.exp(m - m_safe), tl.exp(lse_j - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * out_j
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # a row that saw nothing keeps zeros
    tl.store(Out + b * stride_ob + rows[:, None] * D + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
