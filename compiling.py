"""torch.compile, per device: the decode step and a speculative round each become one graph.

On CUDA, Inductor with "triton.cudagraphs" (all that mode="reduce-overhead" sets), so a round or
a step replays as one CUDA graph. On a CPU, cpu_backend applies the CPU inference settings while a
graph compiles and keys Inductor's disk cache by the weights, so a later process loads what an
earlier one compiled. Settings are per function, so graphs compiled in one process keep their own.
"""
import functools
import hashlib
import importlib
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

import tp
from cpu import onednn_gemms
from quantize import has_quantized, lower_int4_rows_to_the_kernel, lower_int8_rows_to_the_kernel

# The decode step: gpt-fast's settings. A round: no coordinate descent, which would tune every kernel
# of a graph of thousands of nodes. The FX graph cache lets another process load a compiled graph.
STEP_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True, "fx_graph_cache": True}
ROUND_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": False, "fx_graph_cache": True}
PREFILL_OPTIONS = {"coordinate_descent_tuning": False, "fx_graph_cache": True}

# Inductor's settings for inference on a CPU (speeds: benchmarks/RESULTS.md, "CPU dtype"):
#   freezing      weights become graph constants, which the C++ GEMM templates need
#   max_autotune  C++ GEMM templates (weights packed once at compile time) timed against ATen's
#                 kernel per GEMM shape; they win decoding's small-M GEMMs
#   cpp_wrapper   the graph's host code in C++ instead of Python: a step makes hundreds of calls
# Dynamo reads the freezing flag while it traces, too early for a per-function option, so it is set
# around every call of a compiled function (frozen()) and the rest around compile_fx (cpu_backend).
CPU_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                "coordinate_descent_tuning": False, "fx_graph_cache": True, "cpp_wrapper": True}
# ... and in batch-invariant mode (invariant.py), where a token's row must be the same from a step
# and a verify (without either setting, the two graphs' rows differ from layer 0 on):
#   CPP only               autotuning would pick ATen's GEMM for some row counts and the template for
#                          others (following timing noise), which round differently
#   emulate_precision_casts  a fused kernel otherwise keeps a 16-bit intermediate in float32, and
#                          what fuses depends on shapes (a verify's residual add into a GEMM epilogue)
CPU_INVARIANT = {"max_autotune_gemm_backends": "CPP", "emulate_precision_casts": True}
# ... and where gemms_on_onednn, mode or not, ATen's (oneDNN's at run time; autotuning times with it off)
CPU_ONEDNN = {"max_autotune_gemm_backends": "ATEN"}
# The version of quantize's lowerings a batch-invariant CPU graph uses: bump it when they change.
INVARIANT_LOWERINGS = 2
# Keep autotuning from printing each GEMM's candidates and timings (where this torch has the flags).
CPU_QUIET = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
# What cpu_backend uses, so that a torch without one gets a clear message, not a compiler traceback
# (not compile_fx, in every torch 2: importing it is slow, and a run from packages never needs it).
CPU_COMPILE_NEEDS = (("torch._inductor.config", "freezing"), ("torch._inductor.config", "max_autotune_gemm_backends"),
                     ("torch._inductor.config", "fx_graph_cache"), ("torch.compiler.config", "cache_key_tag"),
                     ("torch.backends.mkldnn", "flags"))


def missing_cpu_compile_settings() -> list:
    """The names of CPU_COMPILE_NEEDS this torch lacks."""
    missing = []
    for module, attribute in CPU_COMPILE_NEEDS:
        try:
            getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attribute}")
    return missing


def compile_step(step, device: str, model: nn.Module):
    """A decode step as one graph; every timed plain decoding comes here, so none lacks CUDA graphs."""
    set_tensor_parallel_flags()
    options = dict(STEP_OPTIONS, coordinate_descent_tuning=str(device).startswith("cuda") and not tp.active())
    return compile_function(step, device, (model,), options=options)


def compile_prefill(prefill, device: str, model: nn.Module):
    """Prefill (generate.prefill's signature): prompts vary in length, so dynamic shapes, no CUDA graphs."""
    return compile_function(prefill, device, (model,), dynamic=True, options=PREFILL_OPTIONS)


def compile_round(spec, compile_prefill: bool = False, backend="inductor"):
    """A Speculator's round as one static-shape graph; the plain step and adaptive decoding's flush
    are graphs of their own, compiled at their first call. Every Speculator compiles its own graph
    of the same code, and dynamo keeps at most recompile_limit graphs per code object: a process that
    compiles more rounds raises the limit, as scripts/benchmark.py does."""
    set_tensor_parallel_flags()
    device = spec.target.norm.weight.device
    modules = (spec.target,) if spec.draft is None else (spec.target, spec.draft)
    for name in ("round", "plain_step", "flush"):
        setattr(spec, name, compile_function(getattr(spec, name), device, modules, options=ROUND_OPTIONS,
                                             backend=backend))
    if compile_prefill:  # prompts vary in length: dynamic shapes, no CUDA graphs; setup stays eager
        spec.read_prompt = compile_function(spec.read_prompt, device, modules, dynamic=True,
                                            options=PREFILL_OPTIONS, backend=backend)
    return spec


