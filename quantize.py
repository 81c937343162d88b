"""Weight-only int8 and int4 quantization of a model.py Transformer or an EAGLE draft (gpt-fast style).

    python scripts/quantize_checkpoint.py --checkpoint_path checkpoints/NAME/model.pth --mode int8
    python scripts/quantize_checkpoint.py --checkpoint_path checkpoints/NAME/model.pth --mode int4 --groupsize 32
    python scripts/quantize_checkpoint.py --draft --checkpoint_path checkpoints/NAME/eagle --mode int8

write model_int8.pth / model_int4.g32.pth beside model.pth (gpt-fast naming; drafts likewise). The loader
reads the mode from the file name, checks it against the contents and swaps the layers (prepare_for_loading).
Every nn.Linear is replaced, a tied LM head gets its own quantized copy; embeddings, norms and biases stay float.

    int8  symmetric, one scale per output channel: W ~ q * s, q in [-127, 127].
    int4  asymmetric, one scale and zero per group of `groupsize` input columns:
          W ~ (q - 8) * s + z, q in [0, 15], the form torch's int4 matmul kernels take.

Speculative decoding on a quantized target gives exactly vanilla decoding's output on that target.
int4 files hold portable nibbles (two to a byte, even column high), repacked for the device's kernel
at load time (pack_int4): torch's packed layouts differ between CPU and CUDA and across versions.
"""
import functools
import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Experts

# The W8A16 Triton kernel, imported only where CUDA is: a CPU process that imported Triton before
# setting TRITON_INTERPRET=1 (as the tests do) could not run any kernel in the interpreter.
int8_matmul = None
if torch.cuda.is_available():
    try:
        from gpu_kernels.int8_matmul import int8_matmul
    except (ImportError, AttributeError):
        pass

GROUPSIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept, on CPU and CUDA alike
INT4_N_MULTIPLE = 16  # the CPU packing needs out_features % 16 == 0 (CUDA: % 8); rows are padded to it
CPU_INT8_KERNEL_ROWS = 16  # up to this many rows, int8 layers on CPU use aten._weight_int8pack_mm
# On CUDA, 2 .. CUDA_INT8_KERNEL_ROWS rows go to the int8 kernel (one row: Inductor's GEMV reads int8
# already; a prefill: cuBLAS after the cast); int4 dequantizes for cuBLAS above CUDA_INT4_KERNEL_ROWS.
CUDA_INT8_KERNEL_ROWS = 128
CUDA_INT4_KERNEL_ROWS = 128
# An eager dequantization works through a layer this many weights at a time, so that it never holds
# a float32 copy of a whole layer on top of the copy cuBLAS reads.
DEQUANTIZE_CHUNK = 1 << 24


