"""Tensor parallelism: the target sharded over the ranks of torch.distributed, as in gpt-fast.

    python -m torch.distributed.run --nproc_per_node 2 generate.py --checkpoint_path ... --speculate eagle2

Each of the N ranks (one per GPU with NCCL; one process each with gloo on a CPU) holds 1/N of
every decoder layer, and two all-reduces per layer put the pieces together:

    attention.wqkv       column-parallel by heads: rank r computes query heads r*H/N .. (r+1)*H/N - 1
                         and KV heads r*KV/N .. (r+1)*KV/N - 1. With GQA the query heads sharing a KV
                         head are consecutive, so they stay on the rank that holds it; N must divide KV.
    attention.wo         row-parallel: the input columns of the rank's heads. Its output is a partial
                         sum over heads: all-reduce #1.
    feed_forward.w1, w3  column-parallel: 1/N of the intermediate size (the SwiGLU product is per column)
    feed_forward.w2      row-parallel: partial sums over the intermediate size: all-reduce #2.
    Mixtral experts      the same, inside every expert: each rank holds 1/N of all E experts, so every
                         rank has the same share of the work whichever 2 experts a token is routed to
                         (sharding by expert would leave the ranks without the token's experts idle).

Everything else is replicated, and computed redundantly but identically on every rank: the
embedding, the norms, the router, the LM head, and the EAGLE draft. The residual stream after each
all-reduce is the full `dim`-wide hidden state on every rank, so the EAGLE features (the final
post-norm state, or EAGLE-3's layer inputs) need no gather. The LM head stays whole because every
rank needs the full logits anyway, for sampling, acceptance and the EAGLE-1/2 draft's guesses at
each tree level; sharding it by vocabulary would add an all-gather of logits to each of those
places. What replication costs is a vocab x dim matrix per rank (LLaMA-2-70B: 0.5 GB in bf16, 3 %
of a rank's reads per step at N = 8; LLaMA-3-70B's 128k vocabulary: 2.1 GB, 11 %; see
benchmarks/README.md).

Why the ranks cannot diverge, so that each decides alone, without talking to the others beyond the
target's all-reduces: they start from the same inputs (the same command, checked by
check_same_command; the same prompt); an all-reduce leaves the bit-identical sum on every rank
(with two ranks a + b = b + a; with more, NCCL's and gloo's ring and tree algorithms reduce each
element once and copy the result to all); the replicated computations after it run the same kernels
on the same shapes, hence give the same bits (same GPU model; on a CPU the same thread count, from
the same environment: torchrun sets OMP_NUM_THREADS=1 for every rank; inductor's kernel
autotuning, which picks kernels by timing them, is kept off under tensor parallelism (no_autotuning,
from init) so that two ranks cannot pick two differently-rounding kernels); sampling draws from the
same random stream (the same seed and the same sequence of draws on every rank). Then every rank
grows the same tree, deterministically, takes the same acceptance decision, stops after the same
round, and issues the same sequence of all-reduces. The one decision made from timings,
--tree_tokens auto, is taken on rank 0 and broadcast (from_rank0). generate.py checks at the end
that all ranks produced the same tokens.

Quantized targets are sharded after quantizing: each rank slices the int8/int4 file that
quantize.py wrote, rather than quantizing its float shard itself. The ranks then compute with
exactly the weights a single GPU would use (quantizing a row-parallel shard would give its rows
per-shard scales, a different model for every N), and a rank reads 1/N of the smaller file and
does no quantization work at load time. int8 scales are per output channel: they are sliced with
the rows of a column-parallel layer and kept whole for a row-parallel one (the scale multiplies a
partial sum as it does the full one). int4 groups run along the input dimension: a row-parallel
layer needs (in_features / N) to be a multiple of the group size, so that no group straddles two
ranks, and padded int4 layers are refused (a clear error suggests another group size or N).

Loading (checkpoint.load_model with a Shard): the file is memory-mapped and each rank copies out
only its slices; the replicated tensors stay views of the mapping. The page cache holds the file
once for all ranks of a machine, so no rank ever holds the whole checkpoint in its own memory.
"""
import atexit
import os
import sys
from datetime import timedelta
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from model import Experts, ModelArgs, Transformer
from quantize import INT4_N_MULTIPLE

