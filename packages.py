"""Compile once: the compiled CPU graphs as AOTInductor packages on disk, which a later run loads in
seconds instead of tracing them again, as torch.compile does in every process.

A package (torch._inductor.aoti_compile_and_package) holds the compiled code and its frozen weights
in one shared library, kept on disk unpacked (aoti_load_package would unpack the whole archive at
every load). Each is keyed by everything its graph depends on: this project's source, torch's
version, the Inductor settings (and TORCHINDUCTOR_* variables), the weights, the modules'
configuration (dtype, tree, batch-invariant mode) and the shapes of its inputs; a key with no
package builds one (minutes, once).

A graph's mutable state (KV caches, a Speculator's buffers) goes in as inputs that the package
updates in place, so the caller's tensors stay the state (as module buffers, torch.export refuses
the KV caches, views of one block, and a package bound to them computed wrong trees).
"""
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.func import functional_call

import compiling
from compiling import render_templates_from_cache, weights_digest
from cpu import packed_in_graph
from quantize import has_quantized
from sampling import sample
from trees import StaticTree

FORMAT = 2  # bump when what a package holds, or how it is called, changes
ROOT = Path(__file__).resolve().parent
# Buffers a graph only reads, which the package keeps as constants: stop ids, RoPE tables, the
# draft's vocabulary and the block the KV caches are views of (a graph reads and writes the views),
# by name; and every buffer of the modules in CONSTANT_MODULES (a StaticTree's shape).
CONSTANT_BUFFERS = ("stop_ids", "kv_storage", "rope_cos", "rope_sin", "vocab")
CONSTANT_MODULES = (StaticTree,)
# Host-side attributes of a Speculator that no graph reads (adaptive decoding's estimates and counts).
HOST_ATTRIBUTES = ("pace", "plain_steps", "plain_run")


def usable(device: str, temperature: float, *modules: nn.Module) -> bool:
    """Whether packages replace torch.compile: on a CPU, greedy, unquantized. (Sampling draws
    random numbers, which a package seeds its own way; the int8/int4 kernels are Python ops,
    which a package cannot call.)"""
    return str(device) == "cpu" and temperature == 0 and not has_quantized(*modules)


def settings(*modules: nn.Module) -> dict:
    """compiling.cpu_settings less those a package has no use for (its wrapper is C++ anyway, and
    it is its own cache)."""
    return {k: v for k, v in compiling.cpu_settings(modules).items() if k not in ("cpp_wrapper", "fx_graph_cache")}


class Call(nn.Module):
    """fn(module, *args) as a module's forward: what functional_call and torch.export take."""

    def __init__(self, fn, module: nn.Module):
        super().__init__()
        self.fn, self.inner = fn, module

    def forward(self, *args):
        return self.fn(self.inner, *args)


class Bound(nn.Module):
    """fn(module, *args, *state): the module's state tensors taken from the trailing inputs."""

    def __init__(self, fn, module: nn.Module):
        super().__init__()
        self.call, self.names, self.paths = Call(fn, module), [], []

    def state(self) -> list:
        """The state tensors, each looked up at every call: setup() replaces them and the caches' modules."""
        if not self.names:  # read once the caches and buffers exist (after setup)
            constant = {f"{prefix}.{n}".lstrip(".") for prefix, m in self.call.named_modules()
                        for n in m._buffers if is_constant(m, n)}
            self.names = [n for n, _ in self.call.named_buffers() if n not in constant]
            self.paths = [n.split(".") for n in self.names]
        root = self.call  # (a submodule: nn.Module.__getattr__, slow, so once)
        return [buffer(root, path) for path in self.paths]

    def forward(self, *inputs):
        n = len(inputs) - len(self.names)
        return functional_call(self.call, dict(zip(self.names, inputs[n:])), inputs[:n], strict=False)


