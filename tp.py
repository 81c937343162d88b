"""Tensor parallelism: the target sharded over the ranks of torch.distributed, as in gpt-fast.

    python -m torch.distributed.run --nproc_per_node 2 generate.py --checkpoint_path ... --speculate eagle2

Each of the N ranks (one per GPU with NCCL; one process each with gloo on a CPU) holds 1/N of every
decoder layer: wqkv and w1/w3 split by columns (heads, intermediate size), wo and w2 by rows, whose
partial sums an all-reduce hooked onto each attention and feed-forward adds (two a layer).
Everything else (embedding, norms, router, LM head, the EAGLE draft) is replicated and computed
identically on every rank. Quantized files are sliced as they are, so every N computes with the
weights one GPU would use.

The ranks never diverge, so each decides alone: they start from the same command and prompt
(check_same_command), an all-reduce leaves the same bits on every rank, the replicated work runs the
same kernels on the same shapes (init turns kernel timing off), and sampling draws from the same seed;
the one choice made from timings, --tree auto, is rank 0's (from_rank0). docs/tensor_parallel.md has
the plan, its limits and what it costs.
"""
import atexit
import os
import sys
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from model import Experts, ModelArgs, Transformer
from quantize import INT4_N_MULTIPLE

# How long a rank waits for the others, to join and at each collective (seconds).
DEFAULT_TIMEOUT_S = float(os.environ.get("EAGLE_TP_TIMEOUT", 600))
_GROUP_NAME = None  # the default group's name, for all_reduce_sum (set by init)


class Shard(NamedTuple):
    """Which part of the target this process holds: rank `rank` of `world_size`."""
    rank: int
    world_size: int


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def active() -> bool:
    """Whether this process is one rank of a tensor-parallel group (init succeeded)."""
    return dist.is_available() and dist.is_initialized()


def init(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple:
    """(Shard, this rank's device) when started by torchrun (even with one process), else (None,
    device). The group's timeout covers the rendezvous and every later collective, so a rank that
    never joins or dies mid-run ends the others with a ValueError rather than a hang."""
    if not launched_by_torchrun():
        return None, device
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.startswith("cuda"):
        # Deterministic cuBLAS needs a fixed workspace, set before the process's first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        check_gpu_count(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), torch.cuda.device_count())
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # Imported before the group exists, so that finish() can free it: this module binds group.WORLD
    # into default arguments at import, and imported later it would hold the group for good.
    import torch.distributed.nn.functional  # noqa: F401
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:  # DistStoreError / DistNetworkError: nobody came
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tensor parallelism: rank {rank} waited {timeout_s:g} s and not all {world_size} ranks "
                         f"joined ({first}); start every rank with the same command (torchrun does), or raise "
                         f"EAGLE_TP_TIMEOUT (seconds)") from None
    # A command that exits early still tears the group down while the interpreter is whole.
    atexit.register(finish)
    global _GROUP_NAME
    _GROUP_NAME = dist.group.WORLD.group_name
    # Before anything is compiled: Inductor must not choose kernels by timing them, since two ranks that
    # time differently could pick kernels that round differently, and diverge. Dynamo restores
    # use_deterministic_algorithms around every frame (an Inductor flag alone held for the first graph
    # only), and it also gives the replicated eager ops their deterministic kernels.
    torch.use_deterministic_algorithms(True, warn_only=True)
    import torch._inductor.config as inductor_config
    inductor_flags(inductor_config)
    return Shard(rank, world_size), device


def start(device: str, timeout_s: float, command: dict) -> tuple:
    """init, check that every rank runs the same command, and leave the printing to rank 0. Errors
    still print on every rank: torchrun stops the others at once, so the rank that failed first must
    be the one that says why."""
    shard, device = init(device, timeout_s)
    check_same_command(command)
    if shard is not None and shard.rank > 0:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _ErrorsOnly(sys.stderr)
    return shard, device


def check_gpu_count(ranks_here: int, gpus: int):
    """One GPU per rank: more ranks on a machine than GPUs is a mistake, not a thing to share."""
    if ranks_here > gpus:
        raise ValueError(f"tensor parallelism over {ranks_here} ranks on this machine needs {ranks_here} GPUs, it has "
                         f"{gpus}: use --nproc_per_node {gpus} or fewer")


