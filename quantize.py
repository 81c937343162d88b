"""Weight-only int8 and int4 quantization of a model.py Transformer or an EAGLE draft (gpt-fast style).

    python quantize.py --checkpoint_path checkpoints/NAME/model.pth --mode int8
    python quantize.py --checkpoint_path checkpoints/NAME/model.pth --mode int4 --groupsize 32
    python quantize.py --draft --checkpoint_path checkpoints/NAME/eagle --mode int8

write model_int8.pth / model_int4.g32.pth beside model.pth (gpt-fast naming), or
draft_int8.safetensors / draft_int4.g32.safetensors beside draft.safetensors. checkpoint.load_model and
checkpoint.load_draft read the mode from the file name and check it against the file's contents:

    python generate.py --checkpoint_path checkpoints/NAME/model_int8.pth --speculate eagle2 \
        --draft_checkpoint_path checkpoints/NAME/eagle/draft_int8.safetensors

Every nn.Linear is replaced, the LM head included; a tied LM head (SmolLM2, small Qwen2) gets its
own quantized copy and the embedding table stays in float, as do norms and biases.

    int8  symmetric, one scale per output channel: W ~ q * s, q in [-127, 127].
    int4  asymmetric, one scale and zero per group of `groupsize` input columns:
          W ~ (q - 8) * s + z, q in [0, 15], the form torch's int4 matmul kernels take.

Quantization is lossless in the sense that matters here: speculative decoding on a quantized
target gives exactly the output of vanilla decoding on the same quantized target.

int4 files are device-independent: they hold the 4-bit values two to a byte ([out, in / 2], even
column in the high nibble) and are repacked into the layout of the device's kernel at load time
(pack_int4), because torch's packed layouts differ between CPU and CUDA and across versions.
"""
import argparse
import contextlib
import functools
import re
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Experts

# The W8A16 Triton kernel for several rows on CUDA (without Triton those rows take the cast).
# Imported only where CUDA is: Triton decorates its own library when it is first imported, and a
# CPU process that imported it before setting TRITON_INTERPRET=1 (as the tests do) could not run
# any kernel in the interpreter.
int8_matmul = None
if torch.cuda.is_available():
    try:
        from int8_matmul import int8_matmul
    except (ImportError, AttributeError):
        pass

GROUPSIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept, on CPU and CUDA alike
INT4_N_MULTIPLE = 16  # the CPU packing needs out_features % 16 == 0 (CUDA: % 8); rows are padded to it
CPU_INT8_KERNEL_ROWS = 16  # up to this many rows, int8 layers on CPU use aten._weight_int8pack_mm
# On CUDA, int8 layers give 2 .. CUDA_INT8_KERNEL_ROWS rows to int8_matmul.py's kernel, which reads
# the int8 weight once; one row (Inductor's fused GEMV reads int8 already) and more rows (a
# prefill: arithmetic-bound, cuBLAS) take the cast. int4 layers give up to CUDA_INT4_KERNEL_ROWS
# rows to torch's int4 kernel and dequantize for cuBLAS beyond (WeightOnlyInt4Linear.forward).
# Both to be tuned on the GPU (scripts/tune_kernels.py).
CUDA_INT8_KERNEL_ROWS = 128
CUDA_INT4_KERNEL_ROWS = 128
# An eager dequantization (int4 prefill on CUDA) works through a layer in pieces of at most this
# many weights, so that its float32 intermediate stays at 64 MB rather than a float32 copy of the
# whole layer (LLaMA-3's LM head: 2.1 GB) on top of the compute-dtype copy cuBLAS reads.
DEQUANTIZE_CHUNK = 1 << 24


