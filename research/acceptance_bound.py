"""The most tokens a round could accept at a temperature, whatever the draft: the τ of a perfect draft,
a ceiling for a head's measured τ.

    python research/acceptance_bound.py --num_questions 16 --max_new_tokens 128 --temperature 1 --stride 16 \\
        --out /tmp/acceptance_bound-t1

At T > 0 speculative.accept's walk emits exactly a sample of the target, so a round with tree S accepts
the longest prefix of the target's own continuation that S holds; its expected length is the sum over
S's nodes of the probability of the node's path. A path is never more probable than its prefix, so the
best n-node tree holds the n most probable paths, and

    τ_max(n) = 1 + the sum of the n - 1 largest path probabilities below the root

(the root, the last round's token, is one of the n verified tokens; the 1 is the bonus token). No draft
reaches more with n-token trees on that context; --top_k/--max_depth give the bound for EAGLE-2's
restricted trees, and --head the τ of a head's tree of that shape, by the same exact sum (no sampling
noise, so heads and settings compare directly).

Contexts: vanilla's sampled answers to MT-bench's turns, asked as scripts/benchmark.py asks them, cut
after every --stride-th answer token. These average over positions; a measured τ averages over rounds,
which are denser where guesses fail, so it sits below the same head's average here. Compare heads on
these bounds, on the same contexts. Writes OUT.json and OUT.md.
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "research")]

import generate as gen  # noqa: E402
from benchmark import DEFAULT_QUESTIONS, conversation, load_questions  # noqa: E402  (MT-bench as benchmark.py asks it)
from checkpoint import load_draft, load_model  # noqa: E402
from profile_round import run_header, write_report  # noqa: E402
from model import Transformer, TreeMask  # noqa: E402
from sampling import logits_to_probs  # noqa: E402
from speculative import Speculator  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from trees import tree_structure  # noqa: E402


@torch.no_grad()
def best_paths(model: Transformer, context: list, n: int, temperature: float, top_k: Optional[int] = None,
               max_depth: Optional[int] = None) -> list:
    """The n most probable continuations of context (token ids, root last) under the target at
    temperature, each with at most max_depth tokens and each token among its parent's top_k:
    [(path probability, path tuple)], most probable first.

    Found by expanding nodes in passes. Known paths: the children (the n most probable of the top_k)
    of every expanded node, the root expanded first. Each later pass takes S, the n most probable known
    paths, and expands those of S not yet expanded, all in one forward (a tree mask: each node sees
    the context and its ancestors). When every node of S is expanded, S is the answer: a path u
    that is not known has a deepest known ancestor a; if a is expanded, u descends from a child
    that n known children of a outrank; if not, a is outside S, so all n of S outrank a and its
    descendants. A pass reaches one level deeper, so the passes number about the deepest path's
    depth."""
    device = model.norm.weight.device
    prefix = len(context) - 1  # the root, context[-1], is verified in the tree, as in a round
    # A pass's tree is the root and at most n nodes of S (S is prefix-closed): these slots fit every
    # pass, so the cache (and the prefix in it) is never reallocated.
    model.setup_caches(1, prefix + n + 1)
    if prefix:
        model(torch.tensor([context[:-1]], device=device), torch.arange(prefix, device=device))
    children = {}  # expanded path -> [(p, token)]
    known = {(): 1.0}  # path -> its probability
    new = [()]
    while True:
        for path, row in zip(new, _tree_forward(model, context, new)):
            children[path] = _top(row, temperature, top_k, n)
            known.update((path + (token,), known[path] * p) for p, token in children[path])
        # Most probable first; a parent before a child of equal probability (shorter first).
        best = sorted((path for path in known if path), key=lambda path: (-known[path], len(path)))[:n]
        new = [path for path in best if path not in children and (max_depth is None or len(path) < max_depth)]
        if not new:
            return [(known[path], path) for path in best]


def _top(logits: torch.Tensor, temperature: float, top_k: Optional[int], n: int) -> list:
    """A node's children worth keeping: its n most probable tokens (of its top_k) as (p, token)."""
    probs = logits_to_probs(logits, temperature)
    values, tokens = probs.topk(min(n, top_k or n, probs.numel()))
    return list(zip(values.tolist(), tokens.tolist()))


