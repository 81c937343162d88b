"""oneDNN on a CPU: which compiled GEMMs call it; packed linears for eager half precision, swapped in from outside.

torch's eager bf16/fp16 matmul on a CPU reorders the weight into oneDNN's blocked layout on every
call; PackedLinear reorders it once. Compiled runs keep nn.Linear: Inductor's freezing packs weights
itself, and cannot trace these opaque ones. float32 keeps torch's own kernels: packing gains little
there, and float32 runs are the reference that speculative output is checked against."""
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
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


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
    copy (the embedding keeps the plain table). Quantized layers are left alone. A forward set on a
    linear's instance (batch-invariant mode's invariant.one_row_as_two) carries over."""
    linears = [(name, m) for name, m in module.named_modules()
               if type(m) is nn.Linear and can_pack_linears(m.weight.dtype, m.weight.device)]
    for name, m in linears:
        module.set_submodule(name, packed := PackedLinear(m))
        if "forward" in m.__dict__:
            packed.forward = types.MethodType(m.forward.__func__, packed)
    return len(linears)


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the packed weights (outside the state dict) that a forward of module reads."""
    return sum(t.numel() * t.element_size() for m in module.modules() if type(m) is PackedLinear
               for t in (m.weight, m.bias) if t is not None)
