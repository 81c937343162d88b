"""EAGLE speculative decoding: the engine. generate.py is its command line.

Each round brings the draft up to date, grows a tree of guesses, verifies all of them in one
target forward, accepts the longest correct path (plus one token from the target), and copies
the accepted nodes' K/V down to the end of the prefix:

    accept                 the lossless acceptance rule (greedy and sampling)
    Speculator             target + draft + the state between rounds; round() is one graph
    speculative_generate   the driver: prefill, rounds until every row stops
    compile_round          torch.compile of a round
    choose_tree_tokens ... --tree_tokens auto: what a round costs on this machine
"""
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

import tp
from draft import dynamic_tree_slots, grow_dynamic_tree, grow_static_tree
from model import Transformer, TreeMask, copy_slots
from sampling import cut_at_stop, logits_to_probs, sample, sample_from
from tree import Tree


def accept(tree: Tree, logits: Tensor, temperature: float, top_k: Optional[int] = None,
           top_p: Optional[float] = None):
    """Walk the tree from the root, choosing at each node the token the target would emit there.

    logits [B, T, V]: the target's logits at every node. Returns (node [B]: the last accepted node,
    n_accepted [B]: its depth, bonus [B]: the token the target emits after it).

    At a node let p be the target's processed distribution (logits_to_probs: temperature, top-k,
    top-p — exactly what vanilla sampling draws from). Its children x_1, x_2, ... are distinct
    tokens in the draft's rank order. Accept x_1 with probability p(x_1); if rejected, remove x_1
    from p and renormalise, then accept x_2 with probability p(x_2) / (1 - p(x_1)), and so on; if
    every child is rejected, draw the token from what is left of p. Then
        P(emit x_i) = prod_{j<i} (1 - p(x_j) / (1 - s_{j-1})) * p(x_i) / (1 - s_{i-1}) = p(x_i),
    with s_i = p(x_1) + ... + p(x_i), since the product telescopes to 1 - s_{i-1}; and a token y
    that is no child is emitted with probability (1 - s_n) * p(y) / (1 - s_n) = p(y). So each step
    emits exactly a sample of p, the draft having chosen its children (a point-mass proposal)
    without looking at the target's randomness. After an accepted child the walk continues with
    that child's distribution, which the target computed with the accepted prefix; the emitted
    sequence is therefore distributed as vanilla sampling. Greedy is the same walk with p one-hot
    at the target's argmax: the child equal to the argmax is accepted, else the argmax is emitted.
    """
    B, T, V = logits.shape
    max_depth = tree.paths.size(-1) - 1
    rows = torch.arange(B, device=logits.device)
    node = torch.zeros(B, dtype=torch.long, device=logits.device)
    alive = torch.ones(B, dtype=torch.bool, device=logits.device)
    bonus = torch.zeros(B, dtype=torch.long, device=logits.device)
    for _ in range(max_depth + 1):  # the last pass only draws the bonus at a deepest node
        node_logits = logits[rows, node]
        if temperature == 0:
            p = torch.zeros_like(node_logits, dtype=torch.float).scatter_(1, node_logits.argmax(-1, keepdim=True), 1.0)
        else:
            p = logits_to_probs(node_logits, temperature, top_k, top_p)
        is_child = tree.parents == node[:, None]  # [B, T], in rank order
        p_child = p.gather(1, tree.tokens) * is_child
        mass_before = p_child.cumsum(1) - p_child  # higher-ranked siblings already rejected
        ratio = p_child / (1 - mass_before).clamp(min=1e-30)
        if temperature == 0:
            hit = is_child & (ratio > 0.5)  # ratio is exactly 1 for the argmax child, 0 for the others
        else:
            hit = is_child & (torch.rand(B, T, device=logits.device) < ratio)
        found = hit.any(1)
        # Rows that accept no child stop here; their next token is drawn from p without the children.
        child_tokens = torch.where(is_child, tree.tokens, V)  # V: a dummy column for non-children
        residual = torch.cat([p, p.new_zeros(B, 1)], 1).scatter(1, child_tokens, 0.0)[:, :V]
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)  # float round-off guard
        drawn = residual.argmax(-1) if temperature == 0 else sample_from(residual)  # (unnormalised is fine)
        bonus = torch.where(alive & ~found, drawn, bonus)
        node = torch.where(alive & found, hit.int().argmax(1), node)
        alive = alive & found
    return node, tree.depth[rows, node], bonus


