"""--tree auto: the tree's shape (top_k, depth, tokens) from what rounds cost on this machine.

A round of shape (k, d, T) costs round = other + grow_1(k) + (d - 1) * level(k) + verify(T) and
emits tau(k, d, T) tokens, for which vanilla decoding takes tau steps: the predicted speedup is
tau * step / round. On a GPU verify(T) hardly grows with T; on a CPU it does, and a big tree can be
slower than none, so the shape is chosen per machine, and vanilla decoding when none pays.

tau comes from probe rounds per top_k with the deepest, largest tree: a smaller tree keeps the T - 1
best-scored candidates of depth <= d of the same pool, a subset closed under ancestors, so its
accepted path is the longest prefix of the probe's that it keeps (exact for greedy acceptance, an
estimate when sampling). Measurements are cached per machine, model, head, dtype and mode.
"""
import bisect
import hashlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

import torch

import tp
from compiling import compile_function, cuda_graph, device_sync
from draft import grow_dynamic_tree, most_tokens
from model import Transformer, TreeMask
from sampling import sample
from speculative import Speculator
from trees import Tree, tree_structure

# Fixed probe prompts (a cached measurement serves every later prompt), none from an evaluation set.
PROBE_TEXTS = ["Explain how a bicycle stays upright.", "Write a short poem about the sea.",
               "Give me three tips for learning a new language.", "What is the difference between weather and climate?"]
AUTO_TOP_K = (4, 6, 8, 10)
AUTO_TOKENS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
AUTO_TOKENS_CPU = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # compiled on a CPU, where verify(T) grows with T
AUTO_ROUNDS = 16         # probe rounds per top_k
AUTO_MIN_SPEEDUP = 1.05  # a tree must be predicted this much faster than vanilla decoding to be used


class ShapeCosts(NamedTuple):
    """Seconds, measured in the mode that will run (measure_shapes)."""
    step: float     # one vanilla decode step
    verify: dict    # {T: the target's forward over T tree tokens}
    grow: dict      # {top_k: (the tree's first level, each further level)}
    other: float    # the rest of a round: catch-up, acceptance, compaction, bookkeeping

    def round(self, top_k: int, depth: int, tokens: int, lookup: int = 0) -> float:
        """A round of a dynamic tree of this shape, plus lookup's chain of nodes in the verify."""
        first, level = self.grow[top_k]  # verify: on the line through the measured sizes where not measured
        return self.other + first + (depth - 1) * level + on_line(self.verify, tokens + lookup)