DEFAULT_TIMEOUT_S = 600  # how long a rank waits for the others: to join, and at each collective
_GROUP_NAME = None  # the default group's name, for all_reduce_sum (set by init)


class Shard(NamedTuple):
    """Which part of the target this process holds: rank `rank` of `world_size`."""
    rank: int
    world_size: int


# ---------------------------------------------------------------------------------------------
# The process group
# ---------------------------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def active() -> bool:
    """Whether this process is one rank of a tensor-parallel group (init succeeded)."""
    return dist.is_available() and dist.is_initialized()


def init(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple:
    """(Shard, this rank's device) when started by torchrun (even with one process, so that TP=1
    can run through the distributed code path), else (None, device). NCCL on CUDA, gloo on CPU.

    A rank that never joins must not leave the others waiting forever: the process group is
    created with a timeout, which covers both the rendezvous and every later collective (a rank
    that dies mid-generation), and running out of it is a ValueError that says what happened."""
    if not launched_by_torchrun():
        return None, device
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.startswith("cuda"):
        # cuBLAS is deterministic with a fixed workspace only (no_autotuning asks for deterministic
        # kernels); it must be set before the first cuBLAS call of the process.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        check_gpu_count(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), torch.cuda.device_count())
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # Imported before the process group exists, on purpose: finish() must be able to free the group
    # (see there). torch.distributed.nn.functional binds `group=group.WORLD` as a default argument of
    # its functions when it is imported, and the first functional collective imports it: imported
    # after init, those defaults would hold the default group for the rest of the process.
    import torch.distributed.nn.functional  # noqa: F401
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:  # DistStoreError / DistNetworkError: nobody came
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tensor parallelism: rank {rank} waited {timeout_s:g} s and not all {world_size} ranks "
                         f"joined ({first}); start every rank with the same command (torchrun does), or raise "
                         f"--tp_timeout") from None
    # A command that returns or exits early (an error, --compare, --interactive) still tears the group
    # down while the interpreter is whole; after a finish() this does nothing.
    atexit.register(finish)
    global _GROUP_NAME
    _GROUP_NAME = dist.group.WORLD.group_name
    no_autotuning()  # before anything is compiled, by whichever command
    return Shard(rank, world_size), device


def start(device: str, timeout_s: float, command: dict) -> tuple:
    """What generate.py and scripts/benchmark.py do first: init, check that every rank runs the
    same command (a dict of its arguments), and leave the printing to rank 0. Returns init's
    (Shard or None, device); a ValueError says what went wrong."""
    shard, device = init(device, timeout_s)
    check_same_command(command)
    silence_other_ranks(shard)
    return shard, device


def check_gpu_count(ranks_here: int, gpus: int):
    """One GPU per rank: more ranks on a machine than GPUs is a mistake, not a thing to share."""
    if ranks_here > gpus:
        raise ValueError(f"tensor parallelism over {ranks_here} ranks on this machine needs {ranks_here} GPUs, it has "
                         f"{gpus}: use --nproc_per_node {gpus} or fewer")


def check_same_command(what: dict):
    """Every rank must run the same command: a rank started with another checkpoint, seed or
    flag would take other decisions and the ranks' collectives would stop matching (a hang, or
    garbage). Compares `what` (a command's vars(args)) across ranks; a ValueError names the first
    difference."""
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
    """Rank 0's value on every rank (identity without a process group): for decisions that are
    taken from timings, which differ from rank to rank (--tree_tokens auto)."""
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


def silence_other_ranks(shard: Optional[Shard]):
    """Ranks > 0 compute what rank 0 computes: only rank 0 prints its results (and writes files).
    Their errors still print: when a rank fails, torchrun stops the others at once, so the rank that
    failed first, whichever it is, must be the one that says why."""
    if shard is not None and shard.rank > 0:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _ErrorsOnly(sys.stderr)


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
    """Destroy the process group, and with it the backend's threads (gloo: a socket loop and two
    workers), joined here while the interpreter is whole. That takes the last reference to the
    group: anything still holding it keeps those threads running into the interpreter's teardown,
    where they were destroyed in no set order and now and then killed the rank ("terminate called
    without an active exception", SIGABRT, torchrun FAILED after a correct answer). Two holders
    are kept out: torch.distributed.nn.functional's default arguments (imported before init) and
    compiled graphs, which see the group only by name (all_reduce_sum)."""
    if active():
        dist.destroy_process_group()


