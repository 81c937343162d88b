"""The Triton kernels of gpu_kernels/ fit the GPUs we target: every launch configuration the host code
chooses (tree_attention, int8_matmul, and batch-invariant mode's linear, norm and attention in
gpu_kernels/invariant.py) for a representative set of shapes and dtypes compiles ahead of time for
sm_80, sm_86 and sm_90 with Triton's CUDA backend, within the GPU's per-block shared memory and
within the bound the host code chose it by (shared_bytes). No GPU needed; skips where Triton
cannot compile for NVIDIA GPUs. The launches compile to PTX: Triton fixes a block's shared memory
when it lowers to LLVM, and ptxas, two thirds of a compile's time, only assembles the PTX; the
kernels with a float argument go through the ptxas Triton ships as well (registers, spills).
sm_89 (Ada) is not compiled apart: it has sm_86's limit, so the host code chooses it the same
launches, and Triton lowers both through the same Ampere path (mma v2), so their blocks take the
same shared memory (checked launch by launch when sm_89 left the set); for the same reason a
launch that sm_80 and sm_86 both choose compiles once.

The launches are gathered by running the host functions on meta tensors with each kernel replaced
by a recorder, under each GPU's shared-memory limit. The compiles run in a fresh interpreter (this
file run as a script) with Triton's interpreter off: the test session runs the kernels in the
interpreter (TRITON_INTERPRET=1, tests/conftest.py), which patches triton.language for the process.
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_90": (9, 0)}


def unavailable() -> str:
    """Why this machine cannot compile for an NVIDIA GPU ahead of time, or "" when it can."""
    try:
        import triton
        from triton.backends import backends
    except ImportError as e:
        return f"triton is not importable ({e})"
    if "nvidia" not in backends or not hasattr(triton, "knobs"):
        return f"Triton {triton.__version__} has no CUDA backend or no triton.knobs (3.4 or newer)"
    try:
        ptxas = triton.knobs.nvidia.ptxas
    except Exception as e:  # noqa: BLE001 - whatever a Triton without its ptxas raises
        return f"no ptxas ({type(e).__name__}: {e})"
    return "" if ptxas is not None and os.path.exists(ptxas.path) else "Triton finds no ptxas"


# ---------------------------------------------------------------------------------------------
# Run in the fresh interpreter: gather launches, compile them
# ---------------------------------------------------------------------------------------------
class Launch(NamedTuple):
    module: object  # the kernels module
    kernel: str     # the @triton.jit function's name
    args: tuple     # as passed (meta tensors: only their dtype reaches the compiler)
    kwargs: dict    # constexprs, num_warps, num_stages

    def describe(self) -> str:
        """The kernel, its tensors' dtypes (in order of first use) and its constants, e.g.
        tree_attention bfloat16/int64/bool/float32: [('BLOCK_D', 128), ...]."""
        dtypes = dict.fromkeys(str(a.dtype).replace("torch.", "") for a in self.args if isinstance(a, torch.Tensor))
        consts = sorted((k, v > 1 if k == "N_SPLITS" else v) for k, v in self.kwargs.items())
        return f"{self.kernel.strip('_').removesuffix('_kernel')} {'/'.join(dtypes)}: {consts}"


class Recorder:
    """Stands for a kernel: kernel[grid](*args, **kwargs) appends a Launch to sink."""

    def __init__(self, sink: list, module, kernel: str):
        self.sink, self.module, self.kernel = sink, module, kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append(Launch(self.module, self.kernel, args, kwargs))


@contextlib.contextmanager
def recording(limit: int):
    """Inside, the kernels' launches are recorded (into the list yielded), not run; the host code
    takes meta tensors and sees `limit` bytes of shared memory per block."""
    import triton

    from gpu_kernels import int8_matmul, invariant, tree_attention
    launches = []
    with contextlib.ExitStack() as stack:
        for module in (tree_attention, int8_matmul, invariant):
            stack.enter_context(mock.patch.object(module, "INTERPRETED", True))  # any device passes the checks
            for name, value in vars(module).items():
                if name.endswith("_kernel") and isinstance(value, triton.runtime.JITFunction):
                    stack.enter_context(mock.patch.object(module, name, Recorder(launches, module, name)))
        for module in (tree_attention, int8_matmul):
            stack.enter_context(mock.patch.object(module, "shared_memory_limit", lambda device: limit))
        yield launches


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def gather(limit: int) -> list:
    """The launches of the representative set under a shared-memory limit, one of each resource
    class: kernel, dtypes and constants (the integers Triton specializes on, and how many shares a
    split launch has, do not change what a block needs)."""
    from gpu_kernels import int8_matmul, invariant, tree_attention
    long, bool_, bf16, f32 = dict(dtype=torch.long), dict(dtype=torch.bool), torch.bfloat16, torch.float32
    linear = invariant.invariant_linear._init_fn  # the op's own function: a meta tensor would reach its fake
    with recording(limit) as launches:
        for dt in (bf16, f32):
            # verifies of T tree nodes, (query heads, KV heads, head_dim) of LLaMA-2-7B, LLaMA-3-8B
            # and SmolLM2-135M, in a cache long enough to split the prefix (the merge runs too)
            for H, KV, D in ((32, 32, 128), (32, 8, 128), (9, 3, 64)):
                for T in (2, 16, 60, 128):
                    tree_attention.tree_attention(meta(1, H, T, D, dtype=dt), meta(1, KV, 4096, D, dtype=dt),
                                                  meta(1, KV, 4096, D, dtype=dt), meta(1, **long),
                                                  meta(1, T, T, **bool_))
            for M in (2, 33, 65, 128):  # int8 layers: each row block up to the kernel's range
                int8_matmul.int8_matmul(meta(M, 4096, dtype=dt), meta(4096, 4096, dtype=torch.int8),
                                        meta(4096, dtype=dt))
            # batch-invariant mode: a wide layer (one pass) with a bias, a narrow one (split-K: a sum
            # launch, or the sum folded in, with the block's norm fused), int8 and int4 weights
            wide, narrow = meta(60, 576, dtype=dt), meta(60, 1536, dtype=dt)
            linear(wide, meta(49152, 576, dtype=dt), meta(49152, dtype=dt))
            linear(narrow, meta(576, 1536, dtype=dt))
            linear(wide, meta(49152, 288, dtype=torch.uint8), None, meta(18, 49152, 2, dtype=dt), 32)
            with mock.patch.object(invariant, "LINEAR_FOLD_SPLITS", True):
                linear(narrow, meta(576, 1536, dtype=dt), None, None, 0, meta(1536, dtype=dt), 1e-5)
            if dt == bf16:
                linear(narrow, meta(576, 1536, dtype=torch.int8), None, meta(576, dtype=dt))
                with mock.patch.object(invariant, "LINEAR_FOLD_SPLITS", True):
                    linear(narrow, meta(576, 768, dtype=torch.uint8), None, meta(48, 576, 2, dtype=dt), 32)
            invariant.rms_norm._init_fn(meta(60, 8192, dtype=dt), meta(8192, dtype=dt), 1e-5)
            for D in (64, 128):  # window attention over a cache of 1024 slots, in chunks
                invariant._window_attention._init_fn(meta(1, 8, 16, D, dtype=dt), meta(1, 4, 1024, D, dtype=dt),
                                                     meta(1, 4, 1024, D, dtype=dt), meta(1, 16, **long),
                                                     meta(1, 16, 33, **long), meta(1, 16, 33, **bool_))
    return list({launch.describe(): launch for launch in launches}.values())


@contextlib.contextmanager
def ptx_only():
    """Inside, Triton's CUDA backend stops at PTX (no cubin stage, the PTX stands for the binary)."""
    from triton.backends.nvidia.compiler import CUDABackend
    add_stages, init = CUDABackend.add_stages, CUDABackend.__init__

    def stages_to_ptx(self, stages, options, language):
        add_stages(self, stages, options, language)
        del stages["cubin"]

    def init_ptx(self, target):
        init(self, target)
        self.binary_ext = "ptx"

    with mock.patch.object(CUDABackend, "add_stages", stages_to_ptx), \
            mock.patch.object(CUDABackend, "__init__", init_ptx):
        yield