# ---------------------------------------------------------------------------------------------
# int8: symmetric per output channel
# ---------------------------------------------------------------------------------------------
def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [..., out, in] -> (q int8 [..., out, in], scales float32 [..., out]) with w ~ q * scales[..., None].
    Any leading dims are kept, so a stack of expert weights [E, out, in] quantizes the same way."""
    w = w.float()
    scales = w.abs().amax(dim=-1).clamp(min=1e-10) / 127  # an all-zero row gets a tiny scale, not 0/0
    q = torch.round(w / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales[..., None].float()


# ---------------------------------------------------------------------------------------------
# Batch-invariant mode compiled on a CPU: which code computes the int8 and int4 layers
# ---------------------------------------------------------------------------------------------
# The mode needs each row of a layer to come out the same however many rows are computed
# together. Compiled, Inductor lowers torch's int8 op to its own C++ GEMM template (max-autotune,
# "CPP" only in the mode: speculative.CPU_INVARIANT). Its micro-kernel for bf16 activations and
# int8 weights on AVX-512 and AVX2 (CppMicroGemmFP32Vec) keeps a float32 accumulator per output
# and adds the products one k after the other, K blocks in order into a float32 buffer, with no
# split of K across threads (gemm_max_k_slices 1), for the frozen weight the template packs: the
# same sums for any row count. Measured on a Zen 5 (AVX-512, torch 2.13; AVX2 runs the same code,
# not measured): SmolLM2's int8 shapes (576 -> 192, 576, 960, 1536, 3072, 49152; 1536 -> 576),
# each row of 2-64-row calls equal to the one-row call's bit for bit. With AMX it is
# another micro-kernel from 5 rows on (tile dot products that add pairs of products; skipped below
# 5 rows for weight-only GEMMs), and an AMX Xeon gave 4 of 8 and 26 of 30 rows of SmolLM2 verifies
# apart from the one-token steps'; other CPUs have no int8 template at all. There the mode keeps
# torch's own CPU kernel, which gives each row the same bits for 1-128 rows, as a custom op that
# Inductor cannot lower (int8_rows). Where the template serves, a step runs the code of plain
# decoding's compiled step (a Zen 5, bf16, three runs: the mode's step -3 to +3 %, a round +6 to
# +12 %, against +29 % and +19 % through the kernel; a Zen 4, one run: +4.7 %, +7.5 %;
# benchmarks/README.md).
# int4 likewise: Inductor's int4 template has a micro-kernel for AVX-512 only
# (CppMicroGemmWoQInt4Avx512: bf16 activations, groups of 32, 64 or 128 columns, a multiple of 64
# outputs), which turns each k's 4-bit weights into float32 (a lookup, then scale and zero by one
# fma) and adds their products to each output's float32 accumulator k after k: rows independent of
# the row count again (with AMX, another micro-kernel from 5 rows on). A layer of another shape
# has no template, and with "CPP" only it would not compile at all, so it keeps torch's int4 kernel
# (int4_rows_cpu, which Inductor compiles to a direct call of the kernel:
# lower_int4_rows_to_the_kernel); so does every int4 layer on a CPU without AVX-512 or with AMX.
# (A Zen 4, group 32: the template, three runs: the mode's step +0.9 to +9.5 %, a round +7.9 to
# +11.6 %, and since the window attention's recent call runs in float32 (2026-11-30) a step +11.1,
# +6.3, +5.3 %, a round +11.3, +8.1, +6.7 %, so that generate.batch_invariant_by_default turns the
# mode on for int4 files where the template serves; the kernel called directly, one run: +11.1 %
# and +14.4 %; the kernel called back through Python, as before 2026-11-29: +44 % and +31 %.)
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


@int8_rows.register_fake
def _(x, weight, scales):
    return x.new_empty(x.size(0), weight.size(0))


@functools.cache
def lower_int8_rows_to_the_kernel():
    """Inductor: compile int8_rows into a direct call of torch's int8 kernel from the compiled code
    rather than a call of the custom op, which the compiled code makes back through Python (a
    576 x 576 int8 layer, one bf16 row, in a compiled graph: 18.2 us a call through the custom op,
    9.5 direct, 7.2 eager; SmolLM2 has 151 such layers a step). The bits are the kernel's either way.
    Registered at the first compile of a batch-invariant CPU graph (speculative.cpu_backend), not at
    import: importing Inductor costs every script a second. (int4_rows_cpu: the next function.)"""
    from torch._inductor.lowering import fallback_handler, register_lowering
    kernel = fallback_handler(torch.ops.aten._weight_int8pack_mm.default, add_to_fallback_set=False)
    register_lowering(torch.ops.eagle_gpt_fast.int8_rows, type_promotion_kind=None)(kernel)


@torch.library.custom_op("eagle_gpt_fast::int4_rows_cpu", mutates_args=())
def int4_rows_cpu(x: Tensor, weight: Tensor, groupsize: int, scales_and_zeros: Tensor) -> Tensor:
    """aten._weight_int4pack_mm_for_cpu(x [M, K], packed weight, groupsize, scales_and_zeros
    [K / groupsize, N, 2]) -> [M, N], opaque to Inductor."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, groupsize, scales_and_zeros)


