"""EAGLE speculative decoding: the engine. generate.py is its command line.

Each round brings the draft up to date, grows a tree of guesses, verifies all of them in one
target forward, accepts the longest correct path (plus one token from the target), and copies
the accepted nodes' K/V down to the end of the prefix:

    accept                 the lossless acceptance rule (greedy and sampling)
    Speculator             target + draft + the state between rounds; round() is one graph
    speculative_generate   the driver: prefill, rounds until every row stops
    compile_round          torch.compile of a round
    auto_shape ...         --tree_tokens auto: the tree shape from what rounds cost on this machine
"""
import bisect
import hashlib
import importlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
from torch import Tensor

import tp
from draft import dynamic_tree_slots, grow_dynamic_tree, grow_static_tree, lookup_continuation
from model import Transformer, TreeMask, copy_slots, flash_rows
from quantize import lower_int4_rows_to_the_kernel, lower_int8_rows_to_the_kernel, prefill_rows
from sampling import cut_at_stop, is_stop, logits_to_probs, sample, sample_from
from tree import Tree, graft_chain, tree_structure


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
    if temperature == 0:
        # The walk below with p one-hot, on token ids: at each node the child equal to the target's
        # argmax is accepted (children are distinct tokens), else the argmax is the bonus. The same
        # decisions without a vocabulary-sized tensor per depth.
        best = logits.argmax(-1)  # [B, T]: the target's token after each node
        for _ in range(max_depth + 1):
            want = best[rows, node]
            hit = (tree.parents == node[:, None]) & (tree.tokens == want[:, None])
            found = hit.any(1)
            bonus = torch.where(alive & ~found, want, bonus)
            node = torch.where(alive & found, hit.int().argmax(1), node)
            alive = alive & found
        return node, tree.depth[rows, node], bonus
    for _ in range(max_depth + 1):  # the last pass only draws the bonus at a deepest node
        p = logits_to_probs(logits[rows, node], temperature, top_k, top_p)
        is_child = tree.parents == node[:, None]  # [B, T], in rank order
        p_child = p.gather(1, tree.tokens) * is_child
        mass_before = p_child.cumsum(1) - p_child  # higher-ranked siblings already rejected
        ratio = p_child / (1 - mass_before).clamp(min=1e-30)
        hit = is_child & (torch.rand(B, T, device=logits.device) < ratio)
        found = hit.any(1)
        # Rows that accept no child stop here; their next token is drawn from p without the children.
        child_tokens = torch.where(is_child, tree.tokens, V)  # V: a dummy column for non-children
        residual = torch.cat([p, p.new_zeros(B, 1)], 1).scatter(1, child_tokens, 0.0)[:, :V]
        residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p)  # float round-off guard
        drawn = sample_from(residual)  # (unnormalised is fine)
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
            raise ValueError(f"--lookup must be >= 0 and the lookup n-gram >= 1, got {lookup} and {lookup_ngram}")
        if draft is None:
            if lookup < 1 or static is not None:
                raise ValueError("without a draft, a round's guesses come from prompt lookup: give lookup >= 1")
            tree_top_k, tree_depth, tree_tokens = 0, 0, 1  # the root alone, then the lookup chain
        elif static is not None:
            vocab = getattr(draft, "draft_vocab_size", target.config.vocab_size)
            tree_depth, tree_tokens = static.max_depth, static.parents.numel()
            if static.n_ranks > vocab:
                raise ValueError(f"the static tree uses child rank {static.n_ranks - 1}, the draft's vocabulary has "
                                 f"{vocab} tokens")
        else:
            vocab = getattr(draft, "draft_vocab_size", target.config.vocab_size)  # what the draft chooses from
            if not 1 <= tree_top_k <= vocab:
                raise ValueError(f"--tree_top_k must be in [1, {vocab}], got {tree_top_k}")
            if tree_depth < 1:
                raise ValueError(f"--tree_depth must be >= 1, got {tree_depth}")
            most = 1 + tree_top_k + (tree_depth - 1) * tree_top_k ** 2
            if not 2 <= tree_tokens <= most:
                raise ValueError(f"--tree_tokens must be in [2, {most}] for top_k {tree_top_k} and depth {tree_depth}, "
                                 f"got {tree_tokens}")
            # The draft grows no deeper than the tree can reach: a candidate's score is at most its
            # parent's, so the tree_tokens - 1 best never lie below depth tree_tokens - 1, and each
            # level more would be a draft forward for nothing (--tree_tokens 4 with eagle3's default
            # depth 8 ran five of them a round).
            tree_depth = min(tree_depth, tree_tokens - 1)
        self.target, self.draft, self.static = target, draft, static
        self.tree_top_k, self.tree_depth, self.tree_tokens = tree_top_k, tree_depth, tree_tokens  # the draft's tree
        self.lookup, self.lookup_ngram = lookup, lookup_ngram
        self.depth = tree_depth + lookup    # the most guesses a round can accept
        window = getattr(target, "invariant_window", None)
        if window is not None and self.depth > window:
            raise ValueError(f"batch-invariant attention sees the last {window} positions in order: trees of depth "
                             f"{self.depth} (tree depth + lookup) are too deep for it: use a shallower tree, or "
                             f"--no-batch_invariant (the mode is the default of compiled bf16/float32 runs on a CPU "
                             f"without AMX)")
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
        """Caches and state for batch_size rows of up to max_seq_length tokens each, plus the
        tree regions at the ends of both caches. Everything a round reads lives on the model's
        device from here on: a tensor left on the host would cost a copy inside every round, split
        its graph, or fail outright (a comparison of a CUDA and a CPU tensor)."""
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

    def prefill(self, prompt: Tensor, max_new_tokens: int, root: Optional[Tensor] = None):
        """Target and draft read the prompt [B, L]; the first new token is sampled exactly as in
        vanilla decoding, or is root [B] where the caller chose it (scripts/acceptance_bound.py
        looks at the round that starts after a given text)."""
        B, L = prompt.shape
        if L + max_new_tokens + 2 * (self.depth + 1) > self.capacity or B != self.out.size(0):
            self.setup(B, L + max_new_tokens + 2 * (self.depth + 1))  # room for the last round's overshoot
        self.read_prompt(prompt, max_new_tokens, root)

    def read_prompt(self, prompt: Tensor, max_new_tokens: int, root: Optional[Tensor] = None):
        """prefill once the caches and buffers are big enough. --compile_prefill compiles this part
        only: growing them (setup) allocates and registers buffers and asks whether the target's
        caches are still views of one storage, a data-pointer comparison that dynamo refuses to
        trace; that host work stays in prefill, eager, before the graph is called."""
        B, L = prompt.shape
        target, device = self.target, prompt.device
        with prefill_rows(target):  # as generate.prefill
            logits, final, layer_inputs = target(prompt, torch.arange(L, device=device), return_features=True,
                                                 layer_ids=self.layer_ids)
        if root is None:
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
        # Tokens still to emit, counted down by every round and plain step. Not a constant limit that
        # the graphs compare n_out with: Inductor's freezing folds every buffer a graph reads and
        # never writes into the graph as a constant, so a limit would stay at the value of the call
        # that compiled the graph (a warm-up's), whatever max_new_tokens later calls ask for.
        self.left.fill_(max_new_tokens - 1)
        self.done.copy_(is_stop(root, self.stop_ids) | (self.left <= 0))

    def round(self):
        """One speculative round over all rows; rows that are done are left as they are. Its phases
        are methods of their own so that scripts/profile_round.py can time each; compiled, the
        round is still one graph (they are traced inline)."""
        tree = self.root_tree() if self.draft is None else self.grow(self.catch_up())
        if self.lookup:
            tree = self.add_lookup(tree)
        logits, features = self.verify(tree)
        node, n_accepted, bonus = accept(tree, logits, *self.sampling)  # the path to node, then the target's token
        path = self.compact(tree, node)
        self.advance(tree, path, n_accepted, bonus, features)

    def catch_up(self) -> Tensor:
        """The draft reads the pairs accepted since it last ran, at positions L - cu_count ...
        (unused trailing entries are overwritten later). Returns its output at the root [B, dim],
        which predicts the root's children."""
        B, device = self.root.size(0), self.root.device
        steps = torch.arange(self.depth + 1, device=device)
        hidden = self.draft(self.target.tok_embeddings(self.cu_tokens), self.cu_features,
                            (self.prefix_len - self.cu_count)[:, None] + steps)
        return hidden[torch.arange(B, device=device), self.cu_count - 1]

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
        B, device = self.root.size(0), self.root.device
        parents = torch.full((B, 1), -1, dtype=torch.long, device=device)
        return Tree(self.root[:, None], parents, *tree_structure(parents, 0))

    def add_lookup(self, tree: Tree) -> Tree:
        """tree plus prompt lookup's chain of guesses, grafted below the deepest node whose path
        it repeats (tree.graft_chain)."""
        D = tree.paths.size(-1) - 1
        chain, _, _ = lookup_continuation(self.history, self.prefix_len + 1, D + self.lookup, self.lookup_ngram)
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
        B, device = self.root.size(0), self.root.device
        rows = torch.arange(B, device=device)
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
        B, device = self.root.size(0), self.root.device
        rows = torch.arange(B, device=device)
        self.catch_up()
        last = (self.cu_count - 1).clamp(min=0)
        self.cu_tokens[:, 0] = self.cu_tokens[rows, last]
        self.cu_features[:, 0] = self.cu_features[rows, last]
        self.cu_count.copy_(self.cu_count.clamp(max=1))
        # The catch-up above reads prefix_len, which this graph does not otherwise write: compiled
        # with Inductor's freezing (CPU), a buffer a graph only reads becomes a constant of the graph
        # (its value at compile time), and the draft would read later pairs at stale positions.
        # Writing it back keeps it an input of the graph.
        self.prefix_len.copy_(self.prefix_len)

    def lookup_signal(self) -> Tensor:
        """[B]: the n-gram length of prompt lookup's match at the text's end now (0: none)."""
        return lookup_continuation(self.history, self.prefix_len + 1, 1, self.lookup_ngram)[2]