class Speculator(nn.Module):
    """A target, its EAGLE draft, and the state carried between rounds, kept in buffers of fixed
    shape so that round() compiles into one graph (one CUDA graph on GPU) that updates them in
    place. Per row b of the batch:
        prefix_len  tokens in the target's KV cache; the root (next token, chosen by the target
                    but not yet in its cache) is token number prefix_len
        cu_tokens, cu_features, cu_count   the draft's catch-up input: the last cu_count
                    (token, target feature) pairs the draft has not seen yet
        out, n_out  the tokens generated so far;  done  the row has stopped (stop token or limit)
    static: a StaticTree (EAGLE-1), or None for the dynamic EAGLE-2 tree of tree_top_k/depth/tokens.
    """

    def __init__(self, target: Transformer, draft, *, static=None, tree_top_k: int = 10, tree_depth: int = 6,
                 tree_tokens: int = 60, temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, stop_ids=()):
        super().__init__()
        vocab = getattr(draft, "draft_vocab_size", target.config.vocab_size)  # what the draft chooses from
        if static is not None:
            tree_depth, tree_tokens = static.max_depth, static.parents.numel()
            if static.n_ranks > vocab:
                raise ValueError(f"the static tree uses child rank {static.n_ranks - 1}, the draft's vocabulary has "
                                 f"{vocab} tokens")
        else:
            if not 1 <= tree_top_k <= vocab:
                raise ValueError(f"--tree_top_k must be in [1, {vocab}], got {tree_top_k}")
            if tree_depth < 1:
                raise ValueError(f"--tree_depth must be >= 1, got {tree_depth}")
            most = 1 + tree_top_k + (tree_depth - 1) * tree_top_k ** 2
            if not 2 <= tree_tokens <= most:
                raise ValueError(f"--tree_tokens must be in [2, {most}] for top_k {tree_top_k} and depth {tree_depth}, "
                                 f"got {tree_tokens}")
        self.target, self.draft, self.static = target, draft, static
        self.tree_top_k, self.depth, self.n_nodes = tree_top_k, tree_depth, tree_tokens
        self.sampling = (temperature, top_k, top_p)
        self.register_buffer("stop_ids", torch.tensor(sorted(stop_ids), dtype=torch.long), persistent=False)
        self.feature_dim = target.config.dim * max(1, len(draft.layer_ids))  # EAGLE-3 reads three layers
        self.capacity = 0

    def draft_region(self) -> int:
        return self.n_nodes - 1 if self.static is not None else dynamic_tree_slots(self.tree_top_k, self.depth)

    def setup(self, batch_size: int, max_seq_length: int):
        """Caches and state for batch_size rows of up to max_seq_length tokens each, plus the
        tree regions at the ends of both caches. Everything a round reads lives on the model's
        device from here on: a tensor left on the host would cost a copy inside every round, split
        its graph, or fail outright (torch.isin of a CUDA and a CPU tensor)."""
        device = self.target.norm.weight.device
        self.stop_ids = self.stop_ids.to(device)
        if self.static is not None:
            self.static = self.static.to(device)
        self.target.setup_caches(batch_size, max_seq_length + self.n_nodes)
        self.draft.setup_caches(batch_size, max_seq_length + self.draft_region())
        self.capacity = min(self.target.max_seq_length - self.n_nodes, self.draft.max_seq_length - self.draft_region())
        B, D1 = batch_size, self.depth + 1
        if getattr(self, "out", None) is not None and self.out.shape == (B, self.capacity):
            return
        long = dict(dtype=torch.long, device=device)
        for name, value in dict(
            prefix_len=torch.zeros(B, **long), root=torch.zeros(B, **long),
            cu_tokens=torch.zeros(B, D1, **long), cu_count=torch.zeros(B, **long),
            cu_features=torch.zeros(B, D1, self.feature_dim, dtype=self.target.norm.weight.dtype, device=device),
            out=torch.zeros(B, self.capacity, **long), n_out=torch.zeros(B, **long),
            done=torch.zeros(B, dtype=torch.bool, device=device), limit=torch.zeros((), **long),
        ).items():
            self.register_buffer(name, value, persistent=False)

    def prefill(self, prompt: Tensor, max_new_tokens: int):
        """Target and draft read the prompt [B, L]; the first new token is sampled exactly as in vanilla decoding."""
        B, L = prompt.shape
        if L + max_new_tokens + 2 * (self.depth + 1) > self.capacity or B != self.out.size(0):
            self.setup(B, L + max_new_tokens + 2 * (self.depth + 1))  # room for the last round's overshoot
        target, device = self.target, prompt.device
        logits, final, layer_inputs = target(prompt, torch.arange(L, device=device), return_features=True,
                                             layer_ids=self.draft.layer_ids)
        features = self.draft.select_features(final, layer_inputs)
        root = sample(logits[:, -1], *self.sampling)
        if L > 1:  # draft position t holds (f_t, tok_{t+1}); the last one, (f_{L-1}, root), is caught up in round 1
            self.draft(target.tok_embeddings(prompt[:, 1:]), features[:, :-1], torch.arange(L - 1, device=device))
        self.prefix_len.fill_(L)
        self.root.copy_(root)
        self.cu_tokens.zero_()
        self.cu_tokens[:, 0] = root
        self.cu_features.zero_()
        self.cu_features[:, 0] = features[:, -1]
        self.cu_count.fill_(1)
        self.out.zero_()
        self.out[:, 0] = root
        self.n_out.fill_(1)
        self.limit.fill_(max_new_tokens)
        self.done.copy_(torch.isin(root, self.stop_ids) | (max_new_tokens <= 1))

    def round(self):
        """One speculative round over all rows; rows that are done are left as they are. Its phases
        are methods of their own so that scripts/profile_round.py can time each; compiled, the
        round is still one graph (they are traced inline)."""
        root_hidden = self.catch_up()
        tree = self.grow(root_hidden)
        logits, features = self.verify(tree)
        node, n_accepted, bonus = accept(tree, logits, *self.sampling)  # the path to node, then the target's token
        path = self.compact(tree, node)
        self.advance(tree, path, n_accepted, bonus, features)

    def catch_up(self) -> Tensor:
        """The draft reads the pairs accepted last round, at positions L - cu_count ... (unused
        trailing entries are overwritten later). Returns its output at the root [B, dim], which
        predicts the root's children."""
        B, device = self.root.size(0), self.root.device
        steps = torch.arange(self.depth + 1, device=device)
        hidden = self.draft(self.target.tok_embeddings(self.cu_tokens), self.cu_features,
                            (self.prefix_len - self.cu_count)[:, None] + steps)
        return hidden[torch.arange(B, device=device), self.cu_count - 1]

    def grow(self, root_hidden: Tensor) -> Tree:
        """The tree of guesses."""
        target, draft = self.target, self.draft
        if self.static is None:
            return grow_dynamic_tree(draft, target.tok_embeddings, target.output, self.root, root_hidden,
                                     self.prefix_len, self.tree_top_k, self.depth, self.n_nodes)
        return grow_static_tree(draft, target.tok_embeddings, target.output, self.static, self.root, root_hidden,
                                self.prefix_len)

    def verify(self, tree: Tree):
        """One target forward over all nodes, kept in the last n_nodes slots of its cache. Returns the
        logits at every node and what the draft reads there (its features)."""
        target, L = self.target, self.prefix_len
        region_start = target.max_seq_length - self.n_nodes
        logits, final, layer_inputs = target(
            tree.tokens, L[:, None] + tree.depth, region_start + torch.arange(self.n_nodes, device=L.device),
            TreeMask(L, tree.ancestors), return_features=True, layer_ids=self.draft.layer_ids)
        return logits, self.draft.select_features(final, layer_inputs)

    def compact(self, tree: Tree, node: Tensor) -> Tensor:
        """Copy the accepted nodes' K/V from the tree region to the slots after the prefix, in every
        layer at once. Returns the accepted path [B, depth + 1]: root, accepted nodes, then -1."""
        B, device = node.size(0), node.device
        path = tree.paths[torch.arange(B, device=device), node]
        region_start = self.target.max_seq_length - self.n_nodes
        copy_slots(self.target.kv_storage, region_start + path.clamp(min=0),
                   self.prefix_len[:, None] + torch.arange(self.depth + 1, device=device))
        return path

    def advance(self, tree: Tree, path: Tensor, n_accepted: Tensor, bonus: Tensor, features: Tensor):
        """The new tokens: the accepted guesses, then the bonus token. They are also the draft's next
        catch-up input, paired with the target's true features at root, node 1, ..., node m."""
        B, device = path.size(0), path.device
        rows, steps = torch.arange(B, device=device), torch.arange(self.depth + 1, device=device)
        guessed = tree.tokens.gather(1, path[:, 1:].clamp(min=0))
        new_tokens = torch.cat([guessed, guessed[:, :1]], 1).scatter(1, n_accepted[:, None], bonus[:, None])
        n_new = n_accepted + 1
        active = ~self.done
        self.out.scatter_(1, self.n_out[:, None] + steps, new_tokens)  # a done row's n_out stays: nothing lands
        stop_hit = (torch.isin(new_tokens, self.stop_ids) & (steps <= n_accepted[:, None])).any(1)
        self.n_out.add_(n_new * active)
        self.prefix_len.add_(n_new * active)
        self.root.copy_(torch.where(active, bonus, self.root))
        self.cu_tokens.copy_(torch.where(active[:, None], new_tokens, self.cu_tokens))
        self.cu_features.copy_(torch.where(active[:, None, None], features[rows[:, None], path.clamp(min=0)], self.cu_features))
        self.cu_count.copy_(torch.where(active, n_new, self.cu_count))
        self.done.copy_(self.done | stop_hit | (self.n_out >= self.limit))