def is_constant(module: nn.Module, name: str) -> bool:
    """Whether module's buffer name is one a graph only reads, which a package keeps as a constant."""
    return name in CONSTANT_BUFFERS or isinstance(module, CONSTANT_MODULES)


def buffer(module: nn.Module, path: list) -> torch.Tensor:
    """module's buffer at path (a dotted name, split), by dictionary lookups: a step reads 60 of them."""
    for name in path[:-1]:
        module = module._modules[name]
    return module._buffers[path[-1]]


class Packaged:
    """fn(module, *tensors) -> tensors, compiled as a package in folder: loaded, or built, at its
    first call with each set of input shapes. Called with the tensors; returns fn's result."""

    def __init__(self, fn, module: nn.Module, name: str, folder: Path):
        self.bound, self.name, self.folder = Bound(fn, module), name, Path(folder)
        self.runners = {}

    def __call__(self, *args):
        state = self.bound.state()
        shapes = tuple(tuple(t.shape) for t in (*args, *state))
        if shapes not in self.runners:
            self.runners[shapes] = self.load_or_build(args, state)
        return self.runners[shapes](*args, *state)

    def key_parts(self, args, state) -> dict:
        module = self.bound.call.inner
        return {"format": FORMAT, "torch": torch.__version__, "source": source_digest(),
                "function": self.bound.call.fn.__qualname__,  # not its module's name, which is __main__ in a script
                "settings": repr(sorted(settings(module).items())),
                "environment": repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_"))),
                "weights": weights_digest(module), "configuration": configuration_digest(module),
                "inputs": repr([(tuple(t.shape), str(t.dtype)) for t in (*args, *state)])}

    def load_or_build(self, args, state):
        parts = self.key_parts(args, state)
        key = hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=10).hexdigest()
        path = self.folder / f"{self.name}-{key}.so"
        if path.exists():
            try:
                return load(path)
            except Exception as e:  # a truncated or foreign file: build it again
                first_line = (str(e).strip().splitlines() or [""])[0][:160]
                print(f"[compile] {path} could not be loaded ({type(e).__name__}: {first_line}); building it again",
                      file=sys.stderr)
        else:
            print(f"[compile] building {path} ({why_new(self.folder, self.name, parts)}): minutes, once; "
                  f"later runs load it in seconds", file=sys.stderr)
        self.build(path, args, state)
        path.with_suffix(".json").write_text(json.dumps(parts, indent=1))
        return load(path)

    @torch.no_grad()
    def build(self, path: Path, args, state):
        # Once eagerly on copies of the state: probes that cache their answers (invariant.py's) run
        # now, on real tensors; tracing then reads their answers. The tracing gets copies too.
        self.bound(*(t.clone() for t in (*args, *state)))
        with packed_in_graph(self.bound.call.inner):
            exported = torch.export.export(self.bound.eval(), tuple(t.clone() for t in (*args, *state)), strict=False)
        hidden = list(exported.graph_signature.buffers_to_mutate.values())
        if hidden:  # the package would update its own copy, and the caller's state would go stale
            raise RuntimeError(f"{self.name} writes buffers it keeps as constants: {', '.join(hidden)} "
                               f"(packages.CONSTANT_BUFFERS and CONSTANT_MODULES name buffers that a graph only reads)")
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.partial{os.getpid()}.pt2")  # no half-written library at path
        render_templates_from_cache()
        try:
            with warnings.catch_warnings():  # as compiling.cpu_backend: the flags warn as they are entered
                warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
                with torch.backends.mkldnn.flags(enabled=False):
                    torch._inductor.aoti_compile_and_package(exported, package_path=str(partial),
                                                             inductor_configs=settings(self.bound.call.inner))
            with zipfile.ZipFile(partial) as archive:  # the package's one shared library: code and weights
                libraries = [n for n in archive.namelist() if n.endswith(".so")]
                if len(libraries) != 1:
                    raise RuntimeError(f"{partial} holds {len(libraries)} shared libraries, not one")
                with archive.open(libraries[0]) as src, open(partial.with_suffix(".so"), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 24)
            os.replace(partial.with_suffix(".so"), path)
        finally:  # a failed or interrupted build leaves no partial files
            partial.unlink(missing_ok=True)
            partial.with_suffix(".so").unlink(missing_ok=True)