# ---------------------------------------------------------------------------------------------
# Adaptive decoding. A tree pays only while the text is predictable: the driver keeps running
# estimates of what a round costs and emits on this answer, and of what a plain step costs, and
# decodes with whichever is faster now. In a plain stretch it probes with a round now and then, and
# at once when prompt lookup sees a long match at the text's end (the text has started to repeat).
# The decisions are the host's, between graphs that are each compiled once: no recompilation.
# ---------------------------------------------------------------------------------------------
ADAPT_DECAY = 0.5        # weight of the newest observation in a running estimate
PLAIN_BURST = 8          # plain steps between two looks at the state (stop, lookup, probe)
PROBE_EVERY = 32         # plain steps before a probe round
LOOKUP_TRIGGER = 3       # a lookup match of this many tokens ends a plain stretch


class Pace(NamedTuple):
    """The driver's running estimates. Costs (seconds) are the machine's and carry over from one
    answer to the next (kept on the Speculator); tokens per round are this answer's. The first
    round and the first plain burst of a Speculator are not counted: they include compilation."""
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


def rounds_pay(pace: Pace) -> bool:
    """Whether a round is predicted to emit tokens faster than plain steps do."""
    return pace.tokens / pace.round_s >= 1 / pace.step_s


def next_mode(pace: Pace, plain_run: int) -> str:
    """The adaptive driver's choice: measure what is unmeasured (rounds first), then whichever is
    faster; a plain stretch probes with a round every PROBE_EVERY steps."""
    if pace.round_s is None or pace.tokens is None:
        return "round"
    if pace.step_s is None:
        return "plain"
    if rounds_pay(pace):
        return "round"
    return "round" if plain_run >= PROBE_EVERY else "plain"


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
    emitted = [[] for _ in range(B)]
    plain_steps = [0] * B
    pace = getattr(spec, "pace", Pace())._replace(tokens=None)
    cu_count, plain_run = 1, 0
    if callback is not None:
        callback(spec.out[:, 0])
    while not all(done):
        if force_modes is not None:
            mode = next(force_modes)
        else:
            mode = next_mode(pace, plain_run) if adaptive else "round"
        steps = 1
        if mode == "plain":
            if spec.draft is not None and spec.depth + 1 - cu_count < PLAIN_BURST:
                spec.flush()  # room for the burst's pairs in the draft's catch-up input
                cu_count = 1
            steps = min(PLAIN_BURST, spec.depth + 1 - cu_count)
        t = time.perf_counter()
        if mode == "round":
            round_fn()
        else:
            for _ in range(steps):
                spec.plain_step()
        signal = spec.lookup_signal() if spec.lookup and mode == "plain" else torch.zeros_like(spec.n_out)
        state = torch.cat([spec.n_out, spec.done.long(), spec.cu_count, signal]).tolist()
        seconds = time.perf_counter() - t
        new_n, done_now, cu = state[:B], state[B:2 * B], state[2 * B:3 * B]
        if callback is not None:
            for tok in spec.out[0, n_out[0]:new_n[0]].tolist():
                callback(torch.tensor([tok]))
        active = [b for b in range(B) if not done[b]]
        for b in active:
            if mode == "round":
                emitted[b].append(new_n[b] - n_out[b])
            else:
                emitted[b] += [1] * (new_n[b] - n_out[b])
                plain_steps[b] += new_n[b] - n_out[b]
        if mode == "round":
            made = sum(new_n[b] - n_out[b] for b in active) / max(1, len(active))
            pace = observe(pace, "round", seconds, made)
            plain_run = 0
        else:
            pace = observe(pace, "plain", seconds / steps)
            plain_run += steps
            if max(state[3 * B:]) >= LOOKUP_TRIGGER:
                plain_run = PROBE_EVERY  # the text repeats itself: try a round now
        cu_count = max(cu[b] for b in active) if active else 1
        n_out, done = new_n, [bool(d) for d in done_now]
    spec.pace, spec.plain_steps = pace, plain_steps
    out = spec.out.tolist()
    stop_ids = set(spec.stop_ids.tolist())
    return [cut_at_stop(out[b][:min(n_out[b], max_new_tokens)], stop_ids) for b in range(B)], emitted