def quantize_int8(w: Tensor, scales_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """w [..., out, in] -> (q int8, scales [..., out] in scales_dtype) with w ~ q * scales[..., None]."""
    w = w.float()
    scales = w.abs().amax(dim=-1).clamp(min=1e-10) / 127  # an all-zero row gets a tiny scale, not 0/0
    q = torch.round(w / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scales.to(scales_dtype)


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales[..., None].float()


# Batch-invariant mode compiled on a CPU needs each row of a layer to come out the same however many rows
# come together. Inductor's C++ int8 and int4 templates (on the CPUs and shapes below) accumulate each
# output in float32 k after k: rows independent of the row count (tests/test_quantize.py); with AMX their
# micro-kernels add pairs of products and are not. Elsewhere, and for shapes the int4 template lacks (which
# "CPP" alone, compiling.CPU_INVARIANT, cannot compile), layers keep torch's row-invariant CPU kernel as an
# op Inductor cannot lower (int8_rows, int4_rows_cpu). Costs: benchmarks/RESULTS.md, "Batch-invariant cost".
INDUCTOR_INT8_ROWS_INVARIANT = (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
                                and not torch.cpu._is_amx_tile_supported())
INDUCTOR_INT4_ROWS_INVARIANT = (torch.backends.cpu.get_cpu_capability() == "AVX512"
                                and not torch.cpu._is_amx_tile_supported())
INT4_TEMPLATE_GROUPSIZES = (32, 64, 128)  # what the template's micro-kernel takes (not 256)
INT4_TEMPLATE_N_MULTIPLE = 64  # its block of outputs


@torch.library.custom_op("eagle_gpt_fast::int8_rows", mutates_args=())
def int8_rows(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """aten._weight_int8pack_mm(x [M, K], weight int8 [N, K], scales [N]) -> [M, N], opaque to Inductor."""
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales)


int8_rows.register_fake(lambda x, weight, scales: x.new_empty(x.size(0), weight.size(0)))


@functools.cache
def lower_int8_rows_to_the_kernel():
    """Compile int8_rows into a direct call of torch's int8 kernel, not a slower call back through
    Python; the bits are the kernel's either way. Registered at the first batch-invariant CPU compile
    (compiling.cpu_backend), since importing Inductor at import time would slow every script."""
    from torch._inductor.lowering import fallback_handler, register_lowering
    kernel = fallback_handler(torch.ops.aten._weight_int8pack_mm.default, add_to_fallback_set=False)
    register_lowering(torch.ops.eagle_gpt_fast.int8_rows, type_promotion_kind=None)(kernel)


@torch.library.custom_op("eagle_gpt_fast::int4_rows_cpu", mutates_args=())
def int4_rows_cpu(x: Tensor, weight: Tensor, groupsize: int, scales_and_zeros: Tensor) -> Tensor:
    """aten._weight_int4pack_mm_for_cpu(x [M, K], packed weight, groupsize, scales_and_zeros
    [K / groupsize, N, 2]) -> [M, N], opaque to Inductor."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, groupsize, scales_and_zeros)


int4_rows_cpu.register_fake(
    lambda x, weight, groupsize, scales_and_zeros: x.new_empty(x.size(0), scales_and_zeros.size(1)))


@functools.cache
def lower_int4_rows_to_the_kernel():
    """lower_int8_rows_to_the_kernel for int4. The C shim has no fallback entry for this op, so it
    reuses Inductor's own lowering with ATen as its only backend: the same kernel, so the same bits."""
    from torch._inductor import config
    from torch._inductor.lowering import lowerings, register_lowering
    aten_lowering = lowerings[torch.ops.aten._weight_int4pack_mm_for_cpu.default]

    def kernel(x, weight, groupsize, scales_and_zeros):
        with config.patch(max_autotune_gemm_backends="ATEN"):
            return aten_lowering(x, weight, groupsize, scales_and_zeros)
    register_lowering(torch.ops.eagle_gpt_fast.int4_rows_cpu, type_promotion_kind=None)(kernel)


class WeightOnlyInt8Linear(nn.Module):
    """y = (x @ q^T) * scales + bias. The weight is read as int8, a quarter of float32's bytes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.row_invariant = False  # set_row_invariant: the CPU kernel for any number of rows

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "WeightOnlyInt8Linear":
        m = cls(linear.in_features, linear.out_features, linear.bias is not None)
        m.weight, m.scales = quantize_int8(linear.weight.detach(), linear.weight.dtype)
        m.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def forward(self, x: Tensor) -> Tensor:
        scales = self.scales.to(x.dtype)
        rows = x.numel() // self.in_features
        if x.is_cpu and x.dtype != torch.float32 and (rows <= CPU_INT8_KERNEL_ROWS or self.row_invariant):
            # torch's CPU int8 kernel beats casting the weight for a few rows, not for many. Its rows do not
            # depend on how many there are, so batch-invariant mode takes it for every row count.
            opaque = self.row_invariant and torch.compiler.is_compiling() and not INDUCTOR_INT8_ROWS_INVARIANT
            matmul = int8_rows if opaque else torch.ops.aten._weight_int8pack_mm
            y = matmul(x.reshape(-1, self.in_features), self.weight, scales)
        elif x.is_cuda and int8_matmul is not None and 1 < rows <= CUDA_INT8_KERNEL_ROWS:
            # several rows on CUDA: cuBLAS would need the weight cast to x.dtype first, every call
            y = int8_matmul(x.reshape(rows, self.in_features), self.weight, self.scales)
        else:
            # gpt-fast's form: under torch.compile the exact cast fuses into the matmul's weight load.
            y = F.linear(x, self.weight.to(x.dtype)) * scales
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class WeightOnlyInt8Experts(nn.Module):
    """model.Experts ([E, out, in]) in int8, one scale per expert and output channel."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(num_experts, out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_experts, out_features))

    @classmethod
    def from_experts(cls, experts: Experts) -> "WeightOnlyInt8Experts":
        E, out_features, in_features = experts.weight.shape
        m = cls(E, in_features, out_features)
        m.weight, m.scales = quantize_int8(experts.weight.detach(), experts.weight.dtype)
        return m

    def gathered(self, x: Tensor, experts: Tensor) -> Tensor:
        """x [N, k, in], experts [N, k] -> [N, k, out]."""
        return torch.einsum("nki,nkoi->nko", x, self.weight[experts].to(x.dtype)) * self.scales[experts].to(x.dtype)

    def dense(self, x: Tensor) -> Tensor:
        """x [E, N, in] -> [E, N, out]."""
        return torch.einsum("eni,eoi->eno", x, self.weight.to(x.dtype)) * self.scales[:, None].to(x.dtype)


def set_row_invariant(model: nn.Module, on: bool = True) -> nn.Module:
    """For batch-invariant mode (invariant.py): quantized layers compute each row the same way however
    many rows come together. On a CPU, eager layers use torch's kernels for every row count; compiled,
    Inductor's templates where their rows are invariant, else the kernels as opaque ops (see above)."""
    for m in model.modules():
        if isinstance(m, (WeightOnlyInt8Linear, WeightOnlyInt4Linear)):
            m.row_invariant = on
    return model


# int4: asymmetric per group of input columns, packed for torch's int4 matmul kernels.
def check_groupsize(groupsize: int):
    if groupsize not in GROUPSIZES:
        raise ValueError(f"int4 groupsize must be one of {', '.join(map(str, GROUPSIZES))} "
                         f"(what torch's int4 kernels accept), got {groupsize}")


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """w [out, in] -> (q uint8 in 0..15, scales_and_zeros bf16 [in / groupsize, out, 2]). Scale and
    zero are rounded to bf16 (all the CUDA kernel takes) before q, so q is best for the stored ones."""
    check_groupsize(groupsize)
    out_features, in_features = w.shape
    if in_features % groupsize:
        raise ValueError(f"in_features {in_features} is not a multiple of groupsize {groupsize}: pad it first")
    groups = w.float().reshape(out_features, in_features // groupsize, groupsize)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo).clamp(min=1e-6) / 15).to(torch.bfloat16)
    zeros = (lo + 8 * scales.float()).to(torch.bfloat16)  # the value code 8 stands for
    lo = zeros.float() - 8 * scales.float()  # the value code 0 stands for, after rounding
    q = torch.round((groups - lo[..., None]) / scales.float()[..., None]).clamp(0, 15)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return q.reshape(out_features, in_features).to(torch.uint8), scales_and_zeros


def dequantize_int4(q: Tensor, scales_and_zeros: Tensor, groupsize: int) -> Tensor:
    """Inverse of quantize_int4: float32 [out, in]."""
    out_features, in_features = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
    groups = q.float().reshape(out_features, in_features // groupsize, groupsize)
    return ((groups - 8) * sz[..., :1] + sz[..., 1:]).reshape(out_features, in_features)


def dequantize_int4_as(nibbles: Tensor, scales_and_zeros: Tensor, groupsize: int, dtype: torch.dtype,
                       chunk: int = DEQUANTIZE_CHUNK) -> Tensor:
    """dequantize_int4(unpack_nibbles(nibbles), ...).to(dtype), bit for bit, chunk weights at a time in
    eager mode; compiled, Inductor fuses the whole layer into one kernel with no float32 copy."""
    out_features, in_features = nibbles.size(0), 2 * nibbles.size(1)
    rows = max(1, chunk // in_features)
    if torch.compiler.is_compiling() or rows >= out_features:
        return dequantize_int4(unpack_nibbles(nibbles), scales_and_zeros, groupsize).to(dtype)
    w = torch.empty(out_features, in_features, dtype=dtype, device=nibbles.device)
    for r in range(0, out_features, rows):
        w[r:r + rows] = dequantize_int4(unpack_nibbles(nibbles[r:r + rows]), scales_and_zeros[:, r:r + rows], groupsize)
    return w


def pack_nibbles(q: Tensor) -> Tensor:
    """uint8 [out, in] in 0..15 -> [out, in / 2], even column high (_convert_weight_to_int4pack's input)."""
    return (q[:, ::2] << 4) | q[:, 1::2]


def unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.size(0), -1)


def int4_kernel(device: torch.device):
    """(pack, matmul, compute dtype) for this device's int4 kernel, or a clear error. pack(nibbles
    [N, K / 2]) -> packed weight; matmul(x [M, K], packed, groupsize, scales_and_zeros) -> [M, N].
    The CPU packing takes int32 [N, K], the CUDA one (torch >= 2.5) the uint8 nibbles."""
    aten = torch.ops.aten
    if device.type == "cpu":
        if not hasattr(aten, "_weight_int4pack_mm_for_cpu"):
            raise ValueError(f"int4 on CPU needs torch >= 2.6 (aten._weight_int4pack_mm_for_cpu); this is "
                             f"torch {torch.__version__}: upgrade torch or use --mode int8")
        # innerKTiles only shapes the CUDA layout; the CPU kernel takes any of 2, 4, 8.
        return (lambda nibbles: aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).int(), 8),
                aten._weight_int4pack_mm_for_cpu, None)  # None: the CPU kernel computes in x's dtype
    if device.type == "cuda":
        if torch.version.hip is None and torch.cuda.get_device_capability(device) < (8, 0):
            raise ValueError(f"the int4 CUDA kernel needs compute capability >= 8.0 (Ampere or newer); "
                             f"{torch.cuda.get_device_name(device)} has "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}: use --mode int8")

        def pack(nibbles):
            K = nibbles.size(1) * 2
            # innerKTiles: 16-column k-tiles a thread reads at once; the largest with K % (16 * t) == 0.
            inner_k_tiles = next(t for t in (8, 4, 2) if K % (16 * t) == 0)
            return aten._convert_weight_to_int4pack(nibbles.contiguous(), inner_k_tiles)
        return pack, aten._weight_int4pack_mm, torch.bfloat16  # the CUDA kernel is bfloat16 only
    raise ValueError(f"int4 weights run on CPU or CUDA, not on {device.type}: use --mode int8")


class WeightOnlyInt4Linear(nn.Module):
    """y = x @ dequant(W)^T + bias, the 4-bit weight read by torch's int4 kernel. in_features is padded
    to a multiple of groupsize (zero columns meet zero inputs), out_features to one of 16 (outputs
    dropped). weight holds portable nibbles (what files hold) until pack() repacks it for the device."""

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False):
        super().__init__()
        check_groupsize(groupsize)
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.in_padded = -(-in_features // groupsize) * groupsize
        self.out_padded = -(-out_features // INT4_N_MULTIPLE) * INT4_N_MULTIPLE
        self.register_buffer("weight", torch.empty(self.out_padded, self.in_padded // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(self.in_padded // groupsize, self.out_padded, 2,
                                                             dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_for: str | None = None  # the device type weight is packed for, None: portable nibbles
        self._matmul = None
        self.row_invariant = False  # set_row_invariant: compiled on a CPU, the kernel as an opaque op

    @property
    def padded(self) -> bool:
        return (self.in_padded, self.out_padded) != (self.in_features, self.out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, groupsize: int) -> "WeightOnlyInt4Linear":
        m = cls(linear.in_features, linear.out_features, groupsize, linear.bias is not None)
        w = F.pad(linear.weight.detach().float(), (0, m.in_padded - m.in_features, 0, m.out_padded - m.out_features))
        q, m.scales_and_zeros = quantize_int4(w, groupsize)
        m.weight = pack_nibbles(q)
        m.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def pack(self):
        """Repack the nibbles for their device's kernel. On CUDA the nibbles stay too, for the
        dequantized path of many rows (forward): the int4 weight twice, never a float copy."""
        if self.packed_for is not None:
            return
        pack, self._matmul, dtype = int4_kernel(self.weight.device)
        if self.weight.is_cuda:
            self.register_buffer("nibbles", self.weight, persistent=False)
        self.weight = pack(self.weight)
        if dtype is not None:
            self.scales_and_zeros = self.scales_and_zeros.to(dtype)
        self.packed_for = self.weight.device.type

    def forward(self, x: Tensor) -> Tensor:
        if self.packed_for != x.device.type:
            raise RuntimeError(f"int4 weights packed for {self.packed_for}, input on {x.device.type}: "
                               f"call quantize.pack_int4(model) after moving the model to its device")
        x2 = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        if self.in_padded != self.in_features:
            x2 = F.pad(x2, (0, self.in_padded - self.in_features))
        if x.is_cuda and x2.size(0) > CUDA_INT4_KERNEL_ROWS:
            # many rows: the int4 kernel rereads the weight per 16-row tile; dequantizing once for cuBLAS reads less
            w = dequantize_int4_as(self.nibbles, self.scales_and_zeros, self.groupsize, x2.dtype)
            y = F.linear(x2, w)[:, :self.out_features]
        else:
            matmul = self._matmul
            if self.row_invariant and x.is_cpu and torch.compiler.is_compiling() and not self.template_invariant():
                matmul = int4_rows_cpu  # the kernel itself, never the template (lower_int4_rows_to_the_kernel)
            y = matmul(x2, self.weight, self.groupsize, self.scales_and_zeros)[:, :self.out_features]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def template_invariant(self) -> bool:
        """Whether Inductor's int4 template, row-count invariant on this CPU, takes this layer's shape."""
        return (INDUCTOR_INT4_ROWS_INVARIANT and self.groupsize in INT4_TEMPLATE_GROUPSIZES
                and self.out_padded % INT4_TEMPLATE_N_MULTIPLE == 0 and self.scales_and_zeros.dtype == torch.bfloat16)

    def extra_repr(self) -> str:
        pad = f", padded to ({self.in_padded}, {self.out_padded})" if self.padded else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"groupsize={self.groupsize}, bias={self.bias is not None}{pad}")


QUANTIZED_LINEARS = (WeightOnlyInt8Linear, WeightOnlyInt8Experts, WeightOnlyInt4Linear)


def has_quantized(*modules: nn.Module) -> bool:
    """Whether any of modules (a Speculator: its target and draft too) holds an int8 or int4 layer."""
    return any(isinstance(m, QUANTIZED_LINEARS) for module in modules for m in module.modules())


def pack_int4(model: nn.Module) -> nn.Module:
    """Pack every int4 layer for the device it is on; call after model.to(device, dtype)."""
    for m in model.modules():
        if isinstance(m, WeightOnlyInt4Linear):
            m.pack()
    return model


# Whole models: quantize in memory, and rebuild the quantized structure before loading a file.
def _swap_linears(model: nn.Module, make, kind=nn.Linear) -> list:
    """Replace each module of type kind by make(name, module) where that is not None; returns the names."""
    swapped = []
    for name, lin in list(model.named_modules()):
        if isinstance(lin, kind):
            new = make(name, lin)
            if new is not None:
                model.set_submodule(name, new)
                swapped.append(name)
    return swapped


def quantize_model(model: nn.Module, mode: str, groupsize: int = 32) -> list:
    """Replace every nn.Linear by its int8 or int4 version in place (int4 unpacked; int8 also takes
    expert stacks); returns lines that say what was done."""
    if mode == "int8":
        swapped = _swap_linears(model, lambda name, lin: WeightOnlyInt8Linear.from_linear(lin))
        stacks = _swap_linears(model, lambda name, e: WeightOnlyInt8Experts.from_experts(e), kind=Experts)
        notes = [f"int8 (per-channel): {len(swapped)} linear layers"
                 + (f", {len(stacks)} expert stacks" if stacks else "")]
    elif mode == "int4":
        swapped = _swap_linears(model, lambda name, lin: WeightOnlyInt4Linear.from_linear(lin, groupsize))
        notes = [f"int4 (groupsize {groupsize}): {len(swapped)} linear layers"]
        padded = {}
        for name in swapped:
            m = model.get_submodule(name)
            if m.padded:
                key = f"[{m.out_features}, {m.in_features}] -> [{m.out_padded}, {m.in_padded}]"
                padded.setdefault(key, []).append(name)
        notes += [f"  padded {key} with zeros: {_summarize(names)}" for key, names in padded.items()]
    else:
        raise ValueError(f"unknown quantization mode {mode!r}: int8 or int4")
    floats = [n for n, p in model.named_parameters() if p.dim() >= 2]
    if floats:
        notes.append(f"  kept in float: {_summarize(floats)}")
    return notes


def _summarize(names: list) -> str:
    """'layers.{0..29}.attention.wqkv' style: one entry per name pattern with the layer indices folded."""
    groups = {}
    for n in names:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", n), []).append(n)
    return ", ".join(pattern if len(ns) > 1 else ns[0] for pattern, ns in groups.items()) + f" ({len(names)})"


def mode_from_path(path) -> tuple:
    """gpt-fast naming: '..._int8.pth' -> ("int8", None); '..._int4.g32.pth' -> ("int4", 32);
    anything else -> (None, None), a float file."""
    name = Path(path).name
    if re.search(r"_int8\.", name):
        return "int8", None
    if m := re.search(r"_int4\.g(\d+)\.", name):
        return "int4", int(m.group(1))
    return None, None


def quantized_path(path, mode: str, groupsize: int) -> Path:
    """model.pth -> model_int8.pth / model_int4.g32.pth (draft.safetensors likewise)."""
    path = Path(path)
    tag = "int8" if mode == "int8" else f"int4.g{groupsize}"
    return path.with_name(f"{path.stem}_{tag}{path.suffix}")


def prepare_for_loading(model: nn.Module, state_dict: dict, path) -> nn.Module:
    """Before load_state_dict(assign=True) on a meta model: an empty quantized module for each layer the
    file holds quantized (read off its tensors). The file's name must say the same, so that a renamed
    file is an error rather than a silent mix-up. Follow the load with pack_int4."""
    found = set()

    def make(name, module):
        if f"{name}.scales" in state_dict:
            found.add(("int8", None))
            if isinstance(module, Experts):  # a mixture-of-experts' stacked weights [E, out, in], int8 only
                num_experts, out_features, in_features = module.weight.shape
                return WeightOnlyInt8Experts(num_experts, in_features, out_features)
            return WeightOnlyInt8Linear(module.in_features, module.out_features, module.bias is not None)
        if f"{name}.scales_and_zeros" in state_dict:
            groupsize = 2 * state_dict[f"{name}.weight"].size(1) // state_dict[f"{name}.scales_and_zeros"].size(0)
            found.add(("int4", groupsize))
            return WeightOnlyInt4Linear(module.in_features, module.out_features, groupsize, module.bias is not None)
        return None

    with torch.device("meta"):
        _swap_linears(model, make, kind=(nn.Linear, Experts))
    named = mode_from_path(path)
    if found != ({named} if named[0] else set()):
        holds = ", ".join(_mode_name(*m) for m in sorted(found, key=str)) or "float"
        raise ValueError(f"{Path(path).name} holds {holds} weights but its name says {_mode_name(*named)}: "
                         f"quantize.py names its files like model_int8.pth and model_int4.g32.pth")
    return model


def _mode_name(mode, groupsize) -> str:
    return "float" if mode is None else mode if mode == "int8" else f"int4 groupsize {groupsize}"