@int4_rows_cpu.register_fake
def _(x, weight, groupsize, scales_and_zeros):
    return x.new_empty(x.size(0), scales_and_zeros.size(1))


@functools.cache
def lower_int4_rows_to_the_kernel():
    """Inductor: compile int4_rows_cpu into a direct call of torch's int4 kernel from the compiled
    code, as lower_int8_rows_to_the_kernel does for int8. A fallback of the op itself would call
    back through Python (torch 2.13's C shim has no entry for _weight_int4pack_mm_for_cpu); Inductor's
    own lowering of that op with ATen as its only backend emits its extern choice instead, a call of
    aoti_torch_cpu__weight_int4pack_mm_cpu_tensor: the same kernel, so the same bits."""
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
        m.weight, m.scales = quantize_int8(linear.weight.detach())
        m.scales = m.scales.to(linear.weight.dtype)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def forward(self, x: Tensor) -> Tensor:
        scales = self.scales.to(x.dtype)
        rows = x.numel() // self.in_features
        if x.is_cpu and x.dtype != torch.float32 and (rows <= CPU_INT8_KERNEL_ROWS or self.row_invariant):
            # torch's CPU kernel for int8 weights reads them as they are: measured 2-5x faster than
            # casting the weight for a few rows (a decode step, a draft level), slower for many rows
            # (tree verification) and in float32. Its rows do not depend on how many there are
            # (1-128 measured, bf16), so batch-invariant mode takes it for every row count: the
            # switch to the cast would round a verify's rows apart from the one-token step's.
            # (Compiled in the mode: Inductor's template, or with AMX the kernel as an opaque op:
            # see INDUCTOR_INT8_ROWS_INVARIANT.)
            opaque = self.row_invariant and torch.compiler.is_compiling() and not INDUCTOR_INT8_ROWS_INVARIANT
            matmul = int8_rows if opaque else torch.ops.aten._weight_int8pack_mm
            y = matmul(x.reshape(-1, self.in_features), self.weight, scales)
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif x.is_cuda and int8_matmul is not None and 1 < rows <= CUDA_INT8_KERNEL_ROWS:
            # several rows on CUDA: cuBLAS would need the weight cast to x.dtype first, every call
            y = int8_matmul(x.reshape(rows, self.in_features), self.weight, self.scales)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            # gpt-fast's form: the int8 -> x.dtype cast (exact) fuses into the matmul's weight load
            # under torch.compile, and the per-channel scale is applied to the few outputs.
            y = F.linear(x, self.weight.to(x.dtype)) * scales
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class WeightOnlyInt8Experts(nn.Module):
    """model.Experts (a mixture-of-experts' stacked weights [E, out, in]) in int8, one scale per
    expert and output channel; the same gathered/dense interface, each computing
    (x @ q^T) * scales like WeightOnlyInt8Linear."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(num_experts, out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_experts, out_features))

    @classmethod
    def from_experts(cls, experts: Experts) -> "WeightOnlyInt8Experts":
        E, out_features, in_features = experts.weight.shape
        m = cls(E, in_features, out_features)
        m.weight, m.scales = quantize_int8(experts.weight.detach())
        m.scales = m.scales.to(experts.weight.dtype)
        return m

    def gathered(self, x: Tensor, experts: Tensor) -> Tensor:
        """x [N, k, in], experts [N, k] -> [N, k, out]."""
        return torch.einsum("nki,nkoi->nko", x, self.weight[experts].to(x.dtype)) * self.scales[experts].to(x.dtype)

    def dense(self, x: Tensor) -> Tensor:
        """x [E, N, in] -> [E, N, out]."""
        return torch.einsum("eni,eoi->eno", x, self.weight.to(x.dtype)) * self.scales[:, None].to(x.dtype)


def set_row_invariant(model: nn.Module, on: bool = True) -> nn.Module:
    """For batch-invariant mode (model.Transformer.invariant_window): quantized layers compute
    each row the same way however many rows come together. On a CPU in bf16, int8 layers then use
    torch's int8 kernel for any number of rows (WeightOnlyInt8Linear.forward); int4 layers already
    use one kernel for every row count there, and it is row-count invariant (measured 1-128 rows).
    Compiled, int8 layers go to Inductor's C++ template (on a CPU with AMX or without AVX2 to the
    kernel as an opaque op, int8_rows: INDUCTOR_INT8_ROWS_INVARIANT), int4 layers to Inductor's int4
    template where it takes them on an AVX-512 CPU without AMX, else to the kernel, called directly
    from the compiled code (int4_rows_cpu; WeightOnlyInt4Linear.template_invariant)."""
    for m in model.modules():
        if isinstance(m, (WeightOnlyInt8Linear, WeightOnlyInt4Linear)):
            m.row_invariant = on
    return model


def prefill_rows(model: nn.Module):
    """A context in which model's int8 layers compute as outside batch-invariant mode: for an eager
    prefill, whose rows no other forward's need to equal (plain and speculative decoding prefill a
    prompt with the same code and shapes, as model.Transformer.forward's attention assumes too).
    In the mode they would take torch's int8 kernel for every row of a prompt, where the cast and a
    bf16 GEMM are faster from 17 rows on (SmolLM2, 200 tokens: a Zen 5 207 against 123 ms, a Zen 4
    591 against 278 ms). While compiling, a context that does nothing: compiled layers are the
    template already (INDUCTOR_INT8_ROWS_INVARIANT), and dynamo would have to trace the flags'
    changes. int4 layers run one kernel eager either way."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _int8_layers_out_of_the_mode(model)