# ---------------------------------------------------------------------------------------------
# --tree_tokens auto: the tree's shape (top_k, depth, tokens) from a cost model of this machine.
#
# A round with shape (k, d, T) costs
#     round(k, d, T) = other + grow_1(k) + (d - 1) * level(k) + verify(T)
# seconds (catch-up, acceptance, compaction and bookkeeping; the tree's first level; each further
# level; the target's forward over T tokens) and emits tau(k, d, T) tokens, for which vanilla
# decoding would take tau steps: the predicted speedup is tau * step / round. On a GPU, bound by
# reading the weights, verify(T) hardly grows with T; on a CPU it does, and a big tree can be
# slower than none, so the shape is chosen per machine, and vanilla decoding when none pays.
#
# tau comes from probe rounds, one top_k at a time, with the deepest and largest tree: a tree of
# depth d and T tokens keeps the T - 1 best-scored candidates of depth <= d of the same pool of
# candidates (the frontier of each level depends on top_k only), a subset closed under ancestors,
# so its accepted path is the longest prefix of the probe's accepted path whose nodes it keeps:
# exact for greedy acceptance, an estimate when sampling.
# ---------------------------------------------------------------------------------------------
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
        first, level = self.grow[top_k]
        return self.other + first + (depth - 1) * level + self.verify_at(tokens + lookup)

    def verify_at(self, tokens: int) -> float:
        """verify(tokens); where it was not measured, on the line through the measured sizes."""
        return on_line(self.verify, tokens)