@torch.no_grad()
def speculative_generate(spec: Speculator, prompt: Tensor, max_new_tokens: int,
                         callback: Optional[Callable[[Tensor], None]] = None, round_fn=None):
    """Like generate(), with EAGLE rounds. Returns (per-row token lists, per-row lists of the number
    of tokens each round emitted). One host sync per round: to stop, stream and count."""
    spec.prefill(prompt, max_new_tokens)
    round_fn = round_fn or spec.round
    B = prompt.size(0)
    n_out, done = [1] * B, spec.done.tolist()
    accepted = [[] for _ in range(B)]
    if callback is not None:
        callback(spec.out[:, 0])
    while not all(done):
        round_fn()
        state = torch.cat([spec.n_out, spec.done.long()]).tolist()
        new_n, done_now = state[:B], state[B:]
        if callback is not None:
            for t in spec.out[0, n_out[0]:new_n[0]].tolist():
                callback(torch.tensor([t]))
        for b in range(B):
            if not done[b]:
                accepted[b].append(new_n[b] - n_out[b])
        n_out, done = new_n, [bool(d) for d in done_now]
    out = spec.out.tolist()
    stop_ids = set(spec.stop_ids.tolist())
    return [cut_at_stop(out[b][:min(n_out[b], max_new_tokens)], stop_ids) for b in range(B)], accepted


