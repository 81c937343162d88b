"""Every Triton launch the project's host code chooses, compiled ahead of time for GPUs this
machine does not have: shared memory against each GPU's per-block limit, registers and spills.

    python scripts/kernel_fit.py --out benchmarks/kernel_fit     the full sweep: OUT.md and OUT.json
    python scripts/kernel_fit.py --quick                         the representative set of the tests

Launches are gathered by running the host code itself on the meta device (shapes without memory,
no GPU): speculative rounds of every named model config (model.transformer_configs) at every
tensor-parallel degree 1-8 it divides, in bfloat16, float16 and float32, with caches for prefixes
up to 8k, EAGLE-1/2/3 trees (draft levels and verify) and verifies of 2-128 tree nodes; int8
layers of every shape those models have at 2-128 rows (quantize.py's kernel range); and the
settings scripts/tune_kernels.py sweeps. The kernels of tree_attention.py and int8_matmul.py are
replaced by recorders while it runs, and the host code sees the shared-memory limit of the GPU
being checked (tree_attention.SHARED_MEMORY_PER_BLOCK), as it would read it from the device.

Identical launches are counted, not kept; what a model group's host code launches depends on
the shared-memory limit only (sm_86 and sm_89 share theirs), so the model code runs once and each
call of a host function runs once per limit (recording); each group's launches are saved per
limit under --cache_dir, keyed by the source of the code that ran (GATHER_SOURCES): a stopped
sweep resumes where it stopped.

The launches fall into resource classes: Triton's own specialization key (argument types, the
integers it specializes on, constants, warps, stages), what one compiled binary serves. Each class
is compiled for each target with triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))
and the ptxas Triton ships: compiled.metadata.shared is exactly what Triton compares with the
device's limit before it raises OutOfResources at launch, and ptxas -v gives registers and spills.
A launch fits when its class compiles and its shared memory is within the limit; the bound the
host code chooses by (shared_bytes of each kernel module) is checked to hold as well.
"""
import argparse
import contextlib
import hashlib
import importlib.util
import inspect
import io
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import int8_matmul  # noqa: E402
import model  # noqa: E402
import quantize  # noqa: E402
import speculative  # noqa: E402
import tp  # noqa: E402
import tree_attention  # noqa: E402
from draft import Eagle3Draft, EagleDraft, draft_config_for, eagle3_layer_ids  # noqa: E402
from tree import Tree, mc_sim_7b_63, static_tree  # noqa: E402