def on_line(points: dict, x: float) -> float:
    """points[x]; elsewhere on the line through the two points around x (the nearest two, past
    either end; the one value if there is one)."""
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
        n = 0
        for i in accepted:  # the accepted path's prefix that this tree keeps
            if levels[i] > depth or scores[i] < bar:
                break
            n += 1
        total += 1 + n
    return total / len(probes)


def most_tokens(top_k: int, depth: int) -> int:
    """The largest tree a dynamic tree of this top_k and depth can keep, root included."""
    return 1 + top_k + (depth - 1) * top_k ** 2


def choose_shape(costs: ShapeCosts, acceptance: dict, depths, tokens=AUTO_TOKENS,
                 min_speedup: float = AUTO_MIN_SPEEDUP, lookup: int = 0):
    """The rule of --tree_tokens auto, a pure function of measured costs and probes.

    acceptance: {top_k: probes (predicted_tau)}. Returns (the best shape as dict(tree_top_k,
    tree_depth, tree_tokens), or None for vanilla decoding when even the best is predicted below
    min_speedup; and every shape's (predicted speedup, tau, round / step), best first). The margin
    covers measurement noise and what the probe prompts cannot say, so that a close call goes to
    vanilla: a wrong choice must not make decoding slower."""
    table = []
    for k, probes in acceptance.items():
        for d in depths:
            for T in tokens:
                if k not in costs.grow or T not in costs.verify or not 2 <= T <= most_tokens(k, d):
                    continue
                tau = predicted_tau(probes, d, T)
                cost = costs.round(k, d, T, lookup) / costs.step  # lookup's nodes cost, their gain is not counted
                table.append((tau / cost, tau, cost, dict(tree_top_k=k, tree_depth=d, tree_tokens=T)))
    table.sort(key=lambda row: -row[0])
    best = table[0] if table and table[0][0] >= min_speedup else None
    return (None if best is None else best[3]), table