# ---------------------------------------------------------------------------------------------
# --tree_tokens auto. A round that verifies T nodes costs round(T) seconds and emits tau(T)
# tokens, where vanilla decoding spends one step per token. On a GPU that is bound by reading the
# weights, verifying 60 tokens costs little more than one; on a CPU, which is bound by arithmetic,
# the cost grows with T and a big tree can be slower than no tree at all.
# ---------------------------------------------------------------------------------------------
AUTO_TREE_SIZES = (4, 8, 16, 32, 64, 128)
AUTO_MIN_SPEEDUP = 1.1  # the predicted speedup a tree must reach to be used instead of vanilla decoding


def choose_tree_tokens(step_s: float, rounds: dict, min_speedup: float = AUTO_MIN_SPEEDUP):
    """The rule of --tree_tokens auto, a pure function of measured costs.

    step_s: seconds per vanilla decode step; rounds: {tree size T: (seconds per round, tokens per
    round)}. A round emits tau(T) tokens for which vanilla decoding would take tau(T) steps, so
    the predicted speedup is tau(T) * step_s / round_s(T). Returns (the size with the best
    prediction, or None for vanilla decoding when even the best is below min_speedup, and
    {T: predicted speedup}). The margin covers measurement noise and what a few rounds leave out,
    so that a close call goes to vanilla: a wrong choice must not make decoding slower."""
    predicted = {T: tau * step_s / seconds for T, (seconds, tau) in sorted(rounds.items())}
    best = max(predicted, key=predicted.get, default=None)
    return (best if best is not None and predicted[best] >= min_speedup else None), predicted