@contextlib.contextmanager
def _int8_layers_out_of_the_mode(model: nn.Module):
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyInt8Linear) and m.row_invariant]
    for m in layers:
        m.row_invariant = False
    try:
        yield
    finally:
        for m in layers:
            m.row_invariant = True


# ---------------------------------------------------------------------------------------------
# int4: asymmetric per group of input columns, packed for torch's int4 matmul kernels
# ---------------------------------------------------------------------------------------------
def _check_groupsize(groupsize: int):
    if groupsize not in GROUPSIZES:
        raise ValueError(f"int4 groupsize must be one of {', '.join(map(str, GROUPSIZES))} "
                         f"(what torch's int4 kernels accept), got {groupsize}")


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """w [out, in] with in % groupsize == 0 -> (q uint8 [out, in] in 0..15, scales_and_zeros
    bfloat16 [in / groupsize, out, 2]) with w ~ (q - 8) * scale + zero per group.

    Scale and zero are rounded to bfloat16 (the CUDA kernel takes nothing else) before q is
    computed from them, so that q is the best code for the parameters actually used."""
    _check_groupsize(groupsize)
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
    """dequantize_int4(unpack_nibbles(nibbles), ...).to(dtype), bit for bit, with the float32 work
    done chunk weights (whole rows) at a time in eager mode. Compiled, the whole layer is one
    expression: Inductor fuses it into one kernel that writes dtype and holds no float32 copy."""
    out_features, in_features = nibbles.size(0), 2 * nibbles.size(1)
    rows = max(1, chunk // in_features)
    if torch.compiler.is_compiling() or rows >= out_features:
        return dequantize_int4(unpack_nibbles(nibbles), scales_and_zeros, groupsize).to(dtype)
    w = torch.empty(out_features, in_features, dtype=dtype, device=nibbles.device)
    for r in range(0, out_features, rows):
        w[r:r + rows] = dequantize_int4(unpack_nibbles(nibbles[r:r + rows]), scales_and_zeros[:, r:r + rows], groupsize)
    return w


def pack_nibbles(q: Tensor) -> Tensor:
    """uint8 [out, in] values 0..15 -> uint8 [out, in / 2], the even column in the high nibble
    (the input layout of aten._convert_weight_to_int4pack since torch 2.5)."""
    return (q[:, ::2] << 4) | q[:, 1::2]


def unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.size(0), -1)