@torch.no_grad()
def measure_shapes(model: Transformer, draft, prompts: list, *, top_ks=AUTO_TOP_K, max_depth: int = 8,
                   tokens=AUTO_TOKENS, rounds: int = AUTO_ROUNDS, temperature: float = 0.0, top_k=None, top_p=None,
                   stop_ids=(), cuda_graphs: bool = False, compiled_cpu: bool = False):
    """What choose_shape needs, measured on this machine: (ShapeCosts, acceptance). Probe rounds
    run on the prompts (lists of ids), one top_k at a time, with the deepest tree and the largest
    number of tokens; the step, each tree level and verify(T) are timed on their own (medians).
    cuda_graphs: time replays of CUDA graphs of the eager step, tree growth and verify, as a
    compiled run on CUDA executes them (eager mode there is launch-bound and would overstate the
    small draft forwards). compiled_cpu: time each part compiled as a --compile run on a CPU
    compiles it (compile_function), with fewer graphs, since each costs a compilation: tree growth
    for the largest top_k only, which serves for all (a level costs what reading the draft's
    weights costs, whatever top_k is: 4.41 ms for top_k 4, 4.52 ms for 8, depth 4, measured), and
    verify(T) for the smallest and largest T, linear in between (measured 1.26, 1.24, 1.38, 1.45
    steps for 8, 12, 16, 24 tokens). Under tensor parallelism every rank takes rank 0's timings
    (tp.from_rank0), so that all choose the same shape."""
    device = model.norm.weight.device
    sampling = (temperature, top_k, top_p)
    budget = rounds * (max_depth + 1) + 2 * (max_depth + 1)
    longest = max(len(p) for p in prompts)

    def seconds(fn, repeats=5, reset=None):
        if cuda_graphs:
            fn = cuda_graph(fn)
        elif compiled_cpu:  # compiled at the first, untimed call
            fn = compile_function(torch._dynamo.dont_skip_tracing(fn), device, (model, draft))
        times = []
        for _ in range(repeats + 1):
            if reset is not None:
                reset()
            device_sync(device)
            t = time.perf_counter()
            fn()
            device_sync(device)
            times.append(time.perf_counter() - t)
        return tp.from_rank0(statistics.median(times[1:]))

    acceptance, grow, others = {}, {}, []
    largest = max(T for T in tokens if T <= max(most_tokens(k, max_depth) for k in top_ks))
    for k in top_ks:
        spec = Speculator(model, draft, tree_top_k=k, tree_depth=max_depth,
                          tree_tokens=min(largest, most_tokens(k, max_depth)), temperature=temperature,
                          top_k=top_k, top_p=top_p, stop_ids=stop_ids)
        spec.setup(1, longest + budget)
        probes, turn = [], 0
        for i in range(rounds):
            if i == 0 or bool(spec.done[0]):  # the next prompt, round robin
                spec.prefill(torch.tensor([prompts[turn % len(prompts)]], device=device), budget)
                turn += 1
            device_sync(device)
            t = time.perf_counter()
            root_hidden = spec.catch_up()
            device_sync(device)
            caught_up = time.perf_counter() - t
            tree, pool = spec.grow(root_hidden, with_pool=True)
            logits, features = spec.verify(tree)
            device_sync(device)
            t = time.perf_counter()
            node, n_accepted, bonus = accept(tree, logits, *spec.sampling)
            path = spec.compact(tree, node)
            spec.advance(tree, path, n_accepted, bonus, features)
            device_sync(device)
            others.append(caught_up + time.perf_counter() - t)
            m = int(n_accepted[0])
            accepted = pool.keep[0, path[0, 1:m + 1] - 1].tolist()
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
        # the rest of a round, compiled: catch-up, then acceptance, compaction and bookkeeping from
        # the state a round leaves (restored before each timing: they move the state on)
        tree = spec.grow(spec.catch_up())
        logits, features = spec.verify(tree)
        state = {name: b.clone() for name, b in spec.named_buffers(recurse=False)}

        def restore():
            for name, b in spec.named_buffers(recurse=False):
                b.copy_(state[name])

        def rest():
            node, n_accepted, bonus = accept(tree, logits, *spec.sampling)
            spec.advance(tree, spec.compact(tree, node), n_accepted, bonus, features)

        others = [seconds(spec.catch_up, reset=restore) + seconds(rest, reset=restore)]
    # verify(T): the target's forward over T tree tokens (a chain) after a real prefix
    spec.prefill(torch.tensor([prompts[0]], device=device), budget)
    verify = {}
    timed = [T for T in tokens if T <= largest]
    if compiled_cpu:
        timed = [min(timed), max(timed)]
    for T in timed:
        parents = torch.arange(-1, T - 1, device=device)[None]
        chain = Tree(spec.root[:, None].expand(1, T).clone(), parents, *tree_structure(parents, T - 1))
        verify[T] = seconds(lambda: model(chain.tokens, spec.prefix_len[:, None] + chain.depth,
                                          model.max_seq_length - T + torch.arange(T, device=device),
                                          TreeMask(spec.prefix_len, chain.ancestors)))
    if compiled_cpu:  # the rest in between, on the line through the two
        verify = {T: on_line(verify, T) for T in tokens if T <= largest}
    token = spec.root.clone()
    position = spec.prefix_len.clone()

    def step():  # one vanilla decode step, as generate.decode_one_token (in place: a CUDA graph replays it)
        token.copy_(sample(model(token[:, None], position[:, None])[:, -1], *sampling))

    costs = ShapeCosts(step=seconds(step), verify=verify, grow=grow, other=tp.from_rank0(statistics.median(others)))
    return costs, acceptance


def shape_table(model: Transformer, draft, prompts: list, *, top_ks=AUTO_TOP_K, depths=range(1, 9), stop_ids=(),
                cuda_graphs: bool = False, compiled_cpu: bool = False, cache_key: Optional[dict] = None,
                lookup: int = 0, **sampling):
    """measure_shapes (or its cached result) and choose_shape: (choice, table, costs, how it got
    the costs). cache_key: what identifies the measurement (machine, model, head, dtype, mode,
    sampling); with it, the costs and probes are kept in auto_cache_dir() and a second run reads
    them instead of measuring again. compiled_cpu: costs of compiled graphs on a CPU, over trees of
    at most 32 tokens (AUTO_TOKENS_CPU)."""
    if not prompts or not all(prompts):
        raise ValueError("--tree_tokens auto measures on prompts; none was given")
    tokens = AUTO_TOKENS_CPU if compiled_cpu else AUTO_TOKENS
    cache = None if cache_key is None else auto_cache_dir() / (_digest(dict(
        cache_key, top_ks=list(top_ks), max_depth=max(depths), tokens=list(tokens), rounds=AUTO_ROUNDS,
        sampling=sampling, compiled_cpu=compiled_cpu)) + ".pt")
    t = time.perf_counter()
    if cache is not None and cache.is_file():
        costs, acceptance = _read_cache(cache)
        how = f"read {cache}"
    else:
        costs, acceptance = measure_shapes(model, draft, prompts, top_ks=top_ks, max_depth=max(depths), tokens=tokens,
                                           stop_ids=stop_ids, cuda_graphs=cuda_graphs, compiled_cpu=compiled_cpu,
                                           **sampling)
        how = f"measured for {time.perf_counter() - t:.1f} s"
        if cache is not None:
            # Written under a name of this process's and renamed when whole: another process
            # measuring at the same time never reads half a file.
            cache.parent.mkdir(parents=True, exist_ok=True)
            partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
            torch.save({"costs": costs._asdict(), "acceptance": acceptance}, partial)
            os.replace(partial, cache)
    return (*choose_shape(costs, acceptance, depths, tokens, lookup=lookup), costs, how)