def compile_launch(launch: Launch, capability: tuple, float_args: str = "fp32", ptxas_log: bool = False) -> dict:
    """The launch compiled for the GPU of this compute capability: shared (bytes), with ptxas_log
    registers and spill stores (bytes; a fresh compile through ptxas, which prints them; without,
    the compile stops at PTX); or error. float_args: the type of the kernel's Python float
    arguments; a direct launch passes them as fp32, a torch.compile'd graph as fp64 on CUDA."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    jit = getattr(launch.module, launch.kernel)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    backend = make_backend(target)
    # Triton's launch-time specialization, with tensors of the launch's dtypes at aligned addresses
    bind = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = bind(*[MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a
                                            for a in launch.args], **launch.kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, launch.kwargs, bound, specialization, options)
    signature = {name: float_args if kind == "fp32" else kind for name, kind in signature.items()}  # scalars only
    log = io.StringIO()
    try:
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log), \
                (contextlib.nullcontext() if ptxas_log else ptx_only()):
            knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = ptxas_log
            compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                      options=vars(options))
    except Exception as e:  # noqa: BLE001 - a compile error is a result here
        return dict(error=f"{type(e).__name__}: {str(e).strip()[:300]}")
    result = dict(shared=compiled.metadata.shared)
    if ptxas_log:
        regs = re.search(r"Used (\d+) registers", log.getvalue())
        spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
        result.update(registers=int(regs.group(1)) if regs else None, spill_stores=int(spills.group(1)) if spills else 0)
    return result


def host_bound(launch: Launch):
    """The shared memory the host code assumed when it chose the launch (its module's shared_bytes)."""
    from gpu_kernels import int8_matmul, tree_attention
    kw, elem = launch.kwargs, launch.args[0].dtype.itemsize
    if launch.kernel == "_tree_attention_kernel":
        return tree_attention.shared_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_D"], kw["num_stages"], elem)
    if launch.kernel == "_int8_matmul_kernel":
        return int8_matmul.shared_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_stages"], elem)
    return None


def report() -> dict:
    """What the tests check, as JSON: each target's launches compiled; the int8 kernel's former
    constants for 65-128 bf16 rows on sm_80 and sm_86; the kernels with a float argument compiled
    for sm_90 with it typed fp32 and fp64."""
    from gpu_kernels import int8_matmul, tree_attention
    limits = tree_attention.SHARED_MEMORY_PER_BLOCK
    rows, results = [], {}
    for name, capability in TARGETS.items():
        for launch in gather(limits[capability]):
            # sm_80 and sm_86 lower through the same Ampere path: a launch both choose compiles once
            # (40 of 41 here; compiled for both, each took the same shared memory)
            key = (capability[0], launch.describe())
            if key not in results:
                results[key] = compile_launch(launch, capability)
            rows.append(dict(target=name, limit=limits[capability], launch=launch.describe(), bound=host_bound(launch),
                             **results[key]))
    old = Launch(int8_matmul, "_int8_matmul_kernel", (meta(100, 4096), meta(4096, 4096, dtype=torch.int8), meta(4096),
                                                      meta(100, 4096), 100, 4096, 4096, 4096, 4096, 4096),
                 dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4))
    over = {name: compile_launch(old, TARGETS[name])["shared"] for name in ("sm_80", "sm_86")}
    floats = {}  # one launch of each kernel with a float argument, in bfloat16 and float32, head_dim 128
    for launch in gather(limits[9, 0]):
        if launch.kernel in ("_tree_attention_kernel", "_rms_norm_kernel", "_window_attention_kernel",
                             "_window_chunk_kernel") and launch.kwargs.get("D", 128) == 128:
            floats.setdefault((launch.kernel, launch.args[0].dtype), launch)
    fp64 = [dict(launch=launch.describe(), **{kind: compile_launch(launch, (9, 0), kind, ptxas_log=True)
                                              for kind in ("fp32", "fp64")}) for launch in floats.values()]
    return dict(rows=rows, over=over, over_bound=int8_matmul.shared_bytes(128, 32, 128, 4, 2), fp64=fp64)


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------
pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no ahead-of-time CUDA compilation: {unavailable()}")


