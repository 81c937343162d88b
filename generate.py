"""Text generation: vanilla decoding with a static KV cache, compiled with torch.compile.

    python generate.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --chat \
        --prompt "What is the capital of France?" --compile

The decode step is one compiled graph (CUDA graphs on GPU). The next token never leaves the
device: the host looks at generated tokens only to stream them or, every few steps, to stop at
an end-of-turn token.
"""
import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from draft import dynamic_tree_slots, grow_dynamic_tree, grow_static_tree
from model import ModelArgs, Transformer, TreeMask, set_attention_backend
from tree import Tree

STOP_CHECK_EVERY = 16  # decode steps between host syncs that look for a stop token when not streaming


# ---------------------------------------------------------------------------------------------
# Sampling. Speculative decoding draws from exactly the same processed distribution, which is
# what makes it lossless: keep every transformation of the logits inside logits_to_probs.
# ---------------------------------------------------------------------------------------------
def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus), then renormalise. logits [..., V] -> probs."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p: a token is dropped
        # when the tokens ranked above it already hold top_p. The top token is always kept.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: Tensor) -> Tensor:
    """One draw from each row of probs without a host sync: argmax(p / E), E ~ Exp(1), picks
    index i with probability p_i (the exponential-race form of the Gumbel-max trick)."""
    noise = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / noise, dim=-1)