def auto_shape(model: Transformer, draft, prompts: list, **kwargs) -> Optional[dict]:
    """--tree_tokens auto: measure (or read the cache), choose, and say what was chosen and why.
    Returns dict(tree_top_k, tree_depth, tree_tokens), or None for vanilla decoding. Arguments as
    shape_table's."""
    choice, table, costs, how = shape_table(model, draft, prompts, **kwargs)
    print(f"--tree_tokens auto: {how}; a vanilla step takes {costs.step * 1e3:.1f} ms. Best shapes "
          f"(top_k, depth, tokens: predicted tokens per round, round cost in steps, speedup):", file=sys.stderr)
    for speedup, tau, cost, shape in table[:5]:
        print(f"  {shape['tree_top_k']:3d} {shape['tree_depth']:3d} {shape['tree_tokens']:4d}: tau {tau:.2f}, "
              f"round {cost:.2f} steps -> {speedup:.2f}x", file=sys.stderr)
    if choice is None:
        print(f"--tree_tokens auto: no tree is predicted to be {AUTO_MIN_SPEEDUP}x faster than vanilla decoding "
              f"on this machine: decoding without speculation", file=sys.stderr)
    return choice


def auto_cache_dir() -> Path:
    """Where --tree_tokens auto keeps its measurements: $EAGLE_AUTO_CACHE, else the user's cache."""
    return Path(os.environ.get("EAGLE_AUTO_CACHE") or Path.home() / ".cache" / "eagle-gpt-fast" / "auto")


def cpu_info() -> dict:
    """The first CPU's fields in /proc/cpuinfo ("vendor_id", "cpu family", "model name", "flags",
    ...); empty where there is no such file."""
    info = {}
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    return info


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers and whether it has AMX where
    /proc/cpuinfo says: the name alone can be a bare vendor line ("AMD EPYC" on two generations of
    the project's VMs, whose timings differ)."""
    cpu = platform.processor() or platform.machine()
    info = cpu_info()
    if not info.get("model name"):
        return cpu
    cpu = info["model name"]
    if info.get("cpu family"):
        amx = "AMX" if "amx_tile" in info.get("flags", "").split() else "no AMX"
        cpu += f" (family {info['cpu family']}, model {info.get('model', '?')}, {amx})"
    return cpu


def machine_key(device) -> dict:
    """The machine, as far as timings depend on it."""
    hardware = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else cpu_name()
    return dict(hardware=hardware, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                host=platform.node())


def file_key(path) -> dict:
    """A file, as far as its contents matter: name, size and modification time."""
    path = Path(path)
    target = path / "draft.safetensors" if path.is_dir() else path
    stat = target.stat()
    return dict(path=str(target.resolve()), size=stat.st_size, mtime=stat.st_mtime_ns)


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read_cache(path: Path):
    saved = torch.load(path, weights_only=True)
    costs = saved["costs"]
    costs = ShapeCosts(step=costs["step"], verify={int(k): v for k, v in costs["verify"].items()},
                       grow={int(k): tuple(v) for k, v in costs["grow"].items()}, other=costs["other"])
    return costs, {int(k): v for k, v in saved["acceptance"].items()}


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


# ---------------------------------------------------------------------------------------------
# Compiling. On CUDA, Inductor with per-function options: "triton.cudagraphs" is all that
# mode="reduce-overhead" sets (torch._inductor.list_mode_options), so a round or a decode step
# replays as one CUDA graph. On a CPU, a backend of our own (cpu_backend) applies the settings
# of CPU inference while a graph compiles.
# ---------------------------------------------------------------------------------------------
# Coordinate-descent tuning, which generate.compile_decoding keeps for the small one-token step as
# gpt-fast does, is off for a round: it tunes every kernel of a ~1-2k-node graph, and compile time
# explodes. The FX graph cache lets a second process (another method, a rerun) load a graph it has
# compiled before.
ROUND_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": False, "fx_graph_cache": True}
PREFILL_OPTIONS = {"coordinate_descent_tuning": False, "fx_graph_cache": True}

# Inductor's settings for inference on a CPU, measured on a 2-core Sapphire Rapids (AMX), SmolLM2-135M,
# one bf16 decode step: 25 ms compiled by default, 13-15 ms with these (eager: 29 ms).
#   freezing      weights become constants of the graph, which the C++ GEMM templates need
#   max_autotune  C++ GEMM templates (AMX / AVX-512 micro-kernels, weights packed once at compile
#                 time) timed against ATen's kernel for every GEMM shape; they win the small-M
#                 GEMMs of decoding at about the machine's read bandwidth
#   cpp_wrapper   the graph's host code (allocations, views, kernel and ATen calls) in C++
#                 instead of Python: a bf16 step calls ~600 kernels and ATen ops, a round more
#                 (measured on a 2-core Xeon with AMX, one process, alternating: a step -2 to -5 %,
#                 a round -5 %, and the batch-invariant mode's extra calls cost less: its step
#                 +7 % against +14 % over plain decoding; benchmarks/README.md)
# Dynamo reads the freezing flag while it traces (a module's parameters then become static inputs
# that Inductor may fold into the graph), so it is set around every call of a compiled function
# (frozen(): 13 us a call) and the rest around Inductor's compile_fx (cpu_backend): as a
# per-function option of torch.compile it would be read too late to act.
CPU_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                "coordinate_descent_tuning": False, "fx_graph_cache": True, "cpp_wrapper": True}
# ... and for a model in batch-invariant mode (Transformer.invariant_window), where a token's row must
# come out the same from a one-token step and a T-token verify (measured on the 2-core AMX machine,
# SmolLM2-135M bf16, torch 2.13: without either setting the two graphs' rows differ from layer 0 on):
#   CPP only               autotuning picks ATen's GEMM for some row counts and the C++ template
#                          for others, which round differently (and the pick follows timing noise);
#                          the template alone gave equal rows for 1 to 64 rows
#   emulate_precision_casts  a fused kernel otherwise keeps a bf16 intermediate in float32, and
#                          which ops fuse depends on the shapes. Seen on a Zen 4 (torch 2.13,
#                          2026-11-29): the 16-row verify's GEMM templates take the residual add
#                          into their epilogue (adding the unrounded product) where the one-row
#                          step's do not, and Inductor inlines a chain of residual adds into the
#                          kernels that read it, stored at adds that differ between the graphs
#                          from four layers on; every row of SmolLM2 then came out apart
CPU_INVARIANT = {"max_autotune_gemm_backends": "CPP", "emulate_precision_casts": True}
# The version of the lowerings a batch-invariant CPU graph is compiled with
# (quantize.lower_int8_rows_to_the_kernel, lower_int4_rows_to_the_kernel): bump it when they change.
INVARIANT_LOWERINGS = 2
# Autotuning prints each GEMM's candidates and timings to stderr (~50 lines on a first run of the
# demo); a user of generate.py wants the answer. Set where this torch has them.
CPU_QUIET = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


