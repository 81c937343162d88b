"""oneDNN on a CPU: which compiled GEMMs call it; packed linears for eager half precision, swapped in from outside.

torch's eager bf16/fp16 matmul on a CPU reorders the weight into oneDNN's blocked layout on every
call; PackedLinear reorders it once. Compiled runs keep nn.Linear, whose opaque packed weights no
graph can trace: a package's graph packs them itself (packed_in_graph), and freezing folds that into
constants. float32 keeps torch's own kernels: packing gains little there, and float32 runs are the
reference that speculative output is checked against."""
import contextlib
import functools
import types

import torch
import torch.nn as nn
from torch import Tensor


class PackedLinear(nn.Module):
    """nn.Linear with its bf16/fp16 weight in oneDNN's blocked layout (pack_linears)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return _onednn_linear(self, x, self.weight)


def _onednn_linear(linear: nn.Module, x: Tensor, packed: Tensor) -> Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, linear.in_features), packed, linear.bias, "none", [], "")
    return y.view(*x.shape[:-1], linear.out_features)


def _packing_forward(linear: nn.Linear, x: Tensor) -> Tensor:
    return _onednn_linear(linear, x, torch.ops.mkldnn._reorder_linear_weight(linear.weight, None))


@contextlib.contextmanager
def packed_in_graph(module: nn.Module):
    """While a package's graph is traced: module's nn.Linears where onednn_gemms pack their weight as an
    op of the graph, which freezing folds into a constant in oneDNN's layout (ATen's bf16 GEMM, the
    graph's otherwise, packs it at every call: RESULTS.md, "CPU tree size"). The kernel is PackedLinear's,
    whose rows invariant.gemm_invariant_rows probes."""
    linears = [m for m in module.modules() if type(m) is nn.Linear and onednn_gemms(m.weight.dtype)]
    if linears:
        _fake_packing()
    for m in linears:
        m.forward = types.MethodType(_packing_forward, m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


@functools.cache
def _fake_packing():
    """torch has no fake kernel for the packing op, which tracing needs: the weight's shape and dtype (the
    opaque layout only exists for real, when freezing folds the op)."""
    with contextlib.suppress(RuntimeError):  # a torch that has one
        torch.library.register_fake("mkldnn::_reorder_linear_weight")(lambda w, batch_size=None: torch.empty_like(w))


def can_pack_linears(dtype: torch.dtype, device) -> bool:
    """Whether PackedLinear serves this dtype on this device: half precision on a CPU whose oneDNN supports it."""
    if str(device) != "cpu" or dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return False
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    return bool(getattr(torch.ops.mkldnn, supported, lambda: False)())


def onednn_gemms(dtype: torch.dtype) -> bool:
    """Whether compiled graphs run this dtype's GEMMs on oneDNN (ATen's) rather than Inductor's C++ templates:
    bf16 on a CPU with AVX-512 bf16 dot products and no AMX tiles, where the templates' micro-kernel converts
    to float32 and a verify of 8-16 rows cost 3-4 steps in them (RESULTS.md, "CPU tree size")."""
    return (dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported()
            and not torch.cpu._is_amx_tile_supported() and can_pack_linears(dtype, "cpu"))


def pack_linears(module: nn.Module) -> int:
    """Replace every plain nn.Linear of module (a Transformer or a draft) by a PackedLinear, in place,
    where can_pack_linears says it serves; returns how many. A tied LM head is packed as its own
    copy (the embedding keeps the plain table). Quantized layers are left alone."""
    linears = [(name, m) for name, m in module.named_modules()
               if type(m) is nn.Linear and can_pack_linears(m.weight.dtype, m.weight.device)]
    for name, m in linears:
        module.set_submodule(name, PackedLinear(m))
    return len(linears)


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the packed weights (outside the state dict) that a forward of module reads."""
    return sum(t.numel() * t.element_size() for m in module.modules() if type(m) is PackedLinear
               for t in (m.weight, m.bias) if t is not None)