@pytest.fixture(scope="session")
def compiled(build_once):  # a session's, not a module's: pytest-xdist workers share it
    def build(folder):
        # a cache of its own: a PTX-only compile must never stand in for a real one
        done = subprocess.run([sys.executable, __file__], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(folder / "triton")})
        assert done.returncode == 0, done.stderr[-3000:]
        (folder / "report.json").write_text(done.stdout)
    return json.loads((build_once("kernel_fit", build) / "report.json").read_text())


@pytest.mark.parametrize("target", TARGETS)
def test_every_launch_compiles_within_the_limit_and_the_host_bound(compiled, target):
    rows = [r for r in compiled["rows"] if r["target"] == target]
    kernels = {r["launch"].split()[0] for r in rows}
    assert kernels == {"tree_attention", "merge", "int8_matmul", "linear", "linear_partial", "split_sum", "rms_norm",
                       "window_attention", "window_chunk"}
    assert [r for r in rows if "error" in r] == []
    assert [r for r in rows if r["shared"] > r["limit"]] == []
    assert [r for r in rows if r["bound"] is not None and r["shared"] > r["bound"]] == []
    assert sum(r["bound"] is not None for r in rows) > 10


def test_the_set_holds_the_launches_that_once_did_not_fit(compiled):
    """What once went over sm_86's limit is in the set, in its current form: int8 of 65-128 rows
    in bfloat16 and float32, the float32 tree kernel, the 16-bit one at head_dim 128."""
    launches = [r["launch"] for r in compiled["rows"] if r["target"] == "sm_86"]

    def has(*words):
        return any(all(w in launch for w in words) for launch in launches)

    assert has("int8_matmul bfloat16", "('BLOCK_M', 128)") and has("int8_matmul float32", "('BLOCK_M', 64)")
    assert has("tree_attention float32", "('D', 128)") and has("tree_attention float32", "('D', 64)")
    assert has("tree_attention bfloat16", "('D', 128)", "('BLOCK_M', 64)") and has("merge float32/int64/bfloat16")