def no_autotuning():
    """Keep inductor from choosing kernels by timing them, under tensor parallelism: two ranks
    that time differently could pick two kernels that round differently, and diverge.

    Set through torch.use_deterministic_algorithms: dynamo saves that flag before every frame it
    compiles and restores it after, and newer torch sets inductor's deterministic mode from it, so
    an inductor flag set on its own (as generate.py did) held for the first compiled graph only;
    older torch, which has no deterministic mode, reads the flag into each kernel and then gives
    pointwise and reduction kernels one configuration each instead of timing several. It also
    makes the replicated eager ops pick their deterministic kernels where they have one, which two
    ranks need as much (warn_only: an op without one warns, it does not fail). inductor_flags
    turns off the other ways of timing. Returns the inductor flags set."""
    import torch._inductor.config as inductor_config

    torch.use_deterministic_algorithms(True, warn_only=True)
    return inductor_flags(inductor_config)


def inductor_flags(config) -> list:
    """Inductor's config (config: its module, or a stand-in in the tests) set not to time kernels:
    deterministic mode where torch has it, which covers every case; otherwise each way by its own
    flag: several configurations of a pointwise kernel (and, in those versions, of a reduction:
    triton.autotune_pointwise), a reduction's block halved when it spills (dynamic_scale_rblock),
    padded against unpadded matmuls (shape_padding), fusions and templates (benchmark_fusion,
    max_autotune*), coordinate descent and multi-kernels. Flags a version lacks are skipped."""
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
    """The sum of x over all ranks. A functional collective: it returns a new tensor instead of
    writing into x, so torch.compile traces it into the graph (no graph break), and a decode step
    or a speculative round stays one graph per rank. The group is passed by name, a string: given
    the group object, dynamo would keep it in every compiled graph (and finish() could not free it)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", _GROUP_NAME)


# ---------------------------------------------------------------------------------------------
# The sharding plan
# ---------------------------------------------------------------------------------------------
COLUMN, ROW = "column", "row"
PLAN = {  # module name inside a layer -> how it is split
    "attention.wqkv": COLUMN,
    "attention.wo": ROW,
    "feed_forward.w1": COLUMN,
    "feed_forward.w3": COLUMN,
    "feed_forward.w2": ROW,
}
# The dimension each tensor of a linear layer (nn.Linear, model.Experts, or their int8/int4 forms)
# is split along. Counted from the end, so that an expert stack [E, out, in] and its int8 scales
# [E, out] split like a plain weight [out, in] and its scales [out].
#   column-parallel: every tensor with an output dimension is split along it.
#   row-parallel: the weight's input columns and the int4 groups (which run along the input);
#     int8 scales (one per output channel) stay whole. Row-parallel layers have no bias here: it
#     would have to be added on one rank only.
SPLIT_DIM = {
    COLUMN: {"weight": -2, "bias": -1, "scales": -1, "scales_and_zeros": -2},
    ROW: {"weight": -1, "scales_and_zeros": -3},
}


def check_divisible(config: ModelArgs, world_size: int):
    """A clear error when the model cannot be split evenly over world_size ranks."""
    problems = []
    if config.n_local_heads % world_size:
        problems.append(f"its {config.n_local_heads} key/value heads")
    if config.n_head % world_size:
        problems.append(f"its {config.n_head} query heads")
    if config.intermediate_size % world_size:
        problems.append(f"its feed-forward size {config.intermediate_size}")
    if problems:
        divisors = [n for n in range(1, config.n_local_heads + 1) if config.n_local_heads % n == 0
                    and config.n_head % n == 0 and config.intermediate_size % n == 0]
        fits = "cannot be split" if divisors == [1] else \
            f"can run on {', '.join(map(str, divisors[:-1]))} or {divisors[-1]} ranks"
        raise ValueError(f"tensor parallelism over {world_size} ranks splits every layer by heads: {world_size} "
                         f"does not divide {' and '.join(problems)}; this model {fits}")


def _qkv_sizes(config: ModelArgs) -> list:
    """Output rows of wqkv: queries, keys, values."""
    return [config.n_head * config.head_dim, config.n_local_heads * config.head_dim, config.n_local_heads * config.head_dim]


def _full_sizes(config: ModelArgs, module: str) -> tuple:
    """(out_features, in_features) of a layer's module before sharding."""
    q = config.n_head * config.head_dim
    return {"attention.wqkv": (sum(_qkv_sizes(config)), config.dim), "attention.wo": (config.dim, q),
            "feed_forward.w1": (config.intermediate_size, config.dim),
            "feed_forward.w3": (config.intermediate_size, config.dim),
            "feed_forward.w2": (config.dim, config.intermediate_size)}[module]