TARGETS = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}
QUICK_TARGETS = ("sm_80", "sm_86", "sm_90")
# gathered launches and compile results, keyed by the sources that made them: the script's sweeps
# and the tests share it, so a second run compiles only what changed ($KERNEL_FIT_CACHE moves it)
DEFAULT_CACHE_DIR = Path(os.environ.get("KERNEL_FIT_CACHE") or Path.home() / ".cache" / "eagle-gpt-fast" / "kernel_fit")
KERNELS = {"tree_attention": ("_tree_attention_kernel", "_merge_kernel"), "int8_matmul": ("_int8_matmul_kernel",)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CACHE_SLOTS = (64, 300, 1000, 2048, 3000, 4096, 6000, 8192)  # setup lengths: prefixes up to 8k
# (top_k, depth, tokens) of EAGLE-2 trees run as whole rounds: the default, EAGLE-3's depth, the
# sizes gpu_check.sh and the benchmarks use, and small trees (--tree_tokens auto on a CPU)
ROUND_SHAPES = ((10, 6, 60), (10, 8, 60), (10, 6, 128), (8, 6, 32), (4, 4, 16), (2, 3, 4))
VERIFY_NODES = range(2, 129)
LAYERS = 2  # every layer launches the same; two keep the cache layout of a multi-layer model


# ---------------------------------------------------------------------------------------------
# Gathering launches: the host code on the meta device, kernels replaced by recorders
# ---------------------------------------------------------------------------------------------
class Launch(NamedTuple):
    module: str   # "tree_attention" or "int8_matmul"
    kernel: str   # the @triton.jit function's name
    args: tuple   # as passed; tensors (meta) kept for their dtype
    kwargs: dict  # constexprs, num_warps, num_stages


def frozen(launch: Launch) -> tuple:
    """A launch as plain values (tensors by their dtype's name): hashable, and what JSON keeps."""
    args = tuple(("tensor", str(a.dtype).replace("torch.", "")) if isinstance(a, torch.Tensor) else a
                 for a in launch.args)
    return launch.module, launch.kernel, args, tuple(sorted(launch.kwargs.items()))


def thawed(record) -> Launch:
    """frozen()'s inverse (from JSON too): tensors come back as empty meta tensors of their dtype."""
    module, kernel, args, kwargs = record
    args = tuple(torch.empty(0, dtype=getattr(torch, a[1]), device="meta") if isinstance(a, (list, tuple)) else a
                 for a in args)
    return Launch(module, kernel, args, dict(kwargs))


def count(launches) -> dict:
    """{frozen launch: how many times it was launched}."""
    counts = {}
    for launch in launches:
        key = frozen(launch)
        counts[key] = counts.get(key, 0) + 1
    return counts


# What each kind of gathered launch depends on: the host code that runs, down to the kernel's
# launcher. A change to one of these files (or to how this script gathers) starts a new cache for
# that kind; int8 layers are cheap to gather again, a model's trees are not.
GATHER_SOURCES = {"tree": ("model.py", "speculative.py", "tree.py", "draft.py", "tree_attention.py", "tp.py"),
                  "int8": ("model.py", "draft.py", "quantize.py", "int8_matmul.py", "tp.py")}


def write_whole(path: Path, text: str) -> None:
    """A cache file written under a name of this process's and renamed when whole: neither a
    killed run nor two runs sharing the cache (two test sessions at once) leave a half file."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def source_digest(kind: str) -> str:
    """A digest of GATHER_SOURCES[kind] and of the functions and settings of this script that
    gather and record that kind."""
    digest = hashlib.sha256()
    for name in GATHER_SOURCES[kind]:
        digest.update((ROOT / name).read_bytes())
    # the recorder and gather itself too: its quick set (the tests') is chosen inside it
    common = (_Recorder, recording, frozen, model_shards, meta_models, gather)
    for fn in common + ((_chain, tree_launches) if kind == "tree" else (int8_launches,)):
        digest.update(inspect.getsource(fn).encode())
    digest.update(repr((LAYERS, DTYPES, CACHE_SLOTS, ROUND_SHAPES, VERIFY_NODES)).encode())
    return digest.hexdigest()[:16]


class _Recorder:
    def __init__(self, module: str, kernel: str, sink):
        self.module, self.kernel, self.sink = module, kernel, sink

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink().append(Launch(self.module, self.kernel, args, kwargs))


# The host functions that choose launches: what model.py / quantize.py / tune_kernels.py call.
HOST_FUNCTIONS = (("tree_attention", "tree_attention"), ("int8_matmul", "int8_matmul"))


@contextlib.contextmanager
def recording(limits):
    """Inside the block, tree_attention.py's and int8_matmul.py's launches are recorded, not run,
    into the dict it yields ({limit: [Launch, ...]}): each call of a host function (HOST_FUNCTIONS)
    runs once for each shared-memory limit in `limits`, seeing that limit as it would read it from
    a GPU, so one run of the (costly) model code gathers the launches of every GPU at once. It
    takes tensors on any device, so meta tensors serve."""
    launches = {limit: [] for limit in limits}
    current = [limits[0]]
    modules = {"tree_attention": tree_attention, "int8_matmul": int8_matmul}
    with contextlib.ExitStack() as stack:
        for name, module in modules.items():
            stack.enter_context(mock.patch.object(module, "INTERPRETED", True))
            stack.enter_context(mock.patch.object(module, "shared_memory_limit", lambda device: current[0]))
            for kernel in KERNELS[name]:
                stack.enter_context(mock.patch.object(module, kernel, _Recorder(name, kernel,
                                                                                lambda: launches[current[0]])))
        for name, function in HOST_FUNCTIONS:
            def each_limit(*args, _host=getattr(modules[name], function), **kwargs):
                for limit in limits:
                    current[0] = limit
                    out = _host(*args, **kwargs)
                return out
            stack.enter_context(mock.patch.object(modules[name], function, each_limit))
        backend = model._tree_kernel
        model.set_attention_backend("triton")
        try:
            yield launches
        finally:
            model._tree_kernel = backend


def model_shards(names=None) -> list:
    """(name, world_size, ModelArgs) for the named configs at every tensor-parallel degree 1-8
    that tp.check_divisible accepts."""
    out = []
    for name in names or model.transformer_configs:
        config = model.ModelArgs.from_name(name)
        for n in range(1, 9):
            try:
                tp.check_divisible(config, n)
            except ValueError:
                continue
            out.append((name, n, config))
    return out


def meta_models(config, world_size: int, dtype, eagle3: bool = False):
    """(target, draft) on the meta device: the target with LAYERS layers and this rank's heads
    (tp.shard_model; the all-reduces left out: they change no shape), the draft replicated."""
    with torch.device("meta"):
        target = model.Transformer(model.ModelArgs(**{**config.to_dict(), "n_layer": LAYERS}))
        if world_size > 1:
            tp.shard_model(target, tp.Shard(0, world_size))
            for layer in target.layers:
                layer.attention.tp_reduce = layer.feed_forward.tp_reduce = None
        if eagle3:
            # a reduced vocabulary of 8192 tokens (the shipped heads' size), or the whole one of a tiny config
            draft = Eagle3Draft(draft_config_for(target.config), min(8192, config.vocab_size), eagle3_layer_ids(LAYERS))
        else:
            draft = EagleDraft(draft_config_for(target.config))
    return target.to(dtype), draft.to(dtype)


def _chain(n: int) -> Tree:
    """A tree of n nodes on the meta device (only its shapes reach the launch)."""
    long = dict(dtype=torch.long, device="meta")
    return Tree(torch.zeros(1, n, **long), torch.zeros(1, n, **long), torch.zeros(1, n, **long),
                torch.zeros(1, n, n, dtype=torch.bool, device="meta"), torch.zeros(1, n, n, **long))


@torch.no_grad()
def tree_launches(config, world_size: int, dtype, cache_slots, round_shapes, verify_nodes, static=True,
                  eagle3=True):
    """Speculative rounds (draft catch-up and levels, verify) at every cache size, and verifies of
    each node count, run on the meta device. Call inside recording()."""
    target, draft = meta_models(config, world_size, dtype)
    cache_slots = [s for s in cache_slots if s + 2 * 128 <= config.block_size] or [config.block_size // 2]
    for slots in cache_slots:
        specs = [speculative.Speculator(target, draft, tree_top_k=k, tree_depth=d, tree_tokens=t)
                 for k, d, t in round_shapes]
        if static:
            specs.append(speculative.Speculator(target, draft, static=static_tree(mc_sim_7b_63)))
        if eagle3:
            specs.append(speculative.Speculator(*meta_models(config, world_size, dtype, eagle3=True),
                                                tree_top_k=10, tree_depth=8, tree_tokens=60))
        for spec in specs:
            spec.setup(1, slots)
            spec.round()
        if verify_nodes:  # one cache with room for the largest tree; the tree is in its last n slots
            spec = speculative.Speculator(target, draft, tree_top_k=12, tree_depth=2, tree_tokens=max(verify_nodes))
            spec.setup(1, slots)
            for n in verify_nodes:
                spec.n_nodes = n
                spec.verify(_chain(n))


@torch.no_grad()
def int8_launches(config, world_size: int, dtype, rows):
    """int8_matmul for every int8 layer of the (sharded) target and its draft, at each row count.
    quantize.WeightOnlyInt8Linear hands it 2 .. CUDA_INT8_KERNEL_ROWS rows on CUDA. Call inside
    recording()."""
    target, draft = meta_models(config, world_size, dtype)
    layers = {}
    for m in (target, draft):
        quantize.quantize_model(m, "int8")
        for lin in m.modules():
            if isinstance(lin, quantize.WeightOnlyInt8Linear):
                layers[lin.weight.shape] = lin
    for lin in layers.values():
        for m in rows:
            int8_matmul.int8_matmul(torch.empty(m, lin.in_features, dtype=dtype, device="meta"),
                                    lin.weight, lin.scales.to(dtype))


def tune_launches():
    """What scripts/tune_kernels.py launches, each setting of its sweeps (bfloat16). Call inside recording()."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tune_kernels

    meta = dict(device="meta", dtype=torch.bfloat16)
    for setting in tune_kernels.variations(tree_attention, tune_kernels.SWEEPS["tree_attention"]):
        with tune_kernels.constants(tree_attention, setting):
            for _, H, KV, D, T, R, prefix in tune_kernels.TREE_CASES:
                S = tune_kernels.TREE_CACHE + R
                tree_attention.tree_attention(torch.empty(1, H, T, D, **meta), torch.empty(1, KV, S, D, **meta),
                                              torch.empty(1, KV, S, D, **meta),
                                              torch.empty(1, dtype=torch.long, device="meta"),
                                              torch.empty(1, T, R, dtype=torch.bool, device="meta"))
    for setting in tune_kernels.variations(int8_matmul, tune_kernels.SWEEPS["int8_matmul"]):
        with tune_kernels.constants(int8_matmul, setting):
            for M in tune_kernels.INT8_ROWS:
                for N, K, _ in tune_kernels.INT8_SHAPES:
                    int8_matmul.int8_matmul(torch.empty(M, K, **meta), torch.empty(N, K, dtype=torch.int8, device="meta"),
                                            torch.empty(N, **meta))


def gather(capabilities, quick: bool = False, log=None, cache_dir: Path = None) -> dict:
    """Every launch of the sweep (quick: the representative set) as the host code chooses on GPUs
    of these capabilities: {shared-memory limit: {frozen launch: count}}, one entry per distinct
    limit. With cache_dir, each model group's launches are read from there when an earlier run
    saved them for every limit, and saved when gathered."""
    if quick:
        shards = [s for s in model_shards(["llama-2-7b", "llama-3-8b", "SmolLM2-135M"]) if s[1] <= 2]
        dtypes, slots, shapes, nodes, rows = (torch.bfloat16, torch.float32), (300, 4096), ((10, 6, 60),), \
            (2, 16, 60, 128), (2, 16, 60, 100, 128)
    else:
        shards, dtypes, slots, shapes, nodes, rows = model_shards(), DTYPES, CACHE_SLOTS, ROUND_SHAPES, VERIFY_NODES, \
            range(2, quantize.CUDA_INT8_KERNEL_ROWS + 1)
    limits = tuple(sorted({tree_attention.SHARED_MEMORY_PER_BLOCK[c] for c in capabilities}))
    if cache_dir is not None:
        cache_dir = Path(cache_dir) / ("quick" if quick else "full")
        cache_dir.mkdir(parents=True, exist_ok=True)
        digests = {kind: source_digest(kind) for kind in GATHER_SOURCES}
    total = {limit: {} for limit in limits}
    with recording(limits) as launches:
        seen = {}  # the launches of a shard depend on its attention and layer shapes only: gathered once
        for i, (name, n, config) in enumerate(shards):
            c = config
            attention = (c.n_head // n, c.n_local_heads // n, c.head_dim, c.n_head, c.n_local_heads,
                         c.block_size, c.sliding_window)
            layers = (c.dim, c.intermediate_size // n, c.n_head * c.head_dim // n, c.n_local_heads * c.head_dim // n,
                      c.vocab_size, c.qkv_bias, c.num_experts)
            for key, gather_one in ((("tree",) + attention, lambda d: tree_launches(
                    config, n, d, slots, shapes, nodes, static=not quick, eagle3=not quick)),
                    (("int8",) + layers, lambda d: int8_launches(config, n, d, rows))):
                if key not in seen:
                    name_hash = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
                    paths = {limit: None if cache_dir is None else
                             cache_dir / f"{key[0]}-{digests[key[0]]}-{limit}-{name_hash}.json" for limit in limits}
                    if cache_dir is not None and all(path.is_file() for path in paths.values()):
                        seen[key] = {limit: {thawed_key(r): k for r, k in json.loads(path.read_text())}
                                     for limit, path in paths.items()}
                    else:
                        for found in launches.values():
                            found.clear()
                        for dtype in dtypes:
                            gather_one(dtype)
                        seen[key] = {limit: count(found) for limit, found in launches.items()}
                        for limit, path in paths.items():
                            if path is not None:
                                write_whole(path, json.dumps([[r, k] for r, k in seen[key][limit].items()]))
                for limit in limits:
                    for r, k in seen[key][limit].items():
                        total[limit][r] = total[limit].get(r, 0) + k
            if log:
                log(f"  {name} TP={n}: {sum(sum(t.values()) for t in total.values())} launches so far, "
                    f"{len(limits)} limits ({i + 1}/{len(shards)})")
        for found in launches.values():
            found.clear()
        tune_launches()
        for limit, found in launches.items():
            for r, k in count(found).items():
                total[limit][r] = total[limit].get(r, 0) + k
    return total


def thawed_key(record) -> tuple:
    """A frozen launch read back from JSON (lists where frozen() made tuples)."""
    return frozen(thawed(record))


# ---------------------------------------------------------------------------------------------
# Compiling: one binary per resource class and target
# ---------------------------------------------------------------------------------------------
def unavailable() -> str:
    """Why this machine cannot compile for an NVIDIA GPU ahead of time, or "" when it can."""
    try:
        import triton
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        return f"triton is not importable ({e})"
    if "nvidia" not in backends:
        return "this Triton has no CUDA backend"
    if not hasattr(triton, "knobs"):
        return f"Triton {triton.__version__} has no triton.knobs (3.4 or newer needed)"
    try:
        ptxas = triton.knobs.nvidia.ptxas  # the one Triton ships, or $TRITON_PTXAS_PATH; None if neither
    except Exception as e:  # noqa: BLE001 - whatever a Triton without its ptxas raises
        return f"no ptxas ({type(e).__name__}: {e})"
    if ptxas is None or not os.path.exists(ptxas.path):
        return "Triton finds no ptxas"
    return ""


def invariant_launches(ik) -> list:
    """batch-invariant mode's launches (invariant_kernels.py, passed as ik), in bfloat16, float16 and
    float32: the linear with and without bias at one configuration a dtype and its split-K first
    launch (alone, and with the sum folded in), the norm at 8,192 (LLaMA-2-70B's width) columns,
    window attention at head_dim 64 and 128 as the module's ATTENTION_CHUNK runs it; in bfloat16
    only, the launches without tiles that a dtype could push past a limit: split-K's sum and
    attention's chunk partials. Quantized weights: int8 and int4 (group 32) in one pass and int4's
    split-K first launch in bfloat16, int4 in one pass in float32 (its dequantized tile beside
    float32's register-held tiles), the sum with int8 scales, and split-K with the sum folded in
    for int4 and int8 in bfloat16. A block's norm fused into the linear (FUSE_NORMS): one pass in
    bfloat16 and float32, split-K with the sum folded in in bfloat16."""
    t = lambda dtype: torch.empty(0, dtype=dtype, device="meta")  # noqa: E731
    f32 = t(torch.float32)
    launches = []
    u8, i8, i32 = t(torch.uint8), t(torch.int8), t(torch.int32)
    plain = dict(QUANT=0, GROUP=1, NORM=False)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for has_bias in (False, True):
            launches.append(Launch("invariant_kernels", "_linear_kernel",
                                   (t(dtype),) * 6 + (60, 1536, 576, 576, 576, 1536, 1e-5),
                                   dict(HAS_BIAS=has_bias, **plain, **ik.linear_config(dtype))))
        for fold in (False, True):  # split-K's sums by a second launch, or folded in (LINEAR_FOLD_SPLITS)
            launches.append(Launch("invariant_kernels", "_linear_partial_kernel",
                                   (t(dtype),) * 5 + (f32, t(dtype), i32)
                                   + (60, 576, 1536, 128, 12, 1536, 1536, 576, 1e-5),
                                   dict(FOLD=fold, HAS_BIAS=fold, **plain, **ik.linear_config(dtype))))
        launches.append(Launch("invariant_kernels", "_rms_norm_kernel",
                               (t(dtype), t(dtype), t(dtype), 8192, 8192, 8192, 1e-5), dict(BLOCK=8192)))
        for D in (64, 128):
            launches.append(Launch(
                "invariant_kernels", "_window_attention_kernel",
                (t(dtype), t(dtype), t(dtype), t(torch.long), t(torch.long), t(torch.bool), t(dtype), f32, f32)
                + (1 << 20, 64, 1 << 14, 1 << 20, 1 << 18, 128, 1 << 20, 1 << 18, 128, 16, 1, 528, 33, 1 << 16, 128,
                   64 * 128)
                + (4, 33, 0.125, 16, 32, 33, 16 * 32 * 33),
                dict(D=D, BLOCK_D=D, BLOCK_N=ik.ATTENTION_BLOCK_N, BLOCK_R=64, CHUNK=ik.ATTENTION_CHUNK,
                     num_warps=ik.ATTENTION_WARPS)))
    # (x's dtype, weight, QUANT, the weight's row stride for K = 576: int4 packs two columns a byte)
    for dtype, weight, quant, stride_wn in ((torch.bfloat16, i8, 8, 576), (torch.bfloat16, u8, 4, 288),
                                            (torch.float32, u8, 4, 288)):
        launches.append(Launch("invariant_kernels", "_linear_kernel",
                               (t(dtype), weight) + (t(dtype),) * 4 + (60, 1536, 576, 576, stride_wn, 1536, 1e-5),
                               dict(HAS_BIAS=False, QUANT=quant, GROUP=32, NORM=False, **ik.linear_config(dtype))))
    bf16 = t(torch.bfloat16)
    for weight, quant, stride_wn, fold in ((u8, 4, 768, False), (u8, 4, 768, True), (i8, 8, 1536, True)):
        launches.append(Launch("invariant_kernels", "_linear_partial_kernel",
                               (bf16, weight, bf16, bf16, bf16, f32, bf16, i32)
                               + (60, 576, 1536, 128, 12, 1536, stride_wn, 576, 1e-5),
                               dict(FOLD=fold, HAS_BIAS=False, QUANT=quant, GROUP=32, NORM=False,
                                    **ik.linear_config(torch.bfloat16))))
    # a block's norm inside its linears (FUSE_NORMS): one pass in bfloat16 and float32, split-K folded in bfloat16
    for dtype in (torch.bfloat16, torch.float32):
        launches.append(Launch("invariant_kernels", "_linear_kernel",
                               (t(dtype),) * 6 + (60, 1536, 576, 576, 576, 1536, 1e-5),
                               dict(HAS_BIAS=False, QUANT=0, GROUP=1, NORM=True, **ik.linear_config(dtype))))
    launches.append(Launch("invariant_kernels", "_linear_partial_kernel",
                           (bf16,) * 5 + (f32, bf16, i32) + (60, 576, 1536, 128, 12, 1536, 1536, 576, 1e-5),
                           dict(FOLD=True, HAS_BIAS=False, QUANT=0, GROUP=1, NORM=True,
                                **ik.linear_config(torch.bfloat16))))
    launches.append(Launch("invariant_kernels", "_split_sum_kernel", (f32, bf16, bf16, bf16, 60, 576, 576, 12),
                           dict(HAS_BIAS=True, SCALED=True, BLOCK=ik.SUM_BLOCK)))
    for D in (64, 128):
        launches.append(Launch(
            "invariant_kernels", "_window_chunk_kernel",
            (bf16, bf16, bf16, t(torch.long), f32, f32)
            + (1 << 20, 64, 1 << 14, 1 << 20, 1 << 18, 128, 1 << 20, 1 << 18, 128, 16, 1)
            + (4, 16, 32, 33, 16 * 32 * 33, 0.125),
            dict(D=D, BLOCK_D=D, BLOCK_N=ik.ATTENTION_BLOCK_N, CHUNK=ik.ATTENTION_CHUNK or 2 * ik.ATTENTION_BLOCK_N,
                 num_warps=ik.ATTENTION_WARPS)))
    return launches


def compilable(name: str):
    """The module `name` loaded afresh from its file with Triton's interpreter off, so that its
    kernels are JITFunctions (a test session may have imported it under TRITON_INTERPRET=1)."""
    spec = importlib.util.spec_from_file_location(f"_kernel_fit_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}):
        spec.loader.exec_module(module)
    return module


class Compiler:
    """Triton's launch-time specialization and ahead-of-time compilation, for a CUDA target."""

    def __init__(self):
        self.modules = {name: compilable(name) for name in KERNELS}
        # the sources compiled, read with the modules: cached_compile keys on them (a file edited
        # during a sweep must not give its results to the new source)
        self.sources = {name: (ROOT / f"{name}.py").read_bytes() for name in KERNELS}
        self.own_source = inspect.getsource(Compiler).encode()  # how a launch is compiled and measured
        self.binders = {}

    def add_module(self, name: str) -> None:
        """Compile the kernels of another of the project's modules too (invariant_kernels.py in
        its tests), its source read alongside for cached_compile's key."""
        self.modules[name] = compilable(name)
        self.sources[name] = (ROOT / f"{name}.py").read_bytes()

    def _bind(self, launch: Launch, capability: tuple):
        """(jit function, backend, target, the launch's specialization: what Triton keys its cache on)."""
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import MockTensor, create_function_from_signature

        jit = getattr(self.modules[launch.module], launch.kernel)
        key = (launch.kernel, capability)
        if key not in self.binders:
            target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
            backend = make_backend(target)
            self.binders[key] = (target, backend, create_function_from_signature(jit.signature, jit.params, backend))
        target, backend, binder = self.binders[key]
        # MockTensor: a tensor of that dtype at a 16-byte aligned address, as Triton's warmup() passes
        args = [MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a for a in launch.args]
        bound, specialization, options = binder(*args, **launch.kwargs)
        return jit, backend, target, bound, specialization, options

    def class_key(self, launch: Launch, capability: tuple) -> str:
        _, _, _, _, specialization, options = self._bind(launch, capability)
        return f"{launch.kernel}|{specialization}|{options}"

    def compile(self, launch: Launch, capability: tuple, float_args: str = "fp32") -> dict:
        """shared (bytes), registers, spill stores (bytes) of the launch's binary, or error.
        float_args: the type of the kernel's float scalar arguments. A direct launch passes Python
        floats as fp32; inside a torch.compile'd graph Inductor passes them as fp64 on CUDA
        (torch._inductor.codegen.triton_utils.signature_of), so "fp64" compiles what a compiled
        graph runs."""
        from triton import knobs

        log = io.StringIO()
        start = time.perf_counter()
        try:
            with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
                knobs.nvidia.dump_ptxas_log = True  # printed by a real compile only: no cache
                knobs.compilation.always_compile = True
                compiled = self._triton_compile(launch, capability, float_args)
        except Exception as e:  # noqa: BLE001 - a compile error is a result here
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return dict(error=f"{type(e).__name__}: {first}"[:300], seconds=time.perf_counter() - start)
        text = log.getvalue()
        regs = re.search(r"Used (\d+) registers", text)
        spills = re.search(r"(\d+) bytes spill stores", text)
        return dict(shared=compiled.metadata.shared, registers=int(regs.group(1)) if regs else None,
                    spill_stores=int(spills.group(1)) if spills else 0, seconds=time.perf_counter() - start)

    def ptx(self, launch: Launch, capability: tuple) -> str:
        """The launch's PTX for the target: what a test reads to see how a kernel orders its memory."""
        return self._triton_compile(launch, capability).asm["ptx"]

    def _triton_compile(self, launch: Launch, capability: tuple, float_args: str = "fp32"):
        import triton
        from triton.compiler import ASTSource

        jit, backend, target, bound, specialization, options = self._bind(launch, capability)
        options, signature, constexprs, attrs = jit._pack_args(backend, launch.kwargs, bound, specialization, options)
        if float_args != "fp32":  # scalars only: a float32 tensor's pointer is "*fp32"
            signature = {name: float_args if kind == "fp32" else kind for name, kind in signature.items()}
        return triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=vars(options))


def cached_compile(compiler: Compiler, launch: Launch, capability: tuple, cache_dir: Path = None,
                   float_args: str = "fp32") -> dict:
    """compiler.compile(launch, capability), kept under cache_dir/compiled when cache_dir is given:
    keyed by the launch's class (Triton's specialization key), the target, the kernel module's
    source, this script's Compiler, Triton's version and float_args (compile's), so a stopped sweep
    does not compile a class twice. A compile error is returned but not kept: a ptxas killed by the
    machine must not fail every later run."""
    if cache_dir is None:
        return compiler.compile(launch, capability, float_args)
    import triton

    digest = hashlib.sha256()
    for part in (compiler.class_key(launch, capability), repr(capability), triton.__version__, float_args):
        digest.update(part.encode())
    digest.update(compiler.sources[launch.module])
    digest.update(compiler.own_source)
    path = Path(cache_dir) / "compiled" / f"{launch.kernel.strip('_')}-{digest.hexdigest()[:24]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    result = compiler.compile(launch, capability, float_args)
    if "error" in result:
        return result
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(result))
    return result