def _tree_forward(model: Transformer, context: list, paths: list) -> torch.Tensor:
    """The target's logits after each path [len(paths), V] (the empty path: after the root), in one
    forward over the root and the paths' nodes, as Speculator.verify runs a round's tree: context[:-1]
    is in the cache's first slots, the tree in its last ones under a TreeMask."""
    device = model.norm.weight.device
    nodes = [()] + sorted({path[:d] for path in paths for d in range(1, len(path) + 1)}, key=len)
    index = {node: i for i, node in enumerate(nodes)}
    parents = torch.tensor([[-1] + [index[node[:-1]] for node in nodes[1:]]], device=device)
    depth, ancestors, _ = tree_structure(parents, max(len(node) for node in nodes))
    tokens = torch.tensor([[context[-1]] + [node[-1] for node in nodes[1:]]], device=device)
    prefix, T = len(context) - 1, len(nodes)
    logits = model(tokens, prefix + depth, model.max_seq_length - T + torch.arange(T, device=device)[None],
                   TreeMask(torch.tensor([prefix], device=device), ancestors))
    return logits[0, [index[path] for path in paths]]


@torch.no_grad()
def head_tree_tau(spec: Speculator, context: list) -> float:
    """The τ a round of spec (its draft and tree shape) has on average at context (root last), at
    spec's temperature: 1 + the sum over its tree's nodes below the root of the target's
    probability of the node's path (the same argument as for the bound; at T=0 the probability
    is 1 on the greedy path, so this is the number of guesses the round accepts, plus 1). Exact
    for this tree: no sampling noise, unlike a measured τ."""
    device = spec.target.norm.weight.device
    spec.prefill(torch.tensor([context[:-1]], device=device), spec.depth + 1,
                 root=torch.tensor([context[-1]], device=device))
    tree = spec.grow(spec.catch_up())
    logits, _ = spec.verify(tree)
    temperature, top_k, top_p = spec.sampling
    if temperature == 0:
        p = torch.nn.functional.one_hot(logits[0].argmax(-1), logits.size(-1)).float()
    else:
        p = logits_to_probs(logits[0], temperature, top_k, top_p)  # [N, V]: after each node
    edge = p[tree.parents[0].clamp(min=0), tree.tokens[0]]  # each node's probability given its parent
    edge[0] = 1.0  # the root was already emitted
    paths = tree.paths[0]
    path_prob = torch.where(paths >= 0, edge[paths.clamp(min=0)], 1.0).prod(-1)
    return 1.0 + path_prob[1:].sum().item()


