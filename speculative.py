"""EAGLE speculative decoding: the engine. generate.py is its command line.

Each round brings the draft up to date, grows a tree of guesses, verifies all of them in one
target forward, accepts the longest correct path (plus one token from the target), and copies
the accepted nodes' K/V down to the end of the prefix:

    accept                 the lossless acceptance rule (greedy and sampling)
    Speculator             target + draft + the state between rounds; round() is one graph
    speculative_generate   the driver: prefill, then rounds (or, adaptively, plain steps) until
                           every row stops

compiling.compile_round compiles a round; autoshape.py chooses a tree's shape by measuring.
"""
import time
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
from torch import Tensor

from draft import dynamic_tree_slots, grow_dynamic_tree, grow_static_tree, lookup_continuation, most_tokens
from model import Transformer, TreeMask, copy_slots
from sampling import cut_at_stop, is_stop, logits_to_probs, sample, sample_from
from trees import Tree, graft_chain, tree_structure


def accept(tree: Tree, logits: Tensor, temperature: float, top_k: Optional[int] = None, top_p: Optional[float] = None):
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
    rows = torch.arange(B, device=logits.device)
    node = torch.zeros(B, dtype=torch.long, device=logits.device)
    alive = torch.ones(B, dtype=torch.bool, device=logits.device)
    bonus = torch.zeros(B, dtype=torch.long, device=logits.device)
    # Greedy: p one-hot at the argmax, the same walk on token ids: one argmax over every node up front,
    # no vocabulary-sized tensor per depth.
    best = logits.argmax(-1) if temperature == 0 else None  # [B, T]: the target's token after each node
    for _ in range(tree.paths.size(-1)):  # the last pass only draws the bonus at a deepest node
        is_child = tree.parents == node[:, None]  # [B, T], in rank order
        if best is not None:
            drawn = best[rows, node]
            hit = is_child & (tree.tokens == drawn[:, None])
        else:
            p = logits_to_probs(logits[rows, node], temperature, top_k, top_p)
            p_child = p.gather(1, tree.tokens) * is_child
            mass_before = p_child.cumsum(1) - p_child  # higher-ranked siblings already rejected
            ratio = p_child / (1 - mass_before).clamp(min=1e-30)
            hit = is_child & (torch.rand(B, T, device=logits.device) < ratio)
            # Rows that accept no child stop here; their next token is drawn from p without the children.
            child_tokens = torch.where(is_child, tree.tokens, V)  # V: a dummy column for non-children
            residual = torch.cat([p, p.new_zeros(B, 1)], 1).scatter(1, child_tokens, 0.0)[:, :V]
            residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)  # float round-off guard
            drawn = sample_from(residual)  # (unnormalised is fine)
        found = hit.any(1)
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
        history     the text so far, prompt included: tokens 0 .. prefix_len (prompt lookup reads it)
        cu_tokens, cu_features, cu_count   the draft's catch-up input: the last cu_count
                    (token, target feature) pairs the draft has not seen yet
        out, n_out  the tokens generated so far;  left  how many more it may emit
        done        the row has stopped (stop token or max_new_tokens)
    static: a StaticTree (EAGLE-1), or None for the dynamic EAGLE-2 tree of tree_top_k/depth/tokens.
    lookup: prompt lookup's guesses (draft.lookup_continuation) as a chain of this many more nodes
    in every tree (tree.graft_chain); with draft None they are the whole tree (--speculate lookup).
    """

    def __init__(self, target: Transformer, draft, *, static=None, tree_top_k: int = 10, tree_depth: int = 6,
                 tree_tokens: int = 60, temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, stop_ids=(), lookup: int = 0, lookup_ngram: int = 4):
        super().__init__()
        if lookup < 0 or lookup_ngram < 1:
            raise ValueError(f"lookup must be >= 0 and the lookup n-gram >= 1, got {lookup} and {lookup_ngram}")
        vocab = getattr(draft, "draft_vocab_size", target.config.vocab_size)  # what the draft chooses from
        if draft is None:
            if lookup < 1 or static is not None:
                raise ValueError("without a draft, a round's guesses come from prompt lookup: give lookup >= 1")
            tree_top_k, tree_depth, tree_tokens = 0, 0, 1  # the root alone, then the lookup chain
        elif static is not None:
            tree_depth, tree_tokens = static.max_depth, static.parents.numel()
            if static.n_ranks > vocab:
                raise ValueError(f"the static tree uses child rank {static.n_ranks - 1}, the draft's vocabulary has "
                                 f"{vocab} tokens")
        else:
            if not 1 <= tree_top_k <= vocab:
                raise ValueError(f"the tree's top_k must be in [1, {vocab}], got {tree_top_k}")
            if tree_depth < 1:
                raise ValueError(f"the tree's depth must be >= 1, got {tree_depth}")
            most = most_tokens(tree_top_k, tree_depth)
            if not 2 <= tree_tokens <= most:
                raise ValueError(f"the tree's tokens must be in [2, {most}] for top_k {tree_top_k} and depth "
                                 f"{tree_depth}, got {tree_tokens}")
            # The draft grows no deeper than the tree can reach: a candidate's score is at most its
            # parent's, so the tree_tokens - 1 best never lie below depth tree_tokens - 1, and a level
            # more would be a draft forward for nothing.
            tree_depth = min(tree_depth, tree_tokens - 1)
        self.target, self.draft, self.static = target, draft, static
        self.tree_top_k, self.tree_depth, self.tree_tokens = tree_top_k, tree_depth, tree_tokens  # the draft's tree
        self.lookup, self.lookup_ngram = lookup, lookup_ngram
        self.depth = tree_depth + lookup    # the most guesses a round can accept
        window = getattr(target, "invariant_window", None)
        if window is not None and self.depth > window:
            raise ValueError(f"batch-invariant attention sees the last {window} positions in order: trees of depth "
                             f"{self.depth} (tree depth + lookup) are too deep for it: use a shallower tree, or "
                             f"--no-batch_invariant")
        self.n_nodes = tree_tokens + lookup  # the tokens a round verifies
        self.layer_ids = () if draft is None else draft.layer_ids
        self.sampling = (temperature, top_k, top_p)
        self.register_buffer("stop_ids", torch.tensor(sorted(stop_ids), dtype=torch.long), persistent=False)
        self.feature_dim = 0 if draft is None else target.config.dim * max(1, len(draft.layer_ids))  # EAGLE-3: 3 layers
        self.capacity = 0

    def draft_region(self) -> int:
        if self.draft is None:
            return 0
        return self.tree_tokens - 1 if self.static is not None else dynamic_tree_slots(self.tree_top_k, self.tree_depth)

    def setup(self, batch_size: int, max_seq_length: int):
        """Caches and state for batch_size rows of up to max_seq_length tokens each, plus the tree
        regions at the ends of both caches, all on the model's device (a tensor left on the host
        would cost a copy inside every round, or split its graph)."""
        device = self.target.norm.weight.device
        self.stop_ids = self.stop_ids.to(device)
        if self.static is not None:
            self.static = self.static.to(device)
        self.target.setup_caches(batch_size, max_seq_length + self.n_nodes)
        self.capacity = self.target.max_seq_length - self.n_nodes
        if self.draft is not None:
            self.draft.setup_caches(batch_size, max_seq_length + self.draft_region())
            self.capacity = min(self.capacity, self.draft.max_seq_length - self.draft_region())
        B, D1 = batch_size, self.depth + 1
        if getattr(self, "out", None) is not None and self.out.shape == (B, self.capacity):
            return
        long = dict(dtype=torch.long, device=device)
        for name, value in dict(
            prefix_len=torch.zeros(B, **long), root=torch.zeros(B, **long),
            history=torch.zeros(B, self.capacity + D1 + 1, **long),  # + a round's overshoot
            cu_tokens=torch.zeros(B, D1, **long), cu_count=torch.zeros(B, **long),
            cu_features=torch.zeros(B, D1, self.feature_dim, dtype=self.target.norm.weight.dtype, device=device),
            out=torch.zeros(B, self.capacity, **long), n_out=torch.zeros(B, **long),
            done=torch.zeros(B, dtype=torch.bool, device=device), left=torch.zeros(B, **long),
        ).items():
            self.register_buffer(name, value, persistent=False)

    def prefill(self, prompt: Tensor, max_new_tokens: int):
        """Target and draft read the prompt [B, L]; the first new token is sampled exactly as in
        vanilla decoding."""
        B, L = prompt.shape
        if L + max_new_tokens + 2 * (self.depth + 1) > self.capacity or B != self.out.size(0):
            self.setup(B, L + max_new_tokens + 2 * (self.depth + 1))  # room for the last round's overshoot
        self.read_prompt(prompt, max_new_tokens)

    def read_prompt(self, prompt: Tensor, max_new_tokens: int):
        """prefill once the caches and buffers are big enough: the part a compiled prefill compiles
        (growing them, setup, is host work that dynamo cannot trace)."""
        B, L = prompt.shape
        target, device = self.target, prompt.device
        logits, final, layer_inputs = target(prompt, torch.arange(L, device=device), return_features=True,
                                             layer_ids=self.layer_ids, last_logits=True)
        root = sample(logits[:, -1], *self.sampling)
        self.cu_tokens.zero_()
        self.cu_features.zero_()
        if self.draft is not None:
            features = self.draft.select_features(final, layer_inputs)
            if L > 1:  # draft position t holds (f_t, tok_{t+1}); the last one, (f_{L-1}, root), is caught up in round 1
                self.draft(target.tok_embeddings(prompt[:, 1:]), features[:, :-1], torch.arange(L - 1, device=device))
            self.cu_features[:, 0] = features[:, -1]
        self.prefix_len.fill_(L)
        self.root.copy_(root)
        self.history.zero_()
        self.history[:, :L] = prompt
        self.history[:, L] = root
        self.cu_tokens[:, 0] = root
        self.cu_count.fill_(1)
        self.out.zero_()
        self.out[:, 0] = root
        self.n_out.fill_(1)
        # Tokens still to emit, counted down by every round and plain step: a limit that the graphs
        # only read would be frozen into them at the value of the call that compiled them.
        self.left.fill_(max_new_tokens - 1)
        self.done.copy_(is_stop(root, self.stop_ids) | (self.left <= 0))

    def round(self):
        """One speculative round over all rows; rows that are done are left as they are. Its phases
        are methods of their own so that autoshape.py can time each apart; compiled, the
        round is still one graph (they are traced inline)."""
        tree = self.root_tree() if self.draft is None else self.grow(self.catch_up())
        if self.lookup:
            tree = self.add_lookup(tree)
        logits, features = self.verify(tree)
        self.finish(tree, logits, features)

    def catch_up(self) -> Tensor:
        """The draft reads the pairs accepted since it last ran, at positions L - cu_count ...
        (unused trailing entries are overwritten later). Returns its output at the root [B, dim],
        which predicts the root's children."""
        device = self.root.device
        hidden = self.draft(self.target.tok_embeddings(self.cu_tokens), self.cu_features,
                            (self.prefix_len - self.cu_count)[:, None] + torch.arange(self.depth + 1, device=device))
        return hidden[torch.arange(hidden.size(0), device=device), self.cu_count - 1]

    def grow(self, root_hidden: Tensor, with_pool: bool = False):
        """The tree of guesses (and, with_pool, a dynamic tree's pool of candidates: auto_shape)."""
        target, draft = self.target, self.draft
        if self.static is None:
            return grow_dynamic_tree(draft, target.tok_embeddings, target.output, self.root, root_hidden,
                                     self.prefix_len, self.tree_top_k, self.tree_depth, self.tree_tokens, with_pool)
        return grow_static_tree(draft, target.tok_embeddings, target.output, self.static, self.root, root_hidden,
                                self.prefix_len)

    def root_tree(self) -> Tree:
        """The tree of the root alone (no draft: prompt lookup adds the guesses)."""
        parents = torch.full_like(self.root[:, None], -1)
        return Tree(self.root[:, None], parents, *tree_structure(parents, 0))

    def add_lookup(self, tree: Tree) -> Tree:
        """tree plus prompt lookup's chain of guesses, grafted below the deepest node whose path
        it repeats (tree.graft_chain)."""
        depth = tree.paths.size(-1) - 1 + self.lookup
        chain, _, _ = lookup_continuation(self.history, self.prefix_len + 1, depth, self.lookup_ngram)
        return graft_chain(tree, chain, self.lookup)

    def verify(self, tree: Tree):
        """One target forward over all nodes, kept in the last n_nodes slots of its cache. Returns the
        logits at every node and what the draft reads there (its features; None without a draft)."""
        target, L = self.target, self.prefix_len
        region_start = target.max_seq_length - self.n_nodes
        logits, final, layer_inputs = target(
            tree.tokens, L[:, None] + tree.depth, region_start + torch.arange(self.n_nodes, device=L.device),
            TreeMask(L, tree.ancestors), return_features=True, layer_ids=self.layer_ids)
        return logits, None if self.draft is None else self.draft.select_features(final, layer_inputs)

    def finish(self, tree: Tree, logits: Tensor, features: Optional[Tensor]):
        """A round's end after verify: accept, compact, advance. Returns the accepted path and the
        number of accepted guesses (autoshape.py times this part alone)."""
        node, n_accepted, bonus = accept(tree, logits, *self.sampling)  # the path to node, then the target's token
        path = self.compact(tree, node)
        self.advance(tree, path, n_accepted, bonus, features)
        return path, n_accepted

    def compact(self, tree: Tree, node: Tensor) -> Tensor:
        """Copy the accepted nodes' K/V from the tree region to the slots after the prefix, in every
        layer at once. Returns the accepted path [B, depth + 1]: root, accepted nodes, then -1."""
        B, device = node.size(0), node.device
        path = tree.paths[torch.arange(B, device=device), node]
        region_start = self.target.max_seq_length - self.n_nodes
        copy_slots(self.target, region_start + path.clamp(min=0),
                   self.prefix_len[:, None] + torch.arange(self.depth + 1, device=device))
        return path

    def advance(self, tree: Tree, path: Tensor, n_accepted: Tensor, bonus: Tensor, features: Optional[Tensor]):
        """The new tokens: the accepted guesses, then the bonus token. They are also the draft's next
        catch-up input, paired with the target's true features at root, node 1, ..., node m."""
        B, device = path.size(0), path.device
        rows, steps = torch.arange(B, device=device), torch.arange(self.depth + 1, device=device)
        guessed = tree.tokens.gather(1, path[:, 1:].clamp(min=0))
        new_tokens = torch.cat([guessed, guessed[:, :1]], 1).scatter(1, n_accepted[:, None], bonus[:, None])
        n_new = n_accepted + 1
        active = ~self.done
        self.out.scatter_(1, self.n_out[:, None] + steps, new_tokens)  # a done row's n_out stays: nothing lands
        self.history.scatter_(1, self.prefix_len[:, None] + 1 + steps, new_tokens)  # likewise past its text
        stop_hit = (is_stop(new_tokens, self.stop_ids) & (steps <= n_accepted[:, None])).any(1)
        self.n_out.add_(n_new * active)
        self.left.sub_(n_new * active)
        self.prefix_len.add_(n_new * active)
        self.root.copy_(torch.where(active, bonus, self.root))
        if self.draft is not None:
            self.cu_tokens.copy_(torch.where(active[:, None], new_tokens, self.cu_tokens))
            self.cu_features.copy_(torch.where(active[:, None, None], features[rows[:, None], path.clamp(min=0)],
                                               self.cu_features))
            self.cu_count.copy_(torch.where(active, n_new, self.cu_count))
        self.done.copy_(self.done | stop_hit | (self.left <= 0))

    # --- plain steps between rounds (speculative_generate's adaptive mode) ---------------------
    def plain_step(self):
        """One vanilla decode step in the speculative state: the target reads the root at slot
        prefix_len (no tree) and samples the next token exactly as generate() does. The pair
        (root's feature, next token) joins the draft's catch-up input, so that a later round starts
        where the draft left off; it holds depth + 1 pairs, and flush() makes room."""
        rows = torch.arange(self.root.size(0), device=self.root.device)
        logits, final, layer_inputs = self.target(self.root[:, None], self.prefix_len[:, None], return_features=True,
                                                  layer_ids=self.layer_ids)
        nxt = sample(logits[:, -1], *self.sampling)
        active = ~self.done
        # A done row writes nothing new: its slots get their old values back (static shapes).
        at = self.n_out.clamp(max=self.out.size(1) - 1)
        self.out[rows, at] = torch.where(active, nxt, self.out[rows, at])
        at = self.prefix_len + 1
        self.history[rows, at] = torch.where(active, nxt, self.history[rows, at])
        if self.draft is not None:
            feature = self.draft.select_features(final, layer_inputs)[:, 0]
            at = self.cu_count.clamp(max=self.depth)
            self.cu_tokens[rows, at] = torch.where(active, nxt, self.cu_tokens[rows, at])
            self.cu_features[rows, at] = torch.where(active[:, None], feature, self.cu_features[rows, at])
            self.cu_count.add_(active.long())
        self.n_out.add_(active.long())
        self.left.sub_(active.long())
        self.prefix_len.add_(active.long())
        self.root.copy_(torch.where(active, nxt, self.root))
        self.done.copy_(self.done | (active & is_stop(nxt, self.stop_ids)) | (self.left <= 0))

    def flush(self):
        """The draft reads the catch-up pairs that plain steps gathered; the last one stays for the
        next round's catch-up (which reads it again: the same entry, rewritten)."""
        rows = torch.arange(self.root.size(0), device=self.root.device)
        self.catch_up()
        last = (self.cu_count - 1).clamp(min=0)
        self.cu_tokens[:, 0] = self.cu_tokens[rows, last]
        self.cu_features[:, 0] = self.cu_features[rows, last]
        self.cu_count.copy_(self.cu_count.clamp(max=1))
        # Inductor's freezing makes a buffer that a graph only reads a constant of the graph: writing
        # prefix_len back keeps it an input, or the catch-up would read later pairs at stale positions.
        self.prefix_len.copy_(self.prefix_len)


