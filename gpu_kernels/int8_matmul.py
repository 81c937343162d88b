"""W8A16 matmul: activations in 16 (or 32) bits times int8 weights with per-channel scales, as a
Triton kernel that reads each int8 weight once for all rows, and its PyTorch reference.

    y [M, N] = (x [M, K] @ w [N, K]^T) * scales [N]      fp32 accumulation, y in x's dtype

quantize.WeightOnlyInt8Linear uses it on CUDA for 1 < M <= CUDA_INT8_KERNEL_ROWS rows (verifies,
draft levels, catch-up), where cuBLAS would need the weight cast to 16 bits on every call. A file of
its own, so that quantize.py stays importable where Triton is not.
"""
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from gpu_kernels.tree_attention import shared_memory_limit  # the device's per-block limit (and the table by GPU)

# As in tree_attention.py: Triton's interpreter (TRITON_INTERPRET=1 when this module is imported)
# runs the kernel on CPU tensors, as the tests do; otherwise it needs CUDA tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")

# Launch constants, read at every call (launch_config), so a tuning sweep can set them. 16-bit x: a
# verify's rows fit one block of MAX_BLOCK_M, so each program reads its weight stripe exactly once,
# and narrow stripes still give about one program per SM for a wide output.
MAX_BLOCK_M = 128
BLOCK_N = 32
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4  # x and w blocks in flight; launch_config takes fewer where shared memory is short
# float32 x (no tensor cores, "ieee"): the dot runs on FMA units with whole tiles in registers, so it
# takes smaller tiles, which compile without spills (tests/test_kernel_fit.py).
FP32_MAX_BLOCK_M = 64
FP32_BLOCK_K = 32
FP32_NUM_WARPS = 8


def reference(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """The kernel's semantics in float32: x [M, K] @ (weight [N, K] * scales [N, 1])^T."""
    return x.float() @ (weight.float() * scales.float()[:, None]).t()


def int8_matmul(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x [M, K] float16, bfloat16 or float32; weight [N, K] int8; scales [N] -> y [M, N] in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.size(1) != weight.size(1) or scales.shape != (weight.size(0),):
        raise ValueError(f"int8_matmul wants x [M, K], weight [N, K] and scales [N], got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(scales.shape)}")
    if weight.dtype != torch.int8 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"int8_matmul wants int8 weights and float16/bfloat16/float32 x, got {weight.dtype}, {x.dtype}")
    if not ((x.is_cuda and weight.is_cuda and scales.is_cuda) or INTERPRETED):
        raise ValueError("the Triton int8 matmul runs on CUDA tensors; to run it on the CPU, set "
                         "TRITON_INTERPRET=1 before int8_matmul is imported")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    (M, K), N = x.shape, weight.size(0)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    launch = launch_config(M, x.dtype, shared_memory_limit(x.device))
    _int8_matmul_kernel[(triton.cdiv(N, launch["BLOCK_N"]), triton.cdiv(M, launch["BLOCK_M"]))](
        x, weight, scales, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0), **launch)
    return y


def launch_config(M, dtype: torch.dtype, shared_limit: int) -> dict:
    """The launch constants for M rows within shared_limit bytes: the module's constants, shrunk while
    shared_bytes says they might not fit; a pure function the ahead-of-time checks compile. M may be
    symbolic (a dynamic-shape prefill): comparisons guard as ranges, so one graph serves every M of a
    block size (M.bit_length() would recompile for every prompt length)."""
    fp32 = dtype == torch.float32
    most, block_k = (FP32_MAX_BLOCK_M, FP32_BLOCK_K) if fp32 else (MAX_BLOCK_M, BLOCK_K)
    block_m = 16  # tl.dot wants >= 16 rows
    while block_m < most and block_m < M:
        block_m *= 2
    stages = NUM_STAGES
    while shared_bytes(block_m, BLOCK_N, block_k, stages, dtype.itemsize) > shared_limit:
        if block_k > 32:
            block_k //= 2
        elif stages > 1:
            stages -= 1
        else:
            raise ValueError(f"int8_matmul: no launch fits in {shared_limit} bytes of shared memory per block")
    return dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=FP32_NUM_WARPS if fp32 else NUM_WARPS,
                num_stages=stages)


def shared_bytes(block_m: int, block_n: int, block_k: int, stages: int, elem: int) -> int:
    """An upper bound on the kernel's shared memory (x and w stages, w cast to x's dtype);
    tests/test_kernel_fit.py holds it against what Triton's compiler reports."""
    return stages * (block_m * block_k * elem + block_n * block_k) + block_n * block_k * elem


@triton.jit
def _int8_matmul_kernel(X, W, Scales, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_M rows of x times a stripe of BLOCK_N output channels, K in BLOCK_K steps.
    The int8 -> x.dtype cast is exact; the scale is applied once, to the fp32 sums."""
    n_block, m_block = tl.program_id(0), tl.program_id(1)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        x = tl.load(X + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols[:, None] * stride_wn + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")  # "ieee": no TF32 for float32 x
    scales = tl.load(Scales + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = acc * scales[None, :]
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