def load(path: Path):
    """The compiled function in the shared library at path, called with tensors, as a package is."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
    out_spec = pytree.treespec_loads(runner.get_call_spec()[1])

    def call(*tensors):
        return pytree.tree_unflatten(runner.run(list(tensors)), out_spec)
    return call


def why_new(folder: Path, name: str, parts: dict) -> str:
    """Why no package matches: what differs from the one of this name built last, if any."""
    manifests = sorted(Path(folder).glob(f"{name}-*.json"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        return "the first one"
    try:
        last = json.loads(manifests[-1].read_text())
    except (OSError, ValueError):
        return "the last one's record is unreadable"
    differ = [k for k in parts if last.get(k) != parts[k]]
    return f"the last one was built for another {', '.join(differ)}" if differ else "the last one is missing"


def source_digest() -> str:
    """A digest of this project's Python files: the code a graph is traced from."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted([*ROOT.glob("*.py"), *ROOT.glob("gpu_kernels/*.py")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def configuration_digest(module: nn.Module) -> str:
    """A digest of every submodule's class, plain attributes (config, tree shape, sampling, the
    batch-invariant window), hooks and constant buffers: what a trace reads besides weights and state."""
    h = hashlib.blake2b(digest_size=16)
    for name, m in module.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__}".encode())
        for attr, value in sorted(vars(m).items()):
            if attr in ("_parameters", "_modules", "_non_persistent_buffers_set", "training", *HOST_ATTRIBUTES) \
                    or isinstance(value, Packaged):
                continue
            if attr == "_buffers":  # the constants a package keeps (the KV block's contents are state's)
                value = {n: b for n, b in value.items() if is_constant(m, n) and n != "kv_storage"}
            elif "hooks" in attr:  # keyed by handle numbers, which count hooks made anywhere in the process
                value = list(value.values())
            h.update(f"{attr}={describe(value)}".encode())
    return h.hexdigest()


def describe(value) -> str:
    """A stable text for a value: tensors by dtype, shape and contents, functions by name, no addresses."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b""
        return f"tensor({value.dtype}, {tuple(value.shape)}, {hashlib.blake2b(data, digest_size=8).hexdigest()})"
    if isinstance(value, functools.partial):
        return f"partial({describe(value.func)}, {describe(value.args)}, {describe(value.keywords)})"
    if isinstance(value, nn.Module):
        return f"module {type(value).__qualname__}"  # described where named_modules reaches it
    if isinstance(value, dict):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}(" + ", ".join(describe(v) for v in value) + ")"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return f"{type(value).__qualname__}({describe(vars(value))})"
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def folder(checkpoint_path) -> Path:
    """Where a checkpoint's packages are kept: beside it."""
    return Path(checkpoint_path).parent / "compiled"


def greedy_step(model: nn.Module, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """generate.decode_one_token at temperature 0: what a step package holds."""
    return sample(model(token[:, None], input_pos)[:, -1], 0.0, None, None)


def packaged_step(model: nn.Module, folder: Path):
    """generate.decode_one_token's counterpart for greedy decoding (the sampling arguments are 0, None, None)."""
    step = Packaged(greedy_step, model, "step", folder)
    return lambda model, token, input_pos, *sampling: step(token, input_pos)


def package_round(spec: nn.Module, folder: Path) -> nn.Module:
    """compiling.compile_round's counterpart: a Speculator's round, plain step and flush (adaptive
    decoding's) as packages in folder, each loaded or built at its first call."""
    for name in ("round", "plain_step", "flush"):
        setattr(spec, name, Packaged(getattr(type(spec), name), spec, name, folder))
    return spec