# Adaptive decoding. A tree pays only while the text is predictable: the driver keeps slow running
# estimates (one round's tokens vary widely) of what a round costs and emits, and of what a plain
# step costs, and decodes with whichever is faster now. In a plain stretch it probes with
# a round now and then, and at once when prompt lookup sees a long match at the text's end. The
# decisions are the host's, between graphs compiled once each (benchmarks/RESULTS.md, "Adaptive decoding").
ADAPT_DECAY = 0.1        # weight of the newest observation in a running estimate
PLAIN_BURST = 8          # plain steps between two looks at the state (stop, lookup, probe)
PROBE_EVERY = 32         # plain steps before a probe round (counted over answers too)
LOOKUP_TRIGGER = 3       # a lookup match of this many tokens ends a plain stretch


class Pace(NamedTuple):
    """The driver's running estimates, kept on the Speculator from one answer to the next: an
    answer's first rounds move the estimate of tokens per round, not reset it (one poor round would
    otherwise send a whole answer to plain steps). The first round and the first plain burst of a
    Speculator are not counted as costs: they include compilation."""
    round_s: Optional[float] = None
    step_s: Optional[float] = None
    tokens: Optional[float] = None  # tokens a round emits (bonus included), decayed
    seen: frozenset = frozenset()   # "round", "plain": kinds observed at least once