@torch.no_grad()
def measure_tree_costs(model: Transformer, draft, prompt: Tensor, sizes=AUTO_TREE_SIZES, *, tree_top_k: int = 10,
                       tree_depth: int = 6, n_rounds: int = 3, temperature: float = 0.0, top_k=None, top_p=None,
                       cuda_graphs: bool = False):
    """Eager timings for choose_tree_tokens on this hardware: (seconds per vanilla decode step,
    {T: (seconds per round, tokens per round)}) for the EAGLE-2 tree sizes in `sizes` that
    tree_top_k and tree_depth allow, smallest first. Each size runs n_rounds + 1 rounds from the
    prompt [1, L]; times are medians after the first; tokens per round estimate tau on this prompt.
    Sizes stop once a round costs so much that even tree_depth + 1 tokens, the most a round can
    emit, would not make it AUTO_MIN_SPEEDUP faster: larger trees only cost more. Eager, not
    compiled, because compiling every size would take minutes; where eager mode is slow to launch
    kernels (a GPU), it overstates what a round costs more than what a step does, which errs
    toward vanilla. On a 2-core CPU the opposite was measured (a compiled round cost 3.1 steps,
    an eager one 2.4: benchmarks/README.md), so there a close call can still lose a little.

    cuda_graphs (for a compiled run on CUDA, where eager mode is launch-bound and would bias the
    choice toward no tree): time replays of the eager step and of each size's round captured in
    a CUDA graph (cuda_graph): the kernels eager mode launches, without the launch overhead that
    a compiled run's CUDA graph removes too, and without compiling every size.

    Under tensor parallelism every rank takes rank 0's timings (tp.from_rank0), so that all stop at
    the same size and choose the same one: a rank that ran one round more than the others would
    leave its all-reduces unanswered."""
    device, L = str(prompt.device), prompt.size(1)
    sampling = (temperature, top_k, top_p)
    most = 1 + tree_top_k + (tree_depth - 1) * tree_top_k ** 2
    budget = (n_rounds + 2) * (tree_depth + 1) + 1  # more than the rounds (and a warm-up) can emit: no row stops

    def median_seconds(fn):
        times = []
        for _ in range(n_rounds + 1):
            device_sync(device)
            t = time.perf_counter()
            fn()
            device_sync(device)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    model.setup_caches(1, L + budget)
    token = sample(model(prompt, torch.arange(L, device=prompt.device))[:, -1], *sampling)
    input_pos = torch.tensor([L], device=prompt.device)

    def step():  # one vanilla decode step, as generate.decode_one_token (in place: a CUDA graph replays it)
        token.copy_(sample(model(token[:, None], input_pos)[:, -1], *sampling))
        input_pos.add_(1)

    step_s = tp.from_rank0(median_seconds(cuda_graph(step) if cuda_graphs else step))
    rounds = {}
    for T in sorted(T for T in sizes if 2 <= T <= most):
        spec = Speculator(model, draft, tree_top_k=tree_top_k, tree_depth=tree_depth, tree_tokens=T,
                          temperature=temperature, top_k=top_k, top_p=top_p)
        spec.setup(1, L + budget + 2 * (tree_depth + 1))
        spec.prefill(prompt, budget)
        round_fn = cuda_graph(spec.round) if cuda_graphs else spec.round
        emitted = int(spec.n_out[0])  # (cuda_graph ran a warm-up round)
        seconds = tp.from_rank0(median_seconds(round_fn))
        rounds[T] = (seconds, (int(spec.n_out[0]) - emitted) / (n_rounds + 1))
        if (tree_depth + 1) * step_s / seconds < AUTO_MIN_SPEEDUP:
            break
    return step_s, rounds