# What cpu_backend uses, as (module, attribute), so that a torch without one of them gets a clear
# message rather than a traceback from inside the compiler (torch 2.13 has them all).
CPU_COMPILE_NEEDS = (("torch._inductor.config", "freezing"), ("torch._inductor.config", "max_autotune_gemm_backends"),
                     ("torch._inductor.config", "fx_graph_cache"), ("torch._inductor.compile_fx", "compile_fx"),
                     ("torch.compiler.config", "cache_key_tag"), ("torch.backends.mkldnn", "flags"))


def missing_cpu_compile_settings() -> list:
    """The names of CPU_COMPILE_NEEDS this torch lacks."""
    missing = []
    for module, attribute in CPU_COMPILE_NEEDS:
        try:
            found = hasattr(importlib.import_module(module), attribute)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{attribute}")
    return missing


def weights_digest(*modules: nn.Module) -> str:
    """A digest of the modules' weights (their state dicts: parameters, quantized weights, scales).

    cpu_backend tags Inductor's cache key with it: the key covers frozen weights by shape only,
    while the GEMM templates' packed copies of them are stored in the cache entry, so another
    checkpoint of the same shapes would silently run on the first one's weights (measured). About
    1 GB/s: 0.3 s for SmolLM2-135M in bf16."""
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


def batch_invariant(modules) -> bool:
    """Whether any of the modules is a target in batch-invariant mode (Transformer.invariant_window)."""
    return any(getattr(m, "invariant_window", None) is not None for m in modules)


def cpu_backend(*modules: nn.Module):
    """A torch.compile backend for the modules' graphs on a CPU: Inductor with CPU_INDUCTOR, its
    cache keyed by the modules' weights (weights_digest), and oneDNN disabled while compiling.

    Why oneDNN is off during compilation (only then: the compiled code runs with it): freezing's
    weight pre-packing turns weights into oneDNN tensors for the case that ATen's kernel wins, and
    a graph holding them cannot be pickled, so Inductor skips its cache and every process
    recompiles (45-85 s for a decode step here). Without that pass the C++ templates still serve
    every linear, at the same speed (they pack their own weights into plain tensors), and a second
    process loads the compiled step from the cache in ~11 s. The pass is registered once per
    process, on the first frozen compile, so every frozen compile must come through here."""
    from torch._inductor.compile_fx import compile_fx
    tag = weights_digest(*modules)
    settings = dict(CPU_INDUCTOR, **{k: v for k, v in CPU_QUIET.items() if hasattr(torch._inductor.config, k)})
    if batch_invariant(modules):
        missing = [k for k in CPU_INVARIANT if not hasattr(torch._inductor.config, k)]
        if missing:
            raise RuntimeError(f"batch-invariant compiling needs torch._inductor.config.{', '.join(missing)}, which "
                               f"torch {torch.__version__} lacks: upgrade torch (2.13 has them) or run without --compile")
        settings.update(CPU_INVARIANT)
        lower_int8_rows_to_the_kernel()  # only a batch-invariant graph calls int8_rows
        lower_int4_rows_to_the_kernel()  # ... and int4_rows_cpu
        # Inductor's cache key covers the graph and the settings, not these lowerings: a graph
        # cached before they changed would load with the old code (int4_rows_cpu called back
        # through Python until 2026-11-29), so the version of the lowerings keys the cache too
        tag += f"-lowerings-{INVARIANT_LOWERINGS}"

    def backend(gm, example_inputs):
        with torch._inductor.config.patch(settings), torch.compiler.config.patch(cache_key_tag=tag), \
                warnings.catch_warnings():
            # mkldnn.flags() warns that TF32 needs an Intel GPU every time it is entered: noise
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
            with torch.backends.mkldnn.flags(enabled=False):
                return compile_fx(gm, example_inputs)
    return backend