def config_key(launch: Launch) -> tuple:
    """What a launch's resources depend on, short of the integers Triton specializes on: kernel,
    tensor dtypes, constants (split or not; the split count only bounds a loop), warps and stages.
    --quick compiles one class of each: a third of the classes, each compiled alike."""
    consts = tuple(sorted((k, v) for k, v in launch.kwargs.items() if k != "N_SPLITS"))
    dtypes = tuple(str(a.dtype) for a in launch.args if isinstance(a, torch.Tensor))
    return launch.kernel, dtypes, consts, launch.kwargs.get("N_SPLITS", 1) > 1


def host_bound(launch: Launch) -> int:
    """The shared memory the host code assumed when it chose the launch (its module's shared_bytes)."""
    kw = launch.kwargs
    if launch.kernel == "_tree_attention_kernel":
        return tree_attention.shared_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_D"], kw["num_stages"],
                                           launch.args[0].dtype.itemsize)
    if launch.kernel == "_int8_matmul_kernel":
        return int8_matmul.shared_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_stages"],
                                        launch.args[0].dtype.itemsize)
    return None  # the merge kernel: no dot, no pipelined loads


def describe(launch: Launch) -> str:
    """"tree_attention bfloat16: D 128, ..., warps 8, stages 2": the kernel, its inputs' dtype (the
    merge's output: its inputs are float32 partials) and its constants."""
    tensor = launch.args[3] if launch.kernel == "_merge_kernel" else launch.args[0]
    dtype = str(tensor.dtype).replace("torch.", "")
    consts = ", ".join(f"{k} {v}" for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages"))
    return (f"{launch.kernel.strip('_').replace('_kernel', '')} {dtype}: {consts}, "
            f"warps {launch.kwargs.get('num_warps', 4)}, stages {launch.kwargs.get('num_stages', 3)}")


_WORK = []  # (compiler, launch, capability, cache_dir) of each class still to compile: read by forked workers


def _compile_into_cache(i: int) -> None:
    cached_compile(*_WORK[i])


def compile_ahead(compiler: Compiler, work, cache_dir: Path, jobs: int, log=print) -> None:
    """Fill cache_dir with the compile results of `work` ([(launch, capability)], one launch per
    class) in `jobs` forked processes: each compile is one ptxas run on one core. The workers
    inherit the launches (meta tensors do not pickle) and pass back nothing but an index."""
    import multiprocessing

    _WORK[:] = [(compiler, launch, capability, cache_dir) for launch, capability in work]
    t0 = time.perf_counter()
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for i, _ in enumerate(pool.imap_unordered(_compile_into_cache, range(len(work)), chunksize=4)):
                if (i + 1) % 100 == 0:
                    log(f"  compiled {i + 1}/{len(work)} classes in {jobs} processes "
                        f"({time.perf_counter() - t0:.0f} s)")
    finally:
        _WORK.clear()


def check(targets, quick: bool = False, log=print, cache_dir: Path = None, jobs: int = 1) -> dict:
    """Gather and compile for each target (quick: the representative set, one class per
    config_key); returns the report that markdown() writes out. jobs > 1 (with a cache_dir):
    the classes not in the cache are compiled first, in that many processes."""
    compiler = Compiler()
    report = dict(targets={}, classes=[])
    classes = {}  # (target, class key) -> result row
    t0 = time.perf_counter()
    # targets with the same shared-memory limit get the same launches; all limits in one pass
    by_limit = gather([TARGETS[name] for name in targets], quick, log=None if quick else log, cache_dir=cache_dir)
    gathered = time.perf_counter() - t0
    groups_of = {}  # target -> {class key -> [(launch, count), ...]}
    for name in targets:
        capability = TARGETS[name]
        groups = groups_of[name] = {}
        for record, k in by_limit[tree_attention.SHARED_MEMORY_PER_BLOCK[capability]].items():
            launch = thawed(record)
            key = config_key(launch) if quick else compiler.class_key(launch, capability)
            groups.setdefault(key, []).append((launch, k))
    if jobs > 1 and cache_dir is not None:
        compile_ahead(compiler, [(members[0][0], TARGETS[name]) for name, groups in groups_of.items()
                                 for members in groups.values()], cache_dir, jobs, log)
    for name in targets:
        capability, t0 = TARGETS[name], time.perf_counter()
        limit = tree_attention.SHARED_MEMORY_PER_BLOCK[capability]
        counts, groups = by_limit[limit], groups_of[name]
        n_launches = sum(counts.values())
        log(f"{name}: {n_launches} launches in {len(groups)} classes (all limits gathered in {gathered:.0f} s)")
        totals = dict(capability=".".join(map(str, capability)), limit=limit, launches=n_launches,
                      classes=len(groups), failed=0, over_limit=0, over_bound=0, spilling=0, launches_failed=0,
                      launches_over_limit=0)
        for i, (key, members) in enumerate(groups.items()):
            first, n_members = members[0][0], sum(k for _, k in members)
            result = cached_compile(compiler, first, capability, cache_dir)
            bound = host_bound(first)
            row = dict(target=name, kernel=first.kernel, launch=describe(first), launches=n_members,
                       limit=limit, bound=bound, key=key, **result)
            if "error" in row:
                totals["failed"] += 1
                totals["launches_failed"] += n_members
            else:
                row["fits"] = row["shared"] <= limit
                totals["over_limit"] += not row["fits"]
                totals["launches_over_limit"] += 0 if row["fits"] else n_members
                totals["over_bound"] += bound is not None and row["shared"] > bound
                totals["spilling"] += row["spill_stores"] > 0
            classes[name, key] = row
            if not quick and (i + 1) % 25 == 0:
                log(f"  {name}: compiled {i + 1}/{len(groups)}")
        totals["seconds"] = round(time.perf_counter() - t0, 1)
        report["targets"][name] = totals
        log(f"{name}: {totals}")
    report["classes"] = list(classes.values())
    return report


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    lines = [f"# Triton launches against the per-block shared-memory limit, ahead of time", "",
             f"- date: {report['date']}; torch {report['torch']}, triton {report['triton']}",
             f"- command: `{report['command']}`",
             f"- sweep: {report['sweep']}", "",
             "| target | limit (B) | launches | classes | compile failures | over the limit (classes / launches) | "
             "over the host's bound | spilling classes | time (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, t in report["targets"].items():
        lines.append(f"| {name} ({t['capability']}) | {t['limit']:,} | {t['launches']:,} | {t['classes']} | "
                     f"{t['failed']} | {t['over_limit']} / {t['launches_over_limit']} | {t['over_bound']} | "
                     f"{t['spilling']} | {t['seconds']} |")
    lines += ["", "Every resource class: the binary one launch configuration compiles to (shared memory in bytes; "
              "registers per thread; ptxas spill stores in bytes per thread). Rows with the same launch differ in "
              "the integers Triton specializes on.", "",
              "| target | launch | launches | shared | bound | registers | spills | fits |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["classes"], key=lambda r: (r["target"], r["launch"], -r["launches"])):
        if "error" in r:
            lines.append(f"| {r['target']} | {r['launch']} | {r['launches']} | compile error: {r['error']} | | | | no |")
        else:
            lines.append(f"| {r['target']} | {r['launch']} | {r['launches']} | {r['shared']:,} | "
                         f"{r['bound'] if r['bound'] is not None else '-'} | {r['registers']} | {r['spill_stores']} | "
                         f"{'yes' if r['fits'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    p.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=None,
                   help=f"default: all ({', '.join(TARGETS)}); --quick: {', '.join(QUICK_TARGETS)}")
    p.add_argument("--quick", action="store_true", help="the representative set of tests/test_kernel_fit.py")
    p.add_argument("--cache_dir", type=Path, default=DEFAULT_CACHE_DIR,
                   help="where gathered launches (per model group and limit) and compile results (per class and "
                        "target) are kept, so that a stopped sweep resumes (default: %(default)s)")
    p.add_argument("--no_cache", action="store_true", help="gather everything again, keep nothing")
    p.add_argument("--jobs", type=int, default=1,
                   help="compile in this many processes (with the cache; each compile takes one core)")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        sys.exit(f"error: cannot compile for NVIDIA GPUs here: {why}")
    import triton

    targets = args.targets or (QUICK_TARGETS if args.quick else tuple(TARGETS))
    report = check(targets, args.quick, log=lambda s: print(s, file=sys.stderr, flush=True),
                   cache_dir=None if args.no_cache else args.cache_dir, jobs=args.jobs)
    report.update(date=time.strftime("%Y-%m-%d", time.gmtime()), torch=torch.__version__, triton=triton.__version__,
                  command="python scripts/kernel_fit.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  sweep="quick (tests/test_kernel_fit.py)" if args.quick else (
                      f"{len(model_shards())} model/TP pairs ({len(model.transformer_configs)} named configs, TP 1-8), "
                      f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)}, caches of {CACHE_SLOTS} slots, "
                      f"EAGLE-2 rounds {ROUND_SHAPES} (top_k, depth, tokens), EAGLE-1 mc_sim_7b_63, EAGLE-3 (10, 8, 60), "
                      f"verify of {VERIFY_NODES.start}-{VERIFY_NODES.stop - 1} nodes, int8 at 2-"
                      f"{quantize.CUDA_INT8_KERNEL_ROWS} rows, scripts/tune_kernels.py's sweeps"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(markdown(report))
        print(f"wrote {args.out}.json, .md", file=sys.stderr)
    bad = sum(t["failed"] + t["over_limit"] for t in report["targets"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