def on_line(points: dict, x: float) -> float:
    """points[x], else on the line through the nearest two points (the one value if there is one)."""
    if x in points:
        return points[x]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(bisect.bisect(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def predicted_tau(probes: list, depth: int, tokens: int) -> float:
    """Mean tokens per round of the tree (depth, tokens) over probe rounds: each probe is (scores
    [N], depth [N] of every candidate, the pool indices of the accepted path's nodes, root first)."""
    total = 0.0
    for scores, levels, accepted in probes:
        inside = scores[levels <= depth]
        bar = inside.topk(tokens - 1).values[-1] if tokens - 1 < inside.numel() else -float("inf")
        # the accepted path's prefix that this tree keeps
        kept = itertools.takewhile(lambda i: levels[i] <= depth and scores[i] >= bar, accepted)
        total += 1 + len(list(kept))
    return total / len(probes)


def choose_shape(costs: ShapeCosts, acceptance: dict, depths, tokens=AUTO_TOKENS,
                 min_speedup: float = AUTO_MIN_SPEEDUP, lookup: int = 0):
    """The rule of --tree auto, a pure function of costs and probes ({top_k: probes}). Returns (the best
    shape, or None for vanilla decoding below min_speedup; every shape's (speedup, tau, round / step),
    best first). The margin sends a close call to vanilla: a wrong choice must not slow decoding."""
    table = []
    for (k, probes), d, T in itertools.product(acceptance.items(), depths, tokens):
        if k not in costs.grow or T not in costs.verify or not 2 <= T <= most_tokens(k, d):
            continue
        tau = predicted_tau(probes, d, T)
        cost = costs.round(k, d, T, lookup) / costs.step  # lookup's nodes cost, their gain is not counted
        table.append((tau / cost, tau, cost, dict(tree_top_k=k, tree_depth=d, tree_tokens=T)))
    table.sort(key=lambda row: -row[0])
    return (table[0][3] if table and table[0][0] >= min_speedup else None), table


@torch.no_grad()
def measure_shapes(model: Transformer, draft, prompts: list, *, top_ks=AUTO_TOP_K, max_depth: int = 8,
                   tokens=AUTO_TOKENS, rounds: int = AUTO_ROUNDS, temperature: float = 0.0, top_k=None, top_p=None,
                   stop_ids=(), cuda_graphs: bool = False, compiled_cpu: bool = False):
    """(ShapeCosts, acceptance) measured on this machine: probe rounds per top_k with the deepest,
    largest tree; step, tree levels and verify(T) timed alone (medians). cuda_graphs: time CUDA graph
    replays, as a compiled CUDA run executes them (eager there is launch-bound). compiled_cpu: time
    compiled parts, with fewer graphs since each costs a compilation: growth for the largest top_k
    only (a level costs about one read of the draft), verify(T) at the ends, linear in between.
    Every rank takes rank 0's timings (tp.from_rank0), so that all choose the same shape."""
    device = model.norm.weight.device
    budget = (rounds + 2) * (max_depth + 1)
    largest = max(T for T in tokens if T <= max(most_tokens(k, max_depth) for k in top_ks))

    def clock():
        device_sync(device)
        return time.perf_counter()

    def seconds(fn, reset=lambda: None):
        if cuda_graphs:
            fn = cuda_graph(fn)
        elif compiled_cpu:
            fn = compile_function(fn, device, (model, draft))
        times = []
        for _ in range(6):  # the first call untimed: a warm-up, or the compilation
            reset()
            t = clock()
            fn()
            times.append(clock() - t)
        return tp.from_rank0(statistics.median(times[1:]))

    acceptance, grow, others = {}, {}, []
    for k in top_ks:
        spec = Speculator(model, draft, tree_top_k=k, tree_depth=max_depth,
                          tree_tokens=min(largest, most_tokens(k, max_depth)), temperature=temperature,
                          top_k=top_k, top_p=top_p, stop_ids=stop_ids)
        spec.setup(1, max(len(p) for p in prompts) + budget)
        probes, next_prompts = [], itertools.cycle(prompts)
        for i in range(rounds):
            if i == 0 or bool(spec.done[0]):
                spec.prefill(torch.tensor([next(next_prompts)], device=device), budget)
            t = clock()
            root_hidden = spec.catch_up()
            caught_up = clock() - t
            tree, pool = spec.grow(root_hidden, with_pool=True)
            logits, features = spec.verify(tree)
            t = clock()
            path, n_accepted = spec.finish(tree, logits, features)
            others.append(caught_up + clock() - t)
            accepted = pool.keep[0, path[0, 1:int(n_accepted[0]) + 1] - 1].tolist()
            probes.append((pool.scores[0].float().cpu(), pool.depth.cpu(), accepted))
        acceptance[k] = probes
        if compiled_cpu and k != max(top_ks):
            continue
        # the first level alone, and all of them, from the same state
        root_hidden = spec.catch_up()
        first = seconds(lambda: grow_dynamic_tree(draft, model.tok_embeddings, model.output, spec.root, root_hidden,
                                                  spec.prefix_len, k, 1, 2))
        full = seconds(lambda: spec.grow(root_hidden))
        grow[k] = (first, max(0.0, (full - first) / (max_depth - 1)))
    if compiled_cpu:
        grow = {k: grow[max(top_ks)] for k in top_ks}
        # the rest of a round, compiled, from the state a round leaves (restored before each timing)
        tree = spec.grow(spec.catch_up())
        logits, features = spec.verify(tree)
        state = [(buffer, buffer.clone()) for buffer in spec.buffers(recurse=False)]

        def restore():
            for buffer, saved in state:
                buffer.copy_(saved)

        others = [seconds(spec.catch_up, restore)
                  + seconds(lambda: spec.finish(tree, logits, features), restore)]
    # verify(T): the target's forward over T tree tokens (a chain) after a real prefix; compiled on a
    # CPU, at the ends only and on the line through the two in between
    spec.prefill(torch.tensor([prompts[0]], device=device), budget)
    timed = [T for T in tokens if T <= largest]
    verify = {}
    for T in [min(timed), max(timed)] if compiled_cpu else timed:
        parents = torch.arange(-1, T - 1, device=device)[None]
        chain = Tree(spec.root[:, None].expand(1, T).clone(), parents, *tree_structure(parents, T - 1))
        verify[T] = seconds(lambda: model(chain.tokens, spec.prefix_len[:, None] + chain.depth,
                                          model.max_seq_length - T + torch.arange(T, device=device),
                                          TreeMask(spec.prefix_len, chain.ancestors)))
    verify = {T: on_line(verify, T) for T in timed}
    token, position = spec.root.clone(), spec.prefix_len.clone()

    def step():  # one vanilla decode step, as generate.decode_one_token (in place: a CUDA graph replays it)
        token.copy_(sample(model(token[:, None], position[:, None])[:, -1], *spec.sampling))

    costs = ShapeCosts(step=seconds(step), verify=verify, grow=grow, other=tp.from_rank0(statistics.median(others)))
    return costs, acceptance


def auto_tree(model: Transformer, draft, prompts: list, device: str, compiled: bool, files, tree_top_k=None,
              tree_depth=None, **kwargs) -> Optional[dict]:
    """auto_shape for a run on device, compiled or not, the tree's top_k and depth fixed where given;
    cached per machine, files (checkpoint, head: their names, sizes, times), dtypes and mode."""
    paths = [Path(f) / "draft.safetensors" if Path(f).is_dir() else Path(f) for f in files]
    key = dict(hardware=torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu_name(),
               cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__, host=platform.node(),
               files=[dict(path=str(p.resolve()), size=p.stat().st_size, mtime=p.stat().st_mtime_ns) for p in paths],
               dtype=str(model.norm.weight.dtype), draft_dtype=str(draft.layer.ffn_norm.weight.dtype),
               compiled=compiled)
    return auto_shape(model, draft, prompts, cuda_graphs=compiled and device.startswith("cuda"),
                      compiled_cpu=compiled and device == "cpu",
                      top_ks=AUTO_TOP_K if tree_top_k is None else (tree_top_k,),
                      depths=range(1, 9) if tree_depth is None else (tree_depth,), cache_key=key, **kwargs)


def auto_shape(model: Transformer, draft, prompts: list, *, top_ks=AUTO_TOP_K, depths=range(1, 9), stop_ids=(),
               cuda_graphs: bool = False, compiled_cpu: bool = False, cache_key: Optional[dict] = None,
               lookup: int = 0, **sampling) -> Optional[dict]:
    """--tree auto: measure_shapes (or its cached result), choose_shape and say why; None for vanilla
    decoding. With cache_key (machine, model, head, dtype, mode) the measurement is kept in
    $EAGLE_AUTO_CACHE, else the user's cache."""
    if not prompts or not all(prompts):
        raise ValueError("--tree auto measures on prompts; none was given")
    tokens = AUTO_TOKENS_CPU if compiled_cpu else AUTO_TOKENS
    cache = None
    if cache_key is not None:
        key = dict(cache_key, top_ks=list(top_ks), max_depth=max(depths), tokens=list(tokens), rounds=AUTO_ROUNDS,
                   sampling=sampling, compiled_cpu=compiled_cpu)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        cache = Path(os.environ.get("EAGLE_AUTO_CACHE") or Path.home() / ".cache/eagle-gpt-fast/auto") / f"{digest}.pt"
    t = time.perf_counter()
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=True)
        costs, acceptance = ShapeCosts(**saved["costs"]), saved["acceptance"]
        how = f"read {cache}"
    else:
        costs, acceptance = measure_shapes(model, draft, prompts, top_ks=top_ks, max_depth=max(depths), tokens=tokens,
                                           stop_ids=stop_ids, cuda_graphs=cuda_graphs, compiled_cpu=compiled_cpu,
                                           **sampling)
        how = f"measured for {time.perf_counter() - t:.1f} s"
        if cache is not None:
            # Renamed when whole: a process measuring at the same time never reads half a file.
            cache.parent.mkdir(parents=True, exist_ok=True)
            partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
            torch.save({"costs": costs._asdict(), "acceptance": acceptance}, partial)
            os.replace(partial, cache)
    choice, table = choose_shape(costs, acceptance, depths, tokens, lookup=lookup)
    print(f"--tree auto: {how}; a vanilla step takes {costs.step * 1e3:.1f} ms. Best shapes "
          f"(top_k, depth, tokens: predicted tokens per round, round cost in steps, speedup):", file=sys.stderr)
    for speedup, tau, cost, shape in table[:5]:
        print(f"  {shape['tree_top_k']:3d} {shape['tree_depth']:3d} {shape['tree_tokens']:4d}: tau {tau:.2f}, "
              f"round {cost:.2f} steps -> {speedup:.2f}x", file=sys.stderr)
    if choice is None:
        print(f"--tree auto: no tree is predicted to be {AUTO_MIN_SPEEDUP}x faster than vanilla decoding "
              f"on this machine: decoding without speculation", file=sys.stderr)
    return choice


def cpu_name() -> str:
    """The CPU's model name with family, model and AMX where /proc/cpuinfo tells them: the name alone
    can be the same for two generations whose timings differ."""
    info = {}  # the first CPU's fields
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    if not info.get("model name"):
        return platform.processor() or platform.machine()
    if not info.get("cpu family"):
        return info["model name"]
    amx = "AMX" if "amx_tile" in info.get("flags", "").split() else "no AMX"
    return f"{info['model name']} (family {info['cpu family']}, model {info.get('model', '?')}, {amx})"


def probe_prompts(tokenizer, chat: bool = True) -> list:
    """PROBE_TEXTS as token ids (in the chat template, with chat)."""
    if chat:
        return [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in PROBE_TEXTS]
    return [tokenizer.encode(text) for text in PROBE_TEXTS]