def compile_function(fn, device, modules, *, dynamic: bool = False, options: Optional[dict] = None,
                     backend="inductor"):
    """torch.compile of fn (fullgraph: a graph break would split it around a host sync) for device:
    on a CPU through cpu_backend(*modules), elsewhere Inductor with options. backend: a backend of
    torch.compile's to use instead (the tests pass one that inspects the graph)."""
    # batch-invariant attention asks ATen's kernel a question while dynamo traces (model.flash_rows)
    torch.compiler.assume_constant_result(flash_rows)
    if backend != "inductor":
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    if str(device) == "cpu":
        missing = missing_cpu_compile_settings()
        if missing:
            raise RuntimeError(f"compiling for a CPU needs {', '.join(missing)}, which torch {torch.__version__} "
                               f"lacks: upgrade torch (2.13 has them) or run without --compile")
        return frozen(torch.compile(fn, backend=cpu_backend(*modules), fullgraph=True, dynamic=dynamic,
                                    options={"guard_filter_fn": frozen_graph_guards}))
    if batch_invariant(modules):
        # batch-invariant mode: a fused kernel keeps a 16-bit intermediate in float32 otherwise, and
        # which ops fuse depends on the graph's shapes (the CPU's CPU_INVARIANT, measured there)
        options = dict(options or {}, emulate_precision_casts=True)
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, options=options)


def frozen_graph_guards(entries) -> list:
    """Which of dynamo's guards a frozen CPU graph keeps (torch.compile's guard_filter_fn): all but
    those on the insides of submodules other than their buffers. Dynamo checks every guard before
    every call, and for a model passed in they cover each submodule's hook dicts, types, constants
    and parameters: ~4,200 checks for SmolLM2, 0.87 ms a call, ~4 % of a compiled bf16 step on a
    2-core Xeon (0.29 ms with this filter). A frozen graph holds its weights as constants from the
    moment it compiles, so a guard on a parameter's identity could only recompile for a weight the
    graph no longer reads; what a call does read is kept guarded: every buffer (the KV caches, whose
    reallocation by setup_caches recompiles, the RoPE tables) and everything of the modules
    themselves (sizes, invariant_window, config). Not seen, then: a submodule replaced or a hook
    registered on one after compiling; compile after changing a model's structure."""
    return ["._modules[" not in e.name or "._buffers[" in e.name for e in entries]


def frozen(compiled):
    """compiled, called with Inductor's freezing flag on: dynamo may trace at any call (the first,
    or a recompile), and reads the flag then."""
    def call(*args, **kwargs):
        # no_grad: with grad mode on, dynamo traces a training graph, which freezing leaves alone
        # (weights stay graph inputs, no C++ GEMM templates: a decode step timed that way ran 56 ms
        # instead of 15 here, and batch-invariant mode, which allows the templates only, cannot compile)
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            return compiled(*args, **kwargs)
    return call


def compile_round(spec: Speculator, compile_prefill: bool, backend="inductor"):
    """One speculative round as one graph, dynamic=False (every shape of a round is fixed by the
    Speculator; a dynamic-shape graph would specialise less and recompile where a static one need
    not).

    dont_skip_tracing: torch._dynamo skips any module whose import name is "tree" (it takes it for
    the dm-tree library), and that would be our tree.py.

    Every Speculator compiles its own graph of the same code (Speculator.round), and dynamo keeps
    at most torch._dynamo.config.recompile_limit (8) graphs per code object: a process that
    compiles more rounds (methods x temperatures x tree sizes) raises the limit, as
    scripts/benchmark.py does, or runs one method per process, as scripts/gpu_check.sh does."""
    if not hasattr(torch._dynamo, "dont_skip_tracing"):  # added in torch 2.8
        raise RuntimeError(f"compiling a round needs torch >= 2.8 (torch._dynamo.dont_skip_tracing), this is "
                           f"torch {torch.__version__}: upgrade torch or run without --compile")
    device = spec.target.norm.weight.device
    modules = (spec.target,) if spec.draft is None else (spec.target, spec.draft)
    # The plain step and the flush of adaptive decoding are graphs of their own, compiled at their
    # first call (a run that never steps plainly never compiles them).
    for name in ("round", "plain_step", "flush"):
        setattr(spec, name, compile_function(torch._dynamo.dont_skip_tracing(getattr(spec, name)), device, modules,
                                             options=ROUND_OPTIONS, backend=backend))
    if compile_prefill:  # prompts vary in length: dynamic shapes, no CUDA graphs; setup stays eager
        spec.read_prompt = compile_function(spec.read_prompt, device, modules, dynamic=True,
                                            options=PREFILL_OPTIONS, backend=backend)
    return spec