def check_same_command(what: dict):
    """A rank started with another checkpoint, seed or flag would decide differently and its
    collectives would stop matching (a hang, or garbage): compare vars(args) across ranks."""
    if not active():
        return
    mine = {k: str(v) for k, v in what.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        for key in sorted(set(mine) | set(theirs)):
            if theirs.get(key) != everyone[0].get(key):
                raise ValueError(f"the ranks were started differently: rank {rank} has {key}={theirs.get(key)}, "
                                 f"rank 0 has {key}={everyone[0].get(key)}; every rank must run the same command")


def from_rank0(value):
    """Rank 0's value on every rank, for decisions taken from timings, which differ between ranks."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same_on_all_ranks(what: str, value):
    """A ValueError if the ranks disagree on value: the end-of-run check that they did not diverge."""
    if not active():
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    differ = [r for r, v in enumerate(everyone) if v != everyone[0]]
    if differ:
        raise ValueError(f"tensor parallelism: ranks {differ} produced other {what} than rank 0; the ranks diverged "
                         f"(different kernels, threads or inputs?)")


class _ErrorsOnly:
    """A stream that drops what is written to it until an error message or a traceback starts."""

    def __init__(self, stream):
        self.stream, self.passing = stream, False

    def write(self, text: str) -> int:
        self.passing = self.passing or text.startswith(("error:", "Traceback"))
        return self.stream.write(text) if self.passing else len(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):  # encoding, isatty, fileno ...: the stream's own
        return getattr(self.stream, name)


def finish():
    """Destroy the process group, joining the backend's threads while the interpreter is whole. This
    must drop the last reference: threads left to the interpreter's teardown now and then abort the
    rank after a correct answer. Hence init's early import, and graphs that name the group by string."""
    if active():
        dist.destroy_process_group()


def inductor_flags(config) -> list:
    """Set Inductor's config (or a test's stand-in) not to time kernels: deterministic mode where torch
    has it, else every timing flag one by one; flags a version lacks are skipped. Returns those set."""
    if hasattr(config, "deterministic"):
        config.deterministic = True
        return ["deterministic"]
    settings = {"max_autotune": False, "max_autotune_gemm": False, "max_autotune_pointwise": False,
                "coordinate_descent_tuning": False, "benchmark_fusion": False, "benchmark_epilogue_fusion": False,
                "dynamic_scale_rblock": False, "shape_padding": False,
                "triton.autotune_pointwise": False, "triton.multi_kernel": 0}
    done = []
    for name, value in settings.items():
        owner, _, attr = name.rpartition(".")
        target = getattr(config, owner, None) if owner else config
        if target is not None and hasattr(target, attr):
            setattr(target, attr, value)
            done.append(name)
    return done


def all_reduce_sum(x: Tensor) -> Tensor:
    """The sum of x over all ranks. Functional (a new tensor), so torch.compile traces it and a step or
    round stays one graph; the group goes by name, since a compiled graph would keep a group object."""
    from torch.distributed import _functional_collectives as funcol
    return funcol.all_reduce(x, "sum", _GROUP_NAME)


COLUMN, ROW = "column", "row"
# The dimension each tensor of a linear layer (float, int8, int4, expert stack) is split along, from the
# end so that [E, out, in] splits like [out, in]. Row-parallel: input columns and int4 groups; int8
# scales stay whole, and a bias is refused (it would be added on every rank).
SPLIT_DIM = {COLUMN: {"weight": -2, "bias": -1, "scales": -1, "scales_and_zeros": -2},
             ROW: {"weight": -1, "scales_and_zeros": -3}}


def check_divisible(config: ModelArgs, world_size: int):
    """A clear error when the model cannot be split evenly over world_size ranks."""
    sizes = {f"its {config.n_local_heads} key/value heads": config.n_local_heads,
             f"its {config.n_head} query heads": config.n_head,
             f"its feed-forward size {config.intermediate_size}": config.intermediate_size}
    problems = [what for what, size in sizes.items() if size % world_size]
    if problems:
        divisors = [n for n in range(1, config.n_local_heads + 1) if all(size % n == 0 for size in sizes.values())]
        fits = "cannot be split" if divisors == [1] else \
            f"can run on {', '.join(map(str, divisors[:-1]))} or {divisors[-1]} ranks"
        raise ValueError(f"tensor parallelism over {world_size} ranks splits every layer by heads: {world_size} "
                         f"does not divide {' and '.join(problems)}; this model {fits}")


def _qkv_sizes(config: ModelArgs) -> list:
    """Output rows of wqkv: queries, keys, values."""
    kv = config.n_local_heads * config.head_dim
    return [config.n_head * config.head_dim, kv, kv]


def _plan(config: ModelArgs) -> dict:
    """The sharding plan: module name in a layer -> (how it is split, out_features, in_features unsharded)."""
    dim, ff, q = config.dim, config.intermediate_size, config.n_head * config.head_dim
    return {"attention.wqkv": (COLUMN, sum(_qkv_sizes(config)), dim), "attention.wo": (ROW, dim, q),
            "feed_forward.w1": (COLUMN, ff, dim), "feed_forward.w3": (COLUMN, ff, dim),
            "feed_forward.w2": (ROW, dim, ff)}


def shard_state_dict(state_dict: dict, config: ModelArgs, shard: Shard) -> dict:
    """This rank's part of a memory-mapped state dict: the plan's tensors sliced, the rest as is. Only
    non-contiguous slices are copied out; the others stay views of the mapping."""
    check_divisible(config, shard.world_size)
    plan, out = _plan(config), {}
    for key, tensor in state_dict.items():
        parts = key.split(".")  # layers.{i}.{module}.{attr}.{tensor}
        module, kind = ".".join(parts[2:-1]), parts[-1]
        if parts[0] != "layers" or module not in plan:
            out[key] = tensor
            continue
        style, out_features, in_features = plan[module]
        if kind not in SPLIT_DIM[style]:
            if kind == "bias":
                raise ValueError(f"{key}: a row-parallel layer with a bias cannot be sharded "
                                 f"(it would be added N times)")
            out[key] = tensor  # int8 scales of a row-parallel layer
            continue
        if f"{'.'.join(parts[:-1])}.scales_and_zeros" in state_dict:
            _check_int4(key, state_dict, style, out_features, in_features, shard.world_size)
        dim = SPLIT_DIM[style][kind]
        if module == "attention.wqkv":  # the rank's queries, keys and values, each split by heads
            sizes = _qkv_sizes(config)
            if kind == "weight" and tensor.size(dim) != sum(sizes):
                raise ValueError(f"{key} has {tensor.size(dim)} output rows, the config says {sum(sizes)}")
            out[key] = torch.cat([_slice(p, dim, shard) for p in tensor.split(sizes, dim)], dim)
        else:
            out[key] = _slice(tensor, dim, shard).contiguous()
    return out


def _slice(t: Tensor, dim: int, shard: Shard) -> Tensor:
    size = t.size(dim) // shard.world_size
    return t.narrow(dim, shard.rank * size, size)


def _check_int4(key: str, state_dict: dict, style: str, out_features: int, in_features: int, world_size: int):
    """int4 layers must be unpadded and split at group boundaries and the kernel's row multiple."""
    prefix = key.rsplit(".", 1)[0]
    weight, groups = state_dict[f"{prefix}.weight"], state_dict[f"{prefix}.scales_and_zeros"]
    groupsize = 2 * weight.size(-1) // groups.size(0)
    if weight.size(-2) != out_features or 2 * weight.size(-1) != in_features:
        raise ValueError(f"{prefix}: int4 layer [{out_features}, {in_features}] was padded to [{weight.size(-2)}, "
                         f"{2 * weight.size(-1)}] by quantize.py and cannot be sharded: quantize with a group size "
                         f"that divides {in_features}")
    if style == ROW and (in_features // world_size) % groupsize:
        raise ValueError(f"{prefix}: int4 groups of {groupsize} input columns cannot be split over {world_size} ranks "
                         f"({in_features // world_size} columns each): quantize with a group size that divides "
                         f"{in_features // world_size}, or use int8")
    if style == COLUMN and (out_features // world_size) % INT4_N_MULTIPLE:
        raise ValueError(f"{prefix}: {out_features // world_size} output rows per rank; the int4 kernel needs a "
                         f"multiple of {INT4_N_MULTIPLE}: use int8 or fewer ranks")


def shard_model(model: Transformer, shard: Shard) -> Transformer:
    """Give a meta-device Transformer this rank's layer shapes and the all-reduce hooks. model.config
    stays the full model's: the draft and the features are full-width."""
    if model.norm.weight.device.type != "meta":
        raise ValueError("shard_model reshapes a model before its weights are loaded: build it on the meta device")
    c, N = model.config, shard.world_size
    check_divisible(c, N)
    with torch.device("meta"):
        for layer in model.layers:
            attn = layer.attention
            attn.n_head, attn.n_local_heads = c.n_head // N, c.n_local_heads // N  # this rank's heads
            for name, (style, out_features, in_features) in _plan(c).items():
                if style == COLUMN:
                    out_features //= N
                else:
                    in_features //= N
                if c.num_experts and name.startswith("feed_forward."):
                    new = Experts(c.num_experts, in_features, out_features)
                else:
                    new = nn.Linear(in_features, out_features, bias=c.qkv_bias and name == "attention.wqkv")
                layer.set_submodule(name, new)
    set_all_reduces(model, True)
    return model


def set_all_reduces(model: Transformer, on: bool) -> int:
    """Hook or unhook the all-reduce on every attention and feed-forward output (gpt-fast's way: the
    model never mentions ranks). Returns how many modules changed."""
    changed = 0
    for layer in model.layers:
        for m in (layer.attention, layer.feed_forward):
            handle = getattr(m, "tp_hook", None)
            if on == (handle is not None):
                continue  # already as asked
            if handle is not None:
                handle.remove()
            m.tp_hook = m.register_forward_hook(lambda module, args, output: all_reduce_sum(output)) if on else None
            changed += 1
    return changed


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights this process holds (parameters and quantized buffers; a tied matrix once)."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())