def auto_tree_tokens(model: Transformer, draft, prompt_ids, *, tree_top_k: int = 10, tree_depth: int = 6,
                     cuda_graphs: bool = False, **sampling) -> Optional[int]:
    """--tree_tokens auto: measure (a few seconds), choose, and say what was chosen and why.
    Returns the tree size, or None for vanilla decoding. cuda_graphs: as measure_tree_costs, for
    a compiled run on CUDA."""
    if not prompt_ids:
        raise ValueError("--tree_tokens auto measures on a prompt; none was given")
    prompt = torch.tensor([list(prompt_ids)], device=model.norm.weight.device)
    t = time.perf_counter()
    step_s, rounds = measure_tree_costs(model, draft, prompt, tree_top_k=tree_top_k, tree_depth=tree_depth,
                                        cuda_graphs=cuda_graphs, **sampling)
    choice, predicted = choose_tree_tokens(step_s, rounds)
    print(f"--tree_tokens auto: measured for {time.perf_counter() - t:.1f} s; a vanilla step takes {step_s * 1e3:.1f} ms",
          file=sys.stderr)
    for T, speedup in predicted.items():
        seconds, tau = rounds[T]
        print(f"  {T:4d} tree tokens: a round costs {seconds / step_s:5.2f} steps and emitted {tau:.2f} tokens "
              f"-> predicted speedup {speedup:.2f}x", file=sys.stderr)
    if choice is None:
        print(f"--tree_tokens auto: no tree size is predicted to be {AUTO_MIN_SPEEDUP}x faster than vanilla decoding "
              f"on this hardware: decoding without speculation", file=sys.stderr)
    else:
        print(f"--tree_tokens auto: chose {choice} tree tokens (predicted {predicted[choice]:.2f}x)", file=sys.stderr)
    return choice



def device_sync(device: str):
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


# Inductor settings of a round, given as options because torch.compile takes a mode or options,
# not both. "triton.cudagraphs" is all that mode="reduce-overhead" sets (torch._inductor.
# list_mode_options): on CUDA the round replays as one CUDA graph. Coordinate-descent tuning, which
# generate.compile_decoding keeps for the small one-token step as gpt-fast does, is off: it tunes
# every kernel of a ~1-2k-node round, and compile time explodes. The FX graph cache lets a second
# process (another method, a rerun) load a round it has compiled before.
ROUND_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": False, "fx_graph_cache": True}
PREFILL_OPTIONS = {"coordinate_descent_tuning": False, "fx_graph_cache": True}


def compile_round(spec: Speculator, compile_prefill: bool, backend="inductor"):
    """One speculative round as one graph: fullgraph (a graph break would split it around a host
    sync) and dynamic=False (every shape of a round is fixed by the Speculator; a dynamic-shape
    graph would specialise less and recompile where a static one need not).

    dont_skip_tracing: torch._dynamo skips any module whose import name is "tree" (it takes it for
    the dm-tree library), and that would be our tree.py.

    Every Speculator compiles its own graph of the same code (Speculator.round), and dynamo keeps
    at most torch._dynamo.config.recompile_limit (8) graphs per code object: a process that
    compiles more rounds (methods x temperatures x tree sizes) raises the limit, as
    scripts/benchmark.py does, or runs one method per process, as scripts/gpu_check.sh does.
    backend: torch.compile's; the tests pass one that inspects the graph."""
    if not hasattr(torch._dynamo, "dont_skip_tracing"):  # added in torch 2.8
        raise RuntimeError(f"compiling a round needs torch >= 2.8 (torch._dynamo.dont_skip_tracing), this is "
                           f"torch {torch.__version__}: upgrade torch or run without --compile")
    inductor = backend == "inductor"
    spec.round = torch.compile(torch._dynamo.dont_skip_tracing(spec.round), backend=backend, fullgraph=True,
                               dynamic=False, options=ROUND_OPTIONS if inductor else None)
    if compile_prefill:  # prompts vary in length: dynamic shapes, no CUDA graphs
        spec.prefill = torch.compile(spec.prefill, backend=backend, fullgraph=True, dynamic=True,
                                     options=PREFILL_OPTIONS if inductor else None)
    return spec