def tau_bounds(probs: list, sizes) -> dict:
    """τ_max for each tree size n (tokens verified, the root included) from the path
    probabilities, most probable first."""
    return {n: 1.0 + sum(probs[:n - 1]) for n in sizes}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--question_file", type=Path, default=DEFAULT_QUESTIONS)
    p.add_argument("--num_questions", type=int, default=16, help="taken in turn from each category, as benchmark.py")
    p.add_argument("--max_new_tokens", type=int, default=128, help="per answer")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--stride", type=int, default=8, help="a context after every stride-th answer token")
    p.add_argument("--sizes", nargs="+", type=int, default=[16, 60, 128], help="tree tokens, the root included")
    p.add_argument("--restricted_tokens", type=int, default=60, help="the restricted bound's tree tokens")
    p.add_argument("--top_k", type=int, default=10, help="the restricted bound: children a node")
    p.add_argument("--max_depth", type=int, default=8, help="the restricted bound: levels below the root")
    p.add_argument("--head", type=Path, help="a draft head: also the mean τ of its trees (the restricted shape)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    if args.temperature <= 0:
        p.error("--temperature must be > 0: at T=0 a perfect draft accepts every guess (no bound to compute)")
    if args.stride < 1 or args.max_new_tokens < 1 or min(args.sizes + [args.restricted_tokens]) < 2:
        p.error("--stride and --max_new_tokens must be >= 1, --sizes and --restricted_tokens >= 2")
    if args.top_k < 1 or args.max_depth < 1:
        p.error("--top_k and --max_depth must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = load_model(args.checkpoint_path, "cpu", torch.float32)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    questions = load_questions(args.question_file, args.num_questions)
    sizes, restricted_size = sorted(args.sizes), args.restricted_tokens
    spec = None
    if args.head is not None:  # its tree has the restricted bound's shape; refused before minutes of decoding
        try:
            spec = Speculator(model, load_draft(args.head, model.config), tree_top_k=args.top_k,
                              tree_depth=args.max_depth, tree_tokens=restricted_size, temperature=args.temperature)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"acceptance_bound.py: --head: {e}")
    start = time.perf_counter()
    contexts = sampled_contexts(model, tokenizer, questions, args.max_new_tokens, args.temperature, args.stride)
    rows = []
    for c in tqdm(contexts, desc="contexts", file=sys.stderr):
        free = [p for p, _ in best_paths(model, c["ids"], max(sizes) - 1, args.temperature)]
        held = [p for p, _ in best_paths(model, c["ids"], restricted_size - 1, args.temperature, args.top_k,
                                         args.max_depth)]
        rows.append(dict(category=c["category"], free=tau_bounds(free, sizes),
                         restricted=tau_bounds(held, [restricted_size])[restricted_size], first_guess=free[0]))
        if spec is not None:
            rows[-1]["head"] = head_tree_tau(spec, c["ids"])
    report = summarise(args, argv, rows, sizes, restricted_size, time.perf_counter() - start)
    write_report(args.out, report, markdown(report))


def sampled_contexts(model: Transformer, tokenizer, questions: list, max_new_tokens: int, temperature: float,
                     stride: int) -> list:
    """[dict(category, ids)]: vanilla's answers at temperature to each question's turns, asked as
    benchmark.py asks them, cut after every stride-th answer token."""
    contexts = []
    for q in questions:
        answers = []
        for turn in range(len(q["turns"])):
            prompt = conversation(tokenizer, q, turn, answers)
            answer = gen.generate(model, torch.tensor([prompt]), max_new_tokens, temperature=temperature,
                                  stop_ids=tokenizer.stop_ids)[0]
            answers.append(tokenizer.decode([t for t in answer if t not in tokenizer.stop_ids]))
            # A round's root is an emitted token that is not a stop token (after one, decoding ends).
            for j in range(0, len(answer), stride):
                if answer[j] not in tokenizer.stop_ids:
                    contexts.append(dict(category=q["category"], ids=prompt + answer[:j + 1]))
    return contexts


def summarise(args, argv, rows, sizes, restricted_size, seconds) -> dict:
    def mean(key, mine):
        return sum(key(r) for r in mine) / len(mine)

    restricted = f"tau_max_{restricted_size}_top{args.top_k}_depth{args.max_depth}"
    by_category = {}
    for cat in ["overall", *sorted({r["category"] for r in rows})]:
        mine = [r for r in rows if cat == "overall" or r["category"] == cat]
        by_category[cat] = {"contexts": len(mine)}
        for n in sizes:
            by_category[cat][f"tau_max_{n}"] = mean(lambda r: r["free"][n], mine)
        by_category[cat][restricted] = mean(lambda r: r["restricted"], mine)
        if "head" in rows[0]:
            by_category[cat]["head_" + restricted.removeprefix("tau_max_")] = mean(lambda r: r["head"], mine)
        by_category[cat]["first_guess_accepted"] = mean(lambda r: r["first_guess"], mine)
    return dict(
        run_header("acceptance_bound.py", argv),
        checkpoint=str(args.checkpoint_path), head=None if args.head is None else str(args.head),
        temperature=args.temperature, num_questions=args.num_questions,
        max_new_tokens=args.max_new_tokens, stride=args.stride, seed=args.seed, seconds=round(seconds, 1),
        by_category=by_category)


def markdown(report: dict) -> str:
    columns = [k for k in report["by_category"]["overall"] if k != "contexts"]
    lines = [f"# The τ of a perfect draft, T={report['temperature']:g}", "",
             f"{report['hardware']}, torch {report['torch']}, {report['date']}; {report['num_questions']} MT-bench "
             f"questions, both turns, {report['max_new_tokens']} tokens, a context every {report['stride']} answer "
             f"tokens, seed {report['seed']}.", "", f"    {report['command']}", "",
             "| category | contexts | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for cat, r in report["by_category"].items():
        lines.append(f"| {cat} | {r['contexts']} | " + " | ".join(f"{r[c]:.2f}" for c in columns) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