def test_the_check_catches_a_launch_over_the_limit(compiled):
    """The int8 kernel's constants as once launched for 65-128 rows of bfloat16 (128 x 128 x 4
    stages) compile over sm_86's limit and within sm_80's, and within the host's bound."""
    limits = {name: next(r["limit"] for r in compiled["rows"] if r["target"] == name) for name in ("sm_80", "sm_86")}
    assert limits["sm_86"] < compiled["over"]["sm_86"] <= compiled["over_bound"]
    assert compiled["over"]["sm_80"] <= limits["sm_80"]


def test_float_arguments_typed_fp64_as_torch_compile_passes_them(compiled):
    """Inside a torch.compile'd graph Inductor passes a kernel's Python float arguments as fp64 on
    CUDA (once, a compiled round's tree attention failed to compile so on a GPU). Every kernel with
    a float argument (the attention kernels' scale, the norm's eps) compiles with it, within the
    fp32-typed launch's shared memory and without spills (the kernels cast it to float32 first)."""
    assert len(compiled["fp64"]) >= 6
    for r in compiled["fp64"]:
        assert "error" not in r["fp32"] and "error" not in r["fp64"], r
        assert r["fp64"]["shared"] == r["fp32"]["shared"] and r["fp64"]["spill_stores"] == 0, r


if __name__ == "__main__":  # the fresh interpreter of the fixture `compiled`
    sys.path.insert(0, str(ROOT))
    print(json.dumps(report()))
