"""Which attention kernel serves a mask on a device: every model.Attention calls its `attend`, and
use_attention sets it for a whole model or draft: model.sdpa (PyTorch's scaled_dot_product_attention
over a dense mask), cpu_attention (the same attention in the forms fastest on a CPU) or tree_kernel_attention
(on CUDA, a TreeMask through the fused Triton kernel of gpu_kernels/tree_attention.py, which reads the
prefix without a mask). invariant.py sets a kernel of its own for the batch-invariant mode.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Attention, TreeMask, sdpa

try:  # the fused tree kernel needs Triton (Linux x86-64); without it every mask takes SDPA
    from gpu_kernels import tree_attention
except (ImportError, AttributeError) as e:  # AttributeError: a Triton too old for what the kernel uses
    tree_attention, TREE_KERNEL_MISSING = None, f"{type(e).__name__}: {e}"

# Eager bf16/fp16 attention on a CPU: up to this many scores (B * H * T * S) the matmul form is the
# faster one (steps, verifies); past it (a long prefill, a training batch) SDPA's flash kernel is, as
# the matmul form writes and rereads every score in float32 (benchmarks/RESULTS.md).
MATMUL_ATTENTION_MAX_SCORES = 2 ** 21
# Compiled on a CPU, attention reads the cache up to the last slot a query sees (a host int, which
# dynamo keeps in the graph when told to) rounded up to ATen's CPU flash kernel's key block: a slot
# keeps its place in the kernel's blocks however many are read, so batch-invariant rows stay invariant.
LIVE_BLOCK = 512
torch._dynamo.config.capture_scalar_outputs = True


def use_attention(module: nn.Module, backend: str = "auto") -> str:
    """Set the kernel of every Attention in module (a Transformer or a draft) for the device its
    weights are on. backend: "sdpa" (cpu_attention on a CPU, model.sdpa elsewhere), "triton" (the
    fused tree kernel for TreeMasks: CUDA, or any device under TRITON_INTERPRET=1 as in the
    tests), "auto" (triton on CUDA where it imports, else sdpa). Returns the backend chosen."""
    if backend not in ("auto", "sdpa", "triton"):
        raise ValueError(f"attention backend must be auto, sdpa or triton, got {backend!r}")
    device = next(module.parameters()).device
    if backend == "auto":
        if device.type == "cuda" and tree_attention is None:
            print(f"attention: the triton kernel is unavailable ({TREE_KERNEL_MISSING}); using sdpa", file=sys.stderr)
        backend = "triton" if device.type == "cuda" and tree_attention is not None else "sdpa"
    if backend == "triton" and tree_attention is None:
        raise ValueError(f"the triton attention backend needs triton (Linux x86-64 with CUDA): {TREE_KERNEL_MISSING}")
    kernel = tree_kernel_attention if backend == "triton" else cpu_attention if device.type == "cpu" else sdpa
    for m in module.modules():
        if isinstance(m, Attention):
            m.attend = kernel
    return backend


def tree_kernel_attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """A TreeMask through the fused kernel; any other mask as use_attention's "sdpa" takes it."""
    if isinstance(mask, TreeMask) and (q.is_cuda or tree_attention.INTERPRETED):
        return tree_attention.tree_attention(q, k, v, mask.prefix_len, mask.visible)
    return cpu_attention(q, k, v, mask) if q.device.type == "cpu" else sdpa(q, k, v, mask)


def cpu_attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """model.sdpa's attention, in the forms fastest on a CPU. Eager (the host may read the mask for
    free: no device to wait for) it reads only the slots some query sees, the live prefix and a
    tree's region, and takes the matmul form in half precision for few scores; compiled it reads
    those slots rounded up to whole LIVE_BLOCKs (live_slots) through ATen's flash kernel, with the
    query heads that share a KV head stacked."""
    eager = q.device.type == "cpu" and not torch.compiler.is_compiling()  # (a module moved off the CPU: as compiled)
    S = k.size(2)
    if isinstance(mask, TreeMask):  # the live prefix and the tree region only
        R = mask.visible.size(-1)
        if eager or S - R > LIVE_BLOCK:
            P = min(int(mask.prefix_len.max()), S - R) if eager else live_slots(mask.prefix_len, S - R)
            k, v = torch.cat([k[:, :, :P], k[:, :, S - R:]], dim=2), torch.cat([v[:, :, :P], v[:, :, S - R:]], dim=2)
            S = P + R
        mask = mask.dense(S)
    elif eager or S > LIVE_BLOCK:  # up to the last slot any query sees
        end = (mask * torch.arange(1, S + 1, device=mask.device)).amax()
        live = int(end) if eager else live_slots(end, S)
        k, v, mask = k[:, :, :live], v[:, :, :live], mask[..., :live]
    if eager and q.dtype != torch.float32 and q.numel() // q.size(-1) * k.size(2) < MATMUL_ATTENTION_MAX_SCORES:
        return _matmul_attention(q, k, v, mask)
    # Compiled, SDPA stays ATen's flash-attention kernel. The matmul form would not: max-autotune
    # gives its q @ k^T to a C++ GEMM template, which then repacks the whole K cache into the
    # template's layout on every call.
    if q.shape[1] != k.shape[1]:
        return _grouped_sdpa(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def live_slots(end: Tensor, cache_len: int) -> int:
    """How many of a cache's first slots compiled CPU attention reads when no query sees one at or past
    end.max(): that rounded up to a multiple of LIVE_BLOCK, at most cache_len. Known only at run time, so one
    graph serves every length, and attention costs what the text's length does, not the cache's."""
    n = ((end.max() + LIVE_BLOCK - 1) // LIVE_BLOCK * LIVE_BLOCK).clamp(min=LIVE_BLOCK).clamp(max=cache_len).item()
    torch._check(n >= 1)
    torch._check(n <= cache_len)
    return n


def _grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """SDPA with GQA on a CPU: the G = H // KV query heads that share a KV head are stacked as G * T
    query rows of one call per KV head, each row with its query's mask. ATen's CPU flash kernel
    with enable_gqa handles each query head apart and, in bf16/fp16, packs that head's K and V
    blocks again for each: several times slower for a one-token step (benchmarks/RESULTS.md)."""
    B, H, T, D = q.shape
    KV, S = k.size(1), k.size(2)
    G = H // KV
    rows = q.reshape(B, KV, G * T, D)  # query head h = kv * G + g reads KV head kv, as enable_gqa
    row_mask = mask[:, None, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)
    return F.scaled_dot_product_attention(rows, k, v, attn_mask=row_mask).view(B, H, T, D)


def _matmul_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention as two matmuls and a float32 softmax, for bf16/fp16 in eager mode on a CPU, where
    SDPA with a mask is slower for few query rows. The H // KV query heads that share a KV head are
    stacked as rows of one matmul, so K/V are not repeated."""
    B, H, T, D = q.shape
    KV = k.size(1)
    scores = (q.reshape(B, KV, H // KV * T, D) @ k.transpose(-1, -2)).float() * D ** -0.5
    scores = scores.view(B, KV, H // KV, T, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, KV, H // KV * T, -1)
    return (probs @ v).view(B, H, T, D)