def sample(logits: Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float]) -> Tensor:
    """Next token from logits [..., V]; temperature 0 is greedy."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return sample_from(logits_to_probs(logits, temperature, top_k, top_p))


# ---------------------------------------------------------------------------------------------
# Vanilla decoding
# ---------------------------------------------------------------------------------------------
def prefill(model: Transformer, prompt: Tensor, temperature, top_k, top_p) -> Tensor:
    """Run the prompt [B, L] through the model, filling cache slots 0..L-1; returns the first new token [B]."""
    input_pos = torch.arange(prompt.size(1), device=prompt.device)
    logits = model(prompt, input_pos)
    return sample(logits[:, -1], temperature, top_k, top_p)


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, temperature, top_k, top_p) -> Tensor:
    """token [B], input_pos [1] -> next token [B]. This is the function that is compiled."""
    logits = model(token[:, None], input_pos)
    return sample(logits[:, -1], temperature, top_k, top_p)


@torch.no_grad()
def generate(model: Transformer, prompt: Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, stop_ids=(),
             callback: Optional[Callable[[Tensor], None]] = None,
             prefill_fn=prefill, decode_fn=decode_one_token) -> list:
    """Generate up to max_new_tokens after prompt [B, L] (every row continues the same way from
    its own prompt). Returns, per row, the list of new token ids, cut after the first stop token
    (which is kept). callback(tokens [B]) is called with each new token (streaming)."""
    B, L = prompt.shape
    model.setup_caches(B, L + max_new_tokens)  # no-op when the caches are already large enough
    if L + max_new_tokens > model.max_seq_length:
        raise ValueError(f"prompt ({L}) + max_new_tokens ({max_new_tokens}) exceed the KV cache ({model.max_seq_length})")
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=prompt.device)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=prompt.device)

    token = prefill_fn(model, prompt, temperature, top_k, top_p)
    out[:, 0] = token
    input_pos = torch.tensor([L], device=prompt.device)
    n = 1
    while True:
        if callback is not None:
            callback(out[:, n - 1])
        # Stop checks are the only host syncs: every step while streaming, else every few steps.
        if n == max_new_tokens or ((callback is not None or n % STOP_CHECK_EVERY == 0) and _all_stopped(out[:, :n], stop)):
            break
        token = decode_fn(model, token.clone(), input_pos, temperature, top_k, top_p)
        out[:, n] = token
        input_pos += 1
        n += 1
    return [_cut_at_stop(row, stop_ids) for row in out[:, :n].tolist()]


def _all_stopped(tokens: Tensor, stop: Tensor) -> bool:
    return bool(torch.isin(tokens, stop).any(dim=1).all()) if stop.numel() else False


def _cut_at_stop(ids: list, stop_ids) -> list:
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids


# ---------------------------------------------------------------------------------------------
# EAGLE speculative decoding. Each round: bring the draft up to date, grow a tree of guesses,
# verify all of them in one target forward, accept the longest correct path (plus one token
# from the target), and copy the accepted nodes' K/V down to the end of the prefix.
# ---------------------------------------------------------------------------------------------
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
        vocab = target.config.vocab_size
        if static is not None:
            tree_depth, tree_tokens = static.max_depth, static.parents.numel()
            if int(static.ranks.max()) >= vocab:
                raise ValueError(f"the static tree uses child rank {int(static.ranks.max())}, the vocabulary has {vocab} tokens")
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
        self.capacity = 0

    def draft_region(self) -> int:
        return self.n_nodes - 1 if self.static is not None else dynamic_tree_slots(self.tree_top_k, self.depth)

    def setup(self, batch_size: int, max_seq_length: int):
        """Caches and state for batch_size rows of up to max_seq_length tokens each, plus the
        tree regions at the ends of both caches."""
        device = self.target.norm.weight.device
        self.target.setup_caches(batch_size, max_seq_length + self.n_nodes)
        self.draft.setup_caches(batch_size, max_seq_length + self.draft_region())
        self.capacity = min(self.target.max_seq_length - self.n_nodes, self.draft.max_seq_length - self.draft_region())
        B, D1, dim = batch_size, self.depth + 1, self.target.config.dim
        if getattr(self, "out", None) is not None and self.out.shape == (B, self.capacity):
            return
        long = dict(dtype=torch.long, device=device)
        for name, value in dict(
            prefix_len=torch.zeros(B, **long), root=torch.zeros(B, **long),
            cu_tokens=torch.zeros(B, D1, **long), cu_count=torch.zeros(B, **long),
            cu_features=torch.zeros(B, D1, dim, dtype=self.target.norm.weight.dtype, device=device),
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
        logits, features, _ = target(prompt, torch.arange(L, device=device), return_features=True)
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
        """One speculative round over all rows; rows that are done are left as they are."""
        target, draft = self.target, self.draft
        B, device = self.root.size(0), self.root.device
        rows, steps = torch.arange(B, device=device), torch.arange(self.depth + 1, device=device)
        L = self.prefix_len

        # 1. Draft catch-up on the pairs accepted last round, at positions L - cu_count ... (unused
        #    trailing entries are overwritten later). Its output at the root predicts the root's children.
        hidden = draft(target.tok_embeddings(self.cu_tokens), self.cu_features, (L - self.cu_count)[:, None] + steps)
        root_hidden = hidden[rows, self.cu_count - 1]

        # 2. Grow the tree of guesses.
        if self.static is None:
            tree = grow_dynamic_tree(draft, target.tok_embeddings, target.output, self.root, root_hidden, L,
                                     self.tree_top_k, self.depth, self.n_nodes)
        else:
            tree = grow_static_tree(draft, target.tok_embeddings, target.output, self.static, self.root, root_hidden, L)

        # 3. Verify: one target forward over all nodes, kept in the last n_nodes slots of its cache.
        region_start = target.max_seq_length - self.n_nodes
        logits, features, _ = target(
            tree.tokens, L[:, None] + tree.depth, region_start + torch.arange(self.n_nodes, device=device),
            TreeMask(L, tree.ancestors), return_features=True)

        # 4. Accept: the path to `node` (n_accepted guesses), then the target's own next token.
        node, n_accepted, bonus = accept(tree, logits, *self.sampling)
        path = tree.paths[rows, node]  # [B, depth + 1]: root, accepted nodes, then -1

        # 5. Copy the accepted nodes' K/V from the tree region to the slots after the prefix.
        src, dst = region_start + path.clamp(min=0), L[:, None] + steps
        for layer in target.layers:
            layer.attention.kv_cache.copy_slots(src, dst)

        # 6. New tokens: the accepted guesses then the bonus token; they are also the draft's next
        #    catch-up input, paired with the target's true features at root, node 1, ..., node m.
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
    return [_cut_at_stop(out[b][:min(n_out[b], max_new_tokens)], stop_ids) for b in range(B)], accepted


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
                       tree_depth: int = 6, n_rounds: int = 3, temperature: float = 0.0, top_k=None, top_p=None):
    """Eager timings for choose_tree_tokens on this hardware: (seconds per vanilla decode step,
    {T: (seconds per round, tokens per round)}) for the EAGLE-2 tree sizes in `sizes` that
    tree_top_k and tree_depth allow, smallest first. Each size runs n_rounds + 1 rounds from the
    prompt [1, L]; times are medians after the first; tokens per round estimate tau on this prompt.
    Sizes stop once a round costs so much that even tree_depth + 1 tokens, the most a round can
    emit, would not make it AUTO_MIN_SPEEDUP faster: larger trees only cost more. Eager, not
    compiled, because compiling every size would take minutes; where eager mode is slow to launch
    kernels (a GPU), it overstates what a round costs more than what a step does, which errs
    toward vanilla. On a 2-core CPU the opposite was measured (a compiled round cost 3.1 steps,
    an eager one 2.4: benchmarks/README.md), so there a close call can still lose a little."""
    device, L = str(prompt.device), prompt.size(1)
    sampling = (temperature, top_k, top_p)
    most = 1 + tree_top_k + (tree_depth - 1) * tree_top_k ** 2
    budget = (n_rounds + 1) * (tree_depth + 1) + 1  # more than the rounds can emit: no row stops

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
    token = prefill(model, prompt, *sampling)
    input_pos = torch.tensor([L], device=prompt.device)

    def step():
        nonlocal token
        token = decode_one_token(model, token.clone(), input_pos, *sampling)
        input_pos.add_(1)

    step_s = median_seconds(step)
    rounds = {}
    for T in sorted(T for T in sizes if 2 <= T <= most):
        spec = Speculator(model, draft, tree_top_k=tree_top_k, tree_depth=tree_depth, tree_tokens=T,
                          temperature=temperature, top_k=top_k, top_p=top_p)
        spec.setup(1, L + budget + 2 * (tree_depth + 1))
        spec.prefill(prompt, budget)
        seconds = median_seconds(spec.round)
        rounds[T] = (seconds, (int(spec.n_out[0]) - 1) / (n_rounds + 1))
        if (tree_depth + 1) * step_s / seconds < AUTO_MIN_SPEEDUP:
            break
    return step_s, rounds


def auto_tree_tokens(model: Transformer, draft, prompt_ids, *, tree_top_k: int = 10, tree_depth: int = 6,
                     **sampling) -> Optional[int]:
    """--tree_tokens auto: measure (a few seconds), choose, and say what was chosen and why.
    Returns the tree size, or None for vanilla decoding."""
    if not prompt_ids:
        raise ValueError("--tree_tokens auto measures on a prompt; none was given")
    prompt = torch.tensor([list(prompt_ids)], device=model.norm.weight.device)
    t = time.perf_counter()
    step_s, rounds = measure_tree_costs(model, draft, prompt, tree_top_k=tree_top_k, tree_depth=tree_depth, **sampling)
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


# ---------------------------------------------------------------------------------------------
# Loading and reporting
# ---------------------------------------------------------------------------------------------
def load_model(checkpoint_path, device, dtype) -> Transformer:
    """model.pth as written by convert_hf_checkpoint.py, or model_int8.pth / model_int4.gNN.pth
    written by quantize.py (the mode is in the name); config from model_config.json beside it
    or from the folder's name."""
    import quantize

    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise FileNotFoundError(
            f"checkpoint not found: {checkpoint_path}\n"
            f"  prepare one with: bash scripts/prepare.sh SmolLM2-135M-Instruct   (or a Hugging Face repo id)")
    config = ModelArgs.from_checkpoint(checkpoint_path)
    with torch.device("meta"):
        model = Transformer(config)
    state_dict = torch.load(checkpoint_path, mmap=True, weights_only=True, map_location="cpu")
    quantize.prepare_for_loading(model, state_dict, checkpoint_path)  # int8/int4 layers, when the file has them
    tied = config.tie_embeddings and "output.weight" not in state_dict  # a quantized head is its own copy
    if tied:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    try:
        model.load_state_dict(state_dict, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{checkpoint_path} does not fit its config {config}:\n{e}") from None
    if tied:  # assign=True replaced the shared Parameter by two; share it again
        model.output.weight = model.tok_embeddings.weight
    return quantize.pack_int4(model.to(device=device, dtype=dtype).eval())


def model_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights read by one decode step: every parameter except the embedding table, of
    which a step reads one row (unless it doubles as the LM head), and of mixture-of-experts
    weights only the k of E experts the token is routed to. The state dict, not the parameters:
    quantized weights and their scales are buffers."""
    seen, total = set(), 0
    c = model.config
    for name, p in model.state_dict(keep_vars=True).items():
        if id(p) in seen or (name == "tok_embeddings.weight" and model.output.weight is not p):
            continue
        seen.add(id(p))
        size = p.numel() * p.element_size()
        # an expert stack's weight, or its int8 scales
        experts = c.num_experts and name.rsplit(".", 1)[0].endswith(("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))
        total += size * c.num_activated_experts // c.num_experts if experts else size
    return total


def peak_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_reserved() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def device_sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def compile_decoding(device: str, compile_prefill: bool):
    """The decode step becomes one graph; on CUDA "reduce-overhead" replays it as a CUDA graph.
    The prompt length varies, so prefill is compiled with dynamic shapes and no CUDA graphs."""
    global decode_one_token, prefill
    decode_one_token = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    if compile_prefill:
        prefill = torch.compile(prefill, fullgraph=True, dynamic=True)
    torch._inductor.config.coordinate_descent_tuning = device.startswith("cuda")
    torch._inductor.config.fx_graph_cache = True


def compile_round(spec: Speculator, compile_prefill: bool):
    """One speculative round as one graph. dont_skip_tracing: torch._dynamo skips any module whose
    import name is "tree" (it takes it for the dm-tree library), and that would be our tree.py."""
    spec.round = torch.compile(torch._dynamo.dont_skip_tracing(spec.round), mode="reduce-overhead", fullgraph=True)
    if compile_prefill:
        spec.prefill = torch.compile(spec.prefill, fullgraph=True, dynamic=True)
    return spec


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _tree_tokens_arg(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tree nodes or 'auto', got {value!r}") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct/model.pth"))
    p.add_argument("--prompt", type=str, default=None, help="prompt text (default: 'Hello, my name is')")
    p.add_argument("--prompt_file", type=Path, default=None, help="read the prompt text from this file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--interactive", action="store_true", help="chat in the terminal, streaming the answers")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k most probable tokens")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling: smallest set with this much mass")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action="store_true", help="compile the decode step (CUDA graphs on GPU)")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (dynamic shapes)")
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--output_json", type=Path, default=None, help="write prompt, outputs and speed here")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculate", choices=["none", "eagle", "eagle2"], default="none",
                   help="eagle: static tree (EAGLE-1); eagle2: dynamic tree (EAGLE-2)")
    g.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="EAGLE draft folder (default: the eagle/ folder beside the checkpoint)")
    g.add_argument("--tree_top_k", type=int, default=10, help="eagle2: children per expanded node")
    g.add_argument("--tree_depth", type=int, default=6, help="eagle2: levels of draft guesses")
    g.add_argument("--tree_tokens", type=_tree_tokens_arg, default=60,
                   help="eagle2: nodes verified per round, root included; auto: measure this hardware and pick "
                        "the size predicted to be fastest, or vanilla decoding if none wins (see auto_tree_tokens)")
    g.add_argument("--tree", type=Path, default=None,
                   help="eagle: JSON list of child-rank paths for the static tree (default: mc_sim_7b_63)")
    g.add_argument("--attention", choices=["auto", "sdpa", "triton"], default="auto",
                   help="tree attention: triton = the fused kernel of tree_attention.py (CUDA only), sdpa = SDPA "
                        "with dense masks; auto: triton on CUDA when triton is installed, else sdpa")
    args = p.parse_args(argv)

    errors = []
    if args.temperature < 0:
        errors.append(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        errors.append(f"--top_k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        errors.append(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        errors.append(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_samples < 1:
        errors.append(f"--num_samples must be >= 1, got {args.num_samples}")
    if args.prompt is not None and args.prompt_file is not None:
        errors.append("give --prompt or --prompt_file, not both")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        errors.append(f"--prompt_file not found: {args.prompt_file}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        errors.append(f"--device {args.device} requested but CUDA is not available")
    if args.attention == "triton" and not args.device.startswith("cuda"):
        errors.append(f"--attention triton runs on CUDA, not on --device {args.device} (use --attention sdpa)")
    if args.tree is not None and args.speculate != "eagle":
        errors.append("--tree sets the static tree of --speculate eagle")
    if args.tree_tokens == "auto" and args.speculate == "eagle":
        errors.append("--tree_tokens auto sizes the dynamic tree of --speculate eagle2; eagle's static tree has a fixed size")
    if args.tree is not None and not args.tree.is_file():
        errors.append(f"--tree file not found: {args.tree}")
    if args.speculate != "none":
        if args.draft_checkpoint_path is None:
            args.draft_checkpoint_path = args.checkpoint_path.parent / "eagle"
        if not args.draft_checkpoint_path.exists():
            errors.append(f"--speculate {args.speculate} needs an EAGLE draft: {args.draft_checkpoint_path} not found "
                          f"(pass --draft_checkpoint_path, or train one with scripts/train_eagle.py)")
    if errors:
        p.error("\n  ".join(errors))
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def make_decoder(args, model: Transformer, stop_ids, max_seq_length: int, probe_ids=None):
    """A function prompt_ids, max_new_tokens, callback -> (new ids, tokens per round or None)
    for the decoding method the command line asks for, compiled if asked. Caches are allocated
    here, once, for prompt + new tokens up to max_seq_length, so that no later call changes a
    compiled shape. probe_ids: the prompt that --tree_tokens auto measures on; when it picks no
    tree, args.speculate becomes "none"."""
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.speculate == "none":
        model.setup_caches(1, max_seq_length)
        if args.compile:
            compile_decoding(args.device, args.compile_prefill)

        def decode(prompt_ids, max_new_tokens, callback=None):
            prompt = torch.tensor([prompt_ids], device=args.device)
            # the step functions are passed explicitly: compile_decoding rebinds the module's names,
            # and generate()'s defaults still hold the uncompiled ones
            return generate(model, prompt, max_new_tokens, stop_ids=stop_ids, callback=callback,
                            prefill_fn=prefill, decode_fn=decode_one_token, **sampling)[0], None
        return decode

    from draft import load_draft
    from tree import mc_sim_7b_63, static_tree

    draft = load_draft(args.draft_checkpoint_path, model.config, args.device, model.norm.weight.dtype)
    if args.tree_tokens == "auto":
        args.tree_tokens = auto_tree_tokens(model, draft, probe_ids, tree_top_k=args.tree_top_k,
                                            tree_depth=args.tree_depth, **sampling)
        if args.tree_tokens is None:
            args.speculate = "none"
            return make_decoder(args, model, stop_ids, max_seq_length)
    static = None
    if args.speculate == "eagle":
        static = static_tree(json.loads(args.tree.read_text()) if args.tree else mc_sim_7b_63)
    spec = Speculator(model, draft, static=static, tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                      tree_tokens=args.tree_tokens, stop_ids=stop_ids, **sampling)
    spec.setup(1, max_seq_length + 2 * (spec.depth + 1))  # + room for the last round's overshoot
    if args.compile:
        torch._inductor.config.coordinate_descent_tuning = args.device.startswith("cuda")
        torch._inductor.config.fx_graph_cache = True
        compile_round(spec, args.compile_prefill)

    def decode(prompt_ids, max_new_tokens, callback=None):
        prompt = torch.tensor([prompt_ids], device=args.device)
        ids, per_round = speculative_generate(spec, prompt, max_new_tokens, callback=callback)
        return ids[0], per_round[0]
    return decode


def main(argv=None):
    args = parse_args(argv)
    from tokenizer import load_tokenizer

    torch.manual_seed(args.seed)
    device, dtype = args.device, getattr(torch, args.dtype)
    t0 = time.perf_counter()
    try:
        args.attention = set_attention_backend(args.attention, device)
        model = load_model(args.checkpoint_path, device, dtype)
        tokenizer = load_tokenizer(args.checkpoint_path.parent)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    device_sync(device)
    print(f"Loaded {args.checkpoint_path} in {time.perf_counter() - t0:.2f} s ({device}, {args.dtype})", file=sys.stderr)

    if args.interactive:
        context = min(model.config.block_size, 4096)
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "Hello! What can you help me with?"}])
        return interactive(make_decoder(args, model, tokenizer.stop_ids, context, probe), context, tokenizer, args)

    text = args.prompt_file.read_text() if args.prompt_file else (args.prompt or "Hello, my name is")
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    else:
        prompt_ids = tokenizer.encode(text)
    needed = len(prompt_ids) + args.max_new_tokens
    if needed > model.config.block_size:
        sys.exit(f"error: the prompt has {len(prompt_ids)} tokens; with --max_new_tokens {args.max_new_tokens} "
                 f"that is {needed}, more than the model's context of {model.config.block_size} tokens")
    try:
        decode = make_decoder(args, model, tokenizer.stop_ids, needed, prompt_ids)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")

    bytes_per_token = model_bytes_per_token(model)
    samples, per_round = [], []
    # With --compile the first run compiles; it is a warm-up and not reported.
    for i in range(-1 if args.compile else 0, args.num_samples):
        device_sync(device)
        t = time.perf_counter()
        ids, rounds = decode(prompt_ids, args.max_new_tokens)
        device_sync(device)
        seconds = time.perf_counter() - t
        if i < 0:
            print(f"Compilation and warm-up: {seconds:.2f} s", file=sys.stderr)
            continue
        tok_s = len(ids) / seconds
        samples.append({"token_ids": ids, "text": tokenizer.decode(_strip_stop(ids, tokenizer.stop_ids)),
                        "new_tokens": len(ids), "tokens_per_s": tok_s})
        print(samples[-1]["text"], flush=True)
        line = f"\nSample {i}: {len(ids)} tokens in {seconds:.2f} s, {tok_s:.2f} tok/s"
        if rounds is not None:
            per_round += rounds
            samples[-1].update(rounds=len(rounds), mean_accepted=sum(rounds) / len(rounds))
            line += f", {len(rounds)} rounds, {sum(rounds) / len(rounds):.2f} tokens per round"
        else:
            line += f", {bytes_per_token * tok_s / 1e9:.2f} GB/s"
        print(line, file=sys.stderr)

    mean_tok_s = sum(s["tokens_per_s"] for s in samples) / len(samples)
    report = {"checkpoint": str(args.checkpoint_path), "prompt_ids": prompt_ids, "samples": samples,
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
              "dtype": args.dtype, "compiled": args.compile, "speculate": args.speculate, "attention": args.attention,
              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "tokens_per_s": mean_tok_s}
    print(f"Average tokens/s: {mean_tok_s:.2f}", file=sys.stderr)
    if per_round:
        # tau: tokens per target forward (each round is one verify forward), bonus token included
        report.update(mean_accepted=sum(per_round) / len(per_round), rounds=len(per_round),
                      accepted_histogram={n: per_round.count(n) for n in range(1, max(per_round) + 1)})
        print(f"Mean accepted tokens per round (tau): {report['mean_accepted']:.2f} over {len(per_round)} rounds",
              file=sys.stderr)
    else:
        report["bandwidth_gb_s"] = bytes_per_token * mean_tok_s / 1e9
        print(f"Bandwidth achieved: {report['bandwidth_gb_s']:.2f} GB/s "
              f"(model weights read per token: {bytes_per_token / 1e9:.3f} GB)", file=sys.stderr)
    print(f"Memory used: {peak_memory_gb(device):.2f} GB", file=sys.stderr)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=1))


def _strip_stop(ids, stop_ids):
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def interactive(decode, context: int, tokenizer, args):
    """Streamed multi-turn chat; the whole conversation is re-encoded and prefilled every turn."""
    messages = []
    print(f"Chat with the model (up to {context} tokens of context). An empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("\nYou: ").strip()
        except EOFError:
            return
        if not user:
            return
        messages.append({"role": "user", "content": user})
        prompt_ids = tokenizer.apply_chat_template(messages)
        if len(prompt_ids) >= context:
            print("(the conversation no longer fits in the context; starting over)", file=sys.stderr)
            messages = messages[-1:]
            prompt_ids = tokenizer.apply_chat_template(messages)
            if len(prompt_ids) >= context:
                print("(that message alone is too long)", file=sys.stderr)
                messages = []
                continue
        print("Assistant: ", end="", flush=True)
        streamer = TextStreamer(tokenizer)
        t = time.perf_counter()
        ids, _ = decode(prompt_ids, min(args.max_new_tokens, context - len(prompt_ids)),
                        callback=lambda tok: streamer.put(int(tok[0])))
        print(f"\n[{len(ids)} tokens, {len(ids) / (time.perf_counter() - t):.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": tokenizer.decode(_strip_stop(ids, tokenizer.stop_ids))})


class TextStreamer:
    """Prints text as tokens arrive. Byte-level BPE can split one character over several tokens,
    so re-decode everything and print only the new, complete part."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def put(self, token: int):
        if token in self.tokenizer.stop_ids:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)


if __name__ == "__main__":
    main()