def observe(pace: Pace, kind: str, seconds: float, tokens: float = 1.0) -> Pace:
    """pace after a round (kind "round": its seconds and the tokens it emitted per row) or a plain
    step (kind "plain": seconds per step)."""
    if kind == "round":
        pace = pace._replace(tokens=decayed(pace.tokens, tokens))
    if kind not in pace.seen:
        return pace._replace(seen=pace.seen | {kind})
    if kind == "round":
        return pace._replace(round_s=decayed(pace.round_s, seconds))
    return pace._replace(step_s=decayed(pace.step_s, seconds))


def decayed(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - ADAPT_DECAY) * old + ADAPT_DECAY * new


def next_mode(pace: Pace, plain_run: int) -> str:
    """The adaptive driver's choice: measure what is unmeasured (rounds first), then whichever is
    faster; a plain stretch probes with a round every PROBE_EVERY steps."""
    if pace.round_s is None or pace.tokens is None:
        return "round"
    if pace.step_s is None:
        return "plain"
    rounds_pay = pace.tokens / pace.round_s >= 1 / pace.step_s  # a round emits tokens faster than steps do
    return "round" if rounds_pay or plain_run >= PROBE_EVERY else "plain"


@torch.no_grad()
def speculative_generate(spec: Speculator, prompt: Tensor, max_new_tokens: int,
                         callback: Optional[Callable[[Tensor], None]] = None, round_fn=None, adaptive: bool = False,
                         force_modes=None):
    """Like generate(), with EAGLE rounds. Returns (per-row token lists, per-row lists of the number
    of tokens each target forward emitted: a round's, or 1 for a plain step). One host sync per
    round or plain burst: to stop, stream, count and decide.

    adaptive: switch between rounds and plain steps (spec.plain_step, spec.flush) by the running
    estimates above. force_modes: an iterator of "round" / "plain" that decides instead (tests).
    Afterwards spec.plain_steps holds, per row, how many of its forwards were plain steps (each
    one 1 in its list): the head's acceptance is over the others only."""
    spec.prefill(prompt, max_new_tokens)
    round_fn = round_fn or spec.round
    B = prompt.size(0)
    n_out, done = [1] * B, spec.done.tolist()
    emitted, plain_steps = [[] for _ in range(B)], [0] * B
    pace = getattr(spec, "pace", Pace())
    cu_count, plain_run = 1, getattr(spec, "plain_run", 0)  # like the estimates, carried over answers
    if callback is not None:
        callback(spec.out[:, 0])
    while not all(done):
        mode = next_mode(pace, plain_run) if adaptive else "round"
        if force_modes is not None:
            mode = next(force_modes)
        if mode == "plain" and spec.draft is not None and spec.depth + 1 - cu_count < PLAIN_BURST:
            spec.flush()  # room for the burst's pairs in the draft's catch-up input
            cu_count = 1
        steps = min(PLAIN_BURST, spec.depth + 1 - cu_count)  # a plain burst's
        t = time.perf_counter()
        if mode == "round":
            round_fn()
        else:
            for _ in range(steps):
                spec.plain_step()
        signal = torch.zeros_like(spec.n_out)  # the n-gram length of prompt lookup's match at the text's end
        if spec.lookup and mode == "plain":
            signal = lookup_continuation(spec.history, spec.prefix_len + 1, 1, spec.lookup_ngram)[2]
        state = torch.cat([spec.n_out, spec.done.long(), spec.cu_count, signal]).tolist()
        seconds = time.perf_counter() - t
        new_n, done_now, cu = state[:B], state[B:2 * B], state[2 * B:3 * B]
        if callback is not None:
            for tok in spec.out[0, n_out[0]:new_n[0]].tolist():
                callback(torch.tensor([tok]))
        active = [b for b in range(B) if not done[b]]
        made = {b: new_n[b] - n_out[b] for b in active}
        if mode == "round":
            for b in active:
                emitted[b].append(made[b])
            pace = observe(pace, "round", seconds, sum(made.values()) / max(1, len(active)))
            plain_run = 0
        else:
            for b in active:
                emitted[b] += [1] * made[b]
                plain_steps[b] += made[b]
            pace = observe(pace, "plain", seconds / steps)
            plain_run += steps
            if max(state[3 * B:]) >= LOOKUP_TRIGGER:
                plain_run = PROBE_EVERY  # the text repeats itself: try a round now
        cu_count = max(cu[b] for b in active) if active else 1
        n_out, done = new_n, [bool(d) for d in done_now]
    spec.pace, spec.plain_steps, spec.plain_run = pace, plain_steps, plain_run
    out = spec.out.tolist()
    stop_ids = set(spec.stop_ids.tolist())
    return [cut_at_stop(out[b][:min(n_out[b], max_new_tokens)], stop_ids) for b in range(B)], emitted