def int4_kernel(device: torch.device):
    """(pack, matmul, compute dtype) for the int4 kernel of this device, or a clear error.

    pack(nibbles uint8 [N, K / 2]) -> the device's packed weight; matmul(x [M, K], packed,
    groupsize, scales_and_zeros [K / groupsize, N, 2]) -> [M, N]. The signatures moved:
    CUDA's _convert_weight_to_int4pack took int32 [N, K] before torch 2.5 and uint8 [N, K / 2]
    since; CPU got its own _for_cpu pair (int32 [N, K] input) in torch 2.6."""
    aten, version = torch.ops.aten, tuple(int(v) for v in torch.__version__.split(".")[:2])
    if device.type == "cpu":
        if not hasattr(aten, "_weight_int4pack_mm_for_cpu"):
            raise ValueError(f"int4 on CPU needs torch >= 2.6 (aten._weight_int4pack_mm_for_cpu); this is "
                             f"torch {torch.__version__}: upgrade torch or use --mode int8")
        # innerKTiles only shapes the CUDA layout; the CPU kernel takes any of 2, 4, 8.
        return (lambda nibbles: aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).int(), 8),
                aten._weight_int4pack_mm_for_cpu, None)  # None: the CPU kernel computes in x's dtype
    if device.type == "cuda":
        if not hasattr(aten, "_weight_int4pack_mm"):
            raise ValueError(f"torch {torch.__version__} has no aten._weight_int4pack_mm: use --mode int8")
        if torch.version.hip is None and torch.cuda.get_device_capability(device) < (8, 0):
            raise ValueError(f"the int4 CUDA kernel needs compute capability >= 8.0 (Ampere or newer); "
                             f"{torch.cuda.get_device_name(device)} has "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}: use --mode int8")
        uint8_input = version >= (2, 5)

        def pack(nibbles):
            K = nibbles.size(1) * 2
            # innerKTiles sets how many 16-column k-tiles a thread reads at once; K must be a multiple
            # of 16 * innerKTiles, so take the largest that divides K (K is a multiple of 32).
            inner_k_tiles = next(t for t in (8, 4, 2) if K % (16 * t) == 0)
            w = nibbles if uint8_input else unpack_nibbles(nibbles).int()
            return aten._convert_weight_to_int4pack(w.contiguous(), inner_k_tiles)
        return pack, aten._weight_int4pack_mm, torch.bfloat16  # the CUDA kernel is bfloat16 only
    raise ValueError(f"int4 weights run on CPU or CUDA, not on {device.type}: use --mode int8")