def shard_state_dict(state_dict: dict, config: ModelArgs, shard: Shard) -> dict:
    """This rank's part of a (memory-mapped) state dict: the tensors of the PLAN's modules sliced,
    everything else as it is. A slice that is not contiguous in the file (input columns) is copied
    out, only that much; a contiguous one stays a view of the mapping until it is moved."""
    check_divisible(config, shard.world_size)
    out = {}
    for key, tensor in state_dict.items():
        parts = key.split(".")  # layers.{i}.{module}.{attr}.{tensor}
        module, kind = ".".join(parts[2:-1]), parts[-1]
        style = PLAN.get(module) if parts[0] == "layers" else None
        if style is None:
            out[key] = tensor
            continue
        if kind not in SPLIT_DIM[style]:
            if kind == "bias":
                raise ValueError(f"{key}: a row-parallel layer with a bias cannot be sharded (it would be added N times)")
            out[key] = tensor  # int8 scales of a row-parallel layer
            continue
        if f"{'.'.join(parts[:-1])}.scales_and_zeros" in state_dict:
            _check_int4(key, state_dict, config, module, style, shard.world_size)
        dim = SPLIT_DIM[style][kind]
        if module == "attention.wqkv":  # the rank's queries, keys and values, each split by heads
            sizes = _qkv_sizes(config)
            if kind == "weight" and tensor.size(dim) != sum(sizes):
                raise ValueError(f"{key} has {tensor.size(dim)} output rows, the config says {sum(sizes)}")
            pieces = [_slice(p, dim, shard) for p in tensor.split(sizes, dim)]
            out[key] = torch.cat(pieces, dim)
        else:
            out[key] = _slice(tensor, dim, shard).contiguous()
    return out


def _slice(t: Tensor, dim: int, shard: Shard) -> Tensor:
    size = t.size(dim) // shard.world_size
    return t.narrow(dim, shard.rank * size, size)


def _check_int4(key: str, state_dict: dict, config: ModelArgs, module: str, style: str, world_size: int):
    """int4 layers: unpadded, and split at group boundaries (row-parallel) and at the kernel's
    row multiple (column-parallel)."""
    prefix = key.rsplit(".", 1)[0]
    weight, groups = state_dict[f"{prefix}.weight"], state_dict[f"{prefix}.scales_and_zeros"]
    out_features, in_features = _full_sizes(config, module)
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
    """Give a Transformer on the meta device (weights not loaded yet) this rank's layer shapes
    and the all-reduces after attention and feed-forward. model.config stays the full model's:
    the draft and the features are full-width."""
    if model.norm.weight.device.type != "meta":
        raise ValueError("shard_model reshapes a model before its weights are loaded: build it on the meta device")
    c, N = model.config, shard.world_size
    check_divisible(c, N)
    local = c.intermediate_size // N
    with torch.device("meta"):
        for layer in model.layers:
            attn, ff = layer.attention, layer.feed_forward
            attn.n_head, attn.n_local_heads = c.n_head // N, c.n_local_heads // N  # this rank's heads
            attn.wqkv = nn.Linear(c.dim, sum(_qkv_sizes(c)) // N, bias=c.qkv_bias)
            attn.wo = nn.Linear(c.n_head * c.head_dim // N, c.dim, bias=False)
            if c.num_experts:
                ff.w1, ff.w3, ff.w2 = Experts(c.num_experts, c.dim, local), Experts(c.num_experts, c.dim, local), \
                    Experts(c.num_experts, local, c.dim)
            else:
                ff.w1, ff.w3 = nn.Linear(c.dim, local, bias=False), nn.Linear(c.dim, local, bias=False)
                ff.w2 = nn.Linear(local, c.dim, bias=False)
            attn.tp_reduce = ff.tp_reduce = all_reduce_sum
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights this process holds (parameters and quantized buffers; a tied matrix once)."""
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