def compile_function(fn, device, modules, *, dynamic: bool = False, options: Optional[dict] = None,
                     backend="inductor"):
    """torch.compile of fn, fullgraph (a break would split it around a host sync): on a CPU through
    cpu_backend(*modules), elsewhere Inductor with options; the tests pass another backend."""
    if backend != "inductor":
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    if str(device) == "cpu":
        missing = missing_cpu_compile_settings()
        if missing:
            raise RuntimeError(f"compiling for a CPU needs {', '.join(missing)}, which torch {torch.__version__} "
                               f"lacks: upgrade torch or run without --compile")
        return frozen(torch.compile(fn, backend=cpu_backend(*modules), fullgraph=True, dynamic=dynamic,
                                    options={"guard_filter_fn": frozen_graph_guards}))
    if batch_invariant(modules):
        # batch-invariant: 16-bit intermediates rounded whatever fuses (as CPU_INVARIANT on a CPU)
        options = dict(options or {}, emulate_precision_casts=True)
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, options=options)


def set_tensor_parallel_flags():
    """Under tensor parallelism, no kernel choice by timing: ranks could pick kernels that round apart."""
    if tp.active() and hasattr(torch._inductor.config, "deterministic"):
        torch._inductor.config.deterministic = True


def batch_invariant(modules) -> bool:
    """Whether a target in batch-invariant mode (invariant.enable) is among the modules or in one (a Speculator)."""
    return any(getattr(m, "invariant_window", None) is not None for module in modules for m in module.modules())


def weights_digest(*modules: nn.Module) -> str:
    """A digest of the modules' state dicts, for Inductor's cache key: the key covers frozen weights
    by shape only while the entry stores their packed copies, so another checkpoint of the same
    shapes would silently run on the first one's weights."""
    h = hashlib.blake2b(digest_size=16)
    seen = set()
    for module in modules:
        for name, t in module.state_dict().items():
            if t.data_ptr() in seen:  # a tied weight, once
                continue
            seen.add(t.data_ptr())
            h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


def render_templates_from_cache():
    """Inductor turns the jinja2 source of its C++ GEMM templates into a Template again at every
    render, several times per GEMM (RESULTS.md, "Start-up"); the sources are constant strings, so
    each is turned once per process. Where this torch has no such method, nothing changes."""
    from torch._inductor.codegen.common import KernelTemplate
    method = KernelTemplate.__dict__.get("_template_from_string")
    if isinstance(method, staticmethod) and not hasattr(method.__func__, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(method.__func__))


def gemms_on_onednn(modules) -> bool:
    """Whether the modules' compiled CPU graphs call oneDNN for GEMMs (cpu.onednn_gemms; no quantized layer)."""
    return not has_quantized(*modules) and any(isinstance(m, nn.Linear) and onednn_gemms(m.weight.dtype)
                                               for module in modules for m in module.modules())


def cpu_settings(modules) -> dict:
    """CPU_INDUCTOR, CPU_QUIET where this torch has them, CPU_INVARIANT in batch-invariant mode and
    CPU_ONEDNN where the GEMMs go to oneDNN."""
    settings = dict(CPU_INDUCTOR, **{k: v for k, v in CPU_QUIET.items() if hasattr(torch._inductor.config, k)})
    settings = dict(settings, **CPU_INVARIANT) if batch_invariant(modules) else settings
    return dict(settings, **CPU_ONEDNN) if gemms_on_onednn(modules) else settings


def cpu_backend(*modules: nn.Module):
    """A torch.compile backend for the modules' graphs on a CPU: Inductor with cpu_settings, its
    cache keyed by weights_digest, oneDNN off while compiling: freezing's pre-packing would make
    oneDNN tensors, which cannot be pickled, so every process would recompile (the C++ templates
    pack their own weights into plain tensors). The pass registers once per process, on the first
    frozen compile, so every one must come here."""
    from torch._inductor.compile_fx import compile_fx
    render_templates_from_cache()
    tag = weights_digest(*modules)
    settings = cpu_settings(modules)
    if batch_invariant(modules):
        missing = [k for k in CPU_INVARIANT if not hasattr(torch._inductor.config, k)]
        if missing:
            raise RuntimeError(f"batch-invariant compiling needs torch._inductor.config.{', '.join(missing)}, which "
                               f"torch {torch.__version__} lacks: upgrade torch or run without --compile")
        lower_int8_rows_to_the_kernel()  # only a batch-invariant graph calls int8_rows
        lower_int4_rows_to_the_kernel()  # ... and int4_rows_cpu
        # the cache key does not cover these lowerings, so their version keys it too
        tag += f"-lowerings-{INVARIANT_LOWERINGS}"

    def backend(gm, example_inputs):
        with torch._inductor.config.patch(settings), torch.compiler.config.patch(cache_key_tag=tag), \
                warnings.catch_warnings():
            # mkldnn.flags() warns that TF32 needs an Intel GPU every time it is entered: noise
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
            with torch.backends.mkldnn.flags(enabled=False):
                return compile_fx(gm, example_inputs)
    return backend


def frozen_graph_guards(entries) -> list:
    """The guards a frozen CPU graph keeps (guard_filter_fn): all but those inside submodules other
    than on their buffers. A frozen graph holds its weights as constants, so a guard on a parameter
    (of thousands checked every call) could only recompile for a weight it no longer reads. Not seen:
    a submodule replaced or hooked after compiling; compile after changing a model."""
    return ["._modules[" not in e.name or "._buffers[" in e.name for e in entries]


def frozen(compiled):
    """compiled, called with freezing on: dynamo may trace at any call, and reads the flag then."""
    def call(*args, **kwargs):
        # no_grad: freezing leaves a training graph alone (no templates, which batch-invariant mode needs)
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(*args, **kwargs)
    return call


def device_sync(device):
    """Wait for the device's queued work, so that a timer measures it (a no-op on the CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def cuda_graph(fn: Callable[[], None]) -> Callable[[], None]:
    """fn, which must touch its tensors in place and never sync with the host (a round, a decode
    step), run once to warm up and captured in a CUDA graph; calling the result replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: lazy initialisation, the allocator
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