class WeightOnlyInt4Linear(nn.Module):
    """y = x @ dequant(W)^T + bias with the 4-bit weight read by torch's int4 matmul kernel.

    Sizes the kernels cannot take are padded: in_features up to a multiple of groupsize (zero
    weight columns that meet zero-padded inputs), out_features up to a multiple of 16 (rows whose
    outputs are dropped). The padding is stored in the file and counted in its size.

    weight holds the portable nibbles ([out_pad, in_pad / 2]) until pack() replaces them by the
    device's packed layout; forward needs the packed form. Files are written from unpacked layers
    (quantize_model): a packed layer's state dict is tied to its device and torch version."""

    def __init__(self, in_features: int, out_features: int, groupsize: int, bias: bool = False):
        super().__init__()
        _check_groupsize(groupsize)
        self.in_features, self.out_features, self.groupsize = in_features, out_features, groupsize
        self.in_padded = -(-in_features // groupsize) * groupsize
        self.out_padded = -(-out_features // INT4_N_MULTIPLE) * INT4_N_MULTIPLE
        self.register_buffer("weight", torch.empty(self.out_padded, self.in_padded // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(self.in_padded // groupsize, self.out_padded, 2,
                                                             dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_for: Optional[str] = None  # the device type weight is packed for, None: portable nibbles
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
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def pack(self):
        """Repack the nibbles for the kernel of the device they are on (after .to(device, dtype)).
        On CUDA the nibbles stay too, for more rows than the kernel takes well (forward): the
        layer's int4 weight twice, never a float copy."""
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
        shape = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype)
        if self.in_padded != self.in_features:
            x2 = F.pad(x2, (0, self.in_padded - self.in_features))
        if x.is_cuda and x2.size(0) > CUDA_INT4_KERNEL_ROWS:
            # torch's int4 kernel reads every weight again for each 16-row tile (ceil(M / 16) x 0.5
            # bytes per weight); dequantizing (Inductor fuses it into one kernel) and cuBLAS read
            # the nibbles once and write and read a bf16 weight (~4.5 bytes per weight): by bytes
            # the kernel wins up to ~128 rows, a prefill is better off here.
            w = dequantize_int4_as(self.nibbles, self.scales_and_zeros, self.groupsize, x2.dtype)
            y = F.linear(x2, w)[:, :self.out_features]
        else:
            matmul = self._matmul
            if self.row_invariant and x.is_cpu and torch.compiler.is_compiling() and not self.template_invariant():
                matmul = int4_rows_cpu  # the kernel itself, never the template (lower_int4_rows_to_the_kernel)
            y = matmul(x2, self.weight, self.groupsize, self.scales_and_zeros)[:, :self.out_features]
        y = y.to(x.dtype).reshape(*shape, self.out_features)
        return y if self.bias is None else y + self.bias

    def template_invariant(self) -> bool:
        """Whether Inductor's int4 template computes this layer, compiled on this CPU, with rows
        that do not depend on the row count (INDUCTOR_INT4_ROWS_INVARIANT and a shape it takes)."""
        return (INDUCTOR_INT4_ROWS_INVARIANT and self.groupsize in INT4_TEMPLATE_GROUPSIZES
                and self.out_padded % INT4_TEMPLATE_N_MULTIPLE == 0 and self.scales_and_zeros.dtype == torch.bfloat16)

    def extra_repr(self) -> str:
        pad = f", padded to ({self.in_padded}, {self.out_padded})" if self.padded else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"groupsize={self.groupsize}, bias={self.bias is not None}{pad}")


def pack_int4(model: nn.Module) -> nn.Module:
    """Pack every int4 layer for the device it is on; call after model.to(device, dtype)."""
    for m in model.modules():
        if isinstance(m, WeightOnlyInt4Linear):
            m.pack()
    return model


# ---------------------------------------------------------------------------------------------
# Whole models: quantize in memory, and rebuild the quantized structure before loading a file
# ---------------------------------------------------------------------------------------------
def _swap_linears(model: nn.Module, make, kind=nn.Linear) -> list:
    """Replace each nn.Linear (or module of type kind) `lin` named `name` for which make(name, lin)
    gives a module; returns the names."""
    swapped = []
    for name, lin in list(model.named_modules()):
        if isinstance(lin, kind):
            new = make(name, lin)
            if new is not None:
                model.set_submodule(name, new)
                swapped.append(name)
    return swapped


def quantize_model(model: nn.Module, mode: str, groupsize: int = 32) -> list:
    """Replace every nn.Linear of model (a Transformer or an EagleDraft) by its int8 or int4
    version, in place; int4 layers stay unpacked (pack_int4 packs them for their device).
    Returns lines that say what was done. int8 also quantizes a mixture-of-experts' expert stacks
    (model.Experts); the embedding table and norms stay as they are, and so do the expert stacks
    in int4."""
    if mode == "int8":
        swapped = _swap_linears(model, lambda name, lin: WeightOnlyInt8Linear.from_linear(lin))
        stacks = _swap_linears(model, lambda name, e: WeightOnlyInt8Experts.from_experts(e), kind=Experts)
        notes = [f"int8 (per-channel): {len(swapped)} linear layers" + (f", {len(stacks)} expert stacks" if stacks else "")]
    elif mode == "int4":
        swapped = _swap_linears(model, lambda name, lin: WeightOnlyInt4Linear.from_linear(lin, groupsize))
        notes = [f"int4 (groupsize {groupsize}): {len(swapped)} linear layers"]
        padded = {}
        for name in swapped:
            m = model.get_submodule(name)
            if m.padded:
                key = f"[{m.out_features}, {m.in_features}] -> [{m.out_padded}, {m.in_padded}]"
                padded.setdefault(key, []).append(name)
        for key, names in padded.items():
            notes.append(f"  padded {key} with zeros: {_summarize(names)}")
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
    m = re.search(r"_int4\.g(\d+)\.", name)
    if m:
        return "int4", int(m.group(1))
    return None, None


def quantized_path(path, mode: str, groupsize: int) -> Path:
    """model.pth -> model_int8.pth / model_int4.g32.pth (draft.safetensors likewise)."""
    path = Path(path)
    tag = "int8" if mode == "int8" else f"int4.g{groupsize}"
    return path.with_name(f"{path.stem}_{tag}{path.suffix}")


def prepare_for_loading(model: nn.Module, state_dict: dict, path) -> nn.Module:
    """Before model.load_state_dict(state_dict, assign=True) on a (meta-device) model: give each
    nn.Linear that the file holds quantized an empty quantized module of the same shape. Which
    layers are quantized, and the int4 groupsize, are read off the file's tensors; the file's name
    must say the same (gpt-fast naming), so that a float file named model_int8.pth, or an int4 file
    renamed model.pth, is an error rather than a silent mix-up. Follow the load with pack_int4."""
    found = set()

    def make(name, lin):
        if f"{name}.scales" in state_dict:
            found.add(("int8", None))
            return WeightOnlyInt8Linear(lin.in_features, lin.out_features, lin.bias is not None)
        if f"{name}.scales_and_zeros" in state_dict:
            groupsize = 2 * state_dict[f"{name}.weight"].size(1) // state_dict[f"{name}.scales_and_zeros"].size(0)
            found.add(("int4", groupsize))
            return WeightOnlyInt4Linear(lin.in_features, lin.out_features, groupsize, lin.bias is not None)
        return None

    def make_experts(name, experts):  # a mixture-of-experts' stacked weights, int8 only
        if f"{name}.scales" in state_dict:
            found.add(("int8", None))
            E, out_features, in_features = experts.weight.shape
            return WeightOnlyInt8Experts(E, in_features, out_features)
        return None

    with torch.device("meta"):
        _swap_linears(model, make)
        _swap_linears(model, make_experts, kind=Experts)
    named = mode_from_path(path)
    if found != ({named} if named[0] else set()):
        holds = ", ".join(_mode_name(*m) for m in sorted(found, key=str)) or "float"
        raise ValueError(f"{Path(path).name} holds {holds} weights but its name says {_mode_name(*named)}: "
                         f"quantize.py names its files like model_int8.pth and model_int4.g32.pth")
    return model


def _mode_name(mode, groupsize) -> str:
    return "float" if mode is None else mode if mode == "int8" else f"int4 groupsize {groupsize}"


# ---------------------------------------------------------------------------------------------
# Command line. Everything above depends on model.py alone; the command reads and writes files
# through checkpoint.py (which builds on the layers above), imported where it is used so that
# importing this module never pulls it in.
# ---------------------------------------------------------------------------------------------
def quantize_checkpoint(path, mode: str, groupsize: int = 32, force: bool = False) -> Path:
    """model.pth -> model_int8.pth / model_int4.gNN.pth beside it; returns the new path."""
    from checkpoint import load_model

    path = Path(path)
    if mode_from_path(path)[0] is not None:
        raise ValueError(f"{path.name} is already quantized: quantize the float model.pth")
    out = quantized_path(path, mode, groupsize)
    _refuse_to_overwrite(out, force)
    model = load_model(path, "cpu", dtype=None)  # dtype None: the float parts keep the file's dtype
    for line in quantize_model(model, mode, groupsize):
        print(line)
    if model.config.tie_embeddings:
        print("  tied LM head: quantized as its own copy; tok_embeddings.weight stays in float")
    torch.save(model.state_dict(), out)
    _report_written(out, path)
    return out


def quantize_draft(path, mode: str, groupsize: int = 32, force: bool = False) -> Path:
    """An EAGLE draft folder (or its draft.safetensors) -> draft_int8.safetensors /
    draft_int4.gNN.safetensors in the same folder; returns the new path."""
    from safetensors.torch import save_file

    from checkpoint import DRAFT_WEIGHTS, draft_files, load_draft

    _, _, weights = draft_files(path)
    if mode_from_path(weights)[0] is not None:
        raise ValueError(f"{weights.name} is already quantized: quantize the float {DRAFT_WEIGHTS}")
    out = quantized_path(weights, mode, groupsize)
    _refuse_to_overwrite(out, force)
    draft = load_draft(weights)  # no target at hand to check it against
    for line in quantize_model(draft, mode, groupsize):
        print(line)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(out))
    _report_written(out, weights)
    return out


def _refuse_to_overwrite(path: Path, force: bool):
    if path.exists() and not force:
        raise FileExistsError(f"refusing to overwrite {path}: pass --force to replace it")


def _report_written(out: Path, source: Path):
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; {source.name}: {source.stat().st_size / 1e6:.1f} MB)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct/model.pth"),
                   help="model.pth; with --draft, an EAGLE draft folder or its draft.safetensors")
    p.add_argument("--mode", choices=["int8", "int4"], required=True)
    p.add_argument("--groupsize", type=int, default=None,
                   help=f"int4: input columns per scale/zero, one of {', '.join(map(str, GROUPSIZES))} (default 32)")
    p.add_argument("--draft", action="store_true", help="quantize an EAGLE draft instead of a target model")
    p.add_argument("--force", action="store_true", help="overwrite an existing quantized file")
    args = p.parse_args(argv)
    if args.groupsize is not None and args.mode != "int4":
        p.error("--groupsize applies to --mode int4 only")
    groupsize = 32 if args.groupsize is None else args.groupsize
    try:
        if args.mode == "int4":
            _check_groupsize(groupsize)
        quantize = quantize_draft if args.draft else quantize_checkpoint
        return quantize(args.checkpoint_path, args.mode, groupsize, args.force)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
