"""What --batch_invariant costs on this CPU: a plain decode step and a speculative round of the target
without the mode and in it, in one process (two copies of the weights), timed in alternating turns so
that drift on the machine hits both. defaults.py turns the mode on where both costs stay small
(benchmarks/RESULTS.md, "Batch-invariant cost").

    python research/invariant_cost.py --compile --dtype bfloat16 --out /tmp/invariant_cost-cpu-bf16

The round is Speculator.round (one graph with --compile, as generate.py compiles it) with the default
compiled CPU tree unless the tree flags say otherwise, on four chat prompts. Writes
OUT.json and OUT.md (default OUT: benchmarks/invariant_cost-MODEL-cpu-DTYPE).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "research")]

import compiling  # noqa: E402
import defaults  # noqa: E402
import generate as gen  # noqa: E402
import invariant  # noqa: E402
import packages  # noqa: E402
import speculative  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from common import run_header, write_report  # noqa: E402
from cpu import pack_linears  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a short story about a lighthouse keeper.",
           "What are the pros and cons of electric cars?", "How do I make a good cup of tea?"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth",
                   help="model.pth, or a quantized model_int8.pth / model_int4.gNN.pth")
    p.add_argument("--draft_checkpoint_path", type=Path, help="default: eagle3/ beside the checkpoint")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--compile", action="store_true")
    for name, default in zip(("top_k", "depth", "tokens"), defaults.row("cpu", True).tree):  # the compiled CPU tree
        p.add_argument(f"--tree_{name}", type=int, default=default)
    p.add_argument("--context", type=int, default=512, help="cache slots (the mode needs at least 512)")
    p.add_argument("--steps", type=int, default=20, help="decode steps a turn")
    p.add_argument("--rounds", type=int, default=16, help="rounds a turn")
    p.add_argument("--turns", type=int, default=6, help="turns of (steps, rounds) for each target, alternating")
    p.add_argument("--out", type=Path, help="output path without suffix")
    args = p.parse_args(argv)
    args.draft_checkpoint_path = args.draft_checkpoint_path or args.checkpoint_path.parent / "eagle3"
    args.out = args.out or ROOT / "benchmarks" / f"invariant_cost-{args.checkpoint_path.parent.name}-cpu-{args.dtype}"
    return args


def make_target(args, batch_invariant: bool):
    """One copy of the target and head, its step and its round, as generate.py runs them on a CPU
    (compiled: from packages where they serve; or eager with the linears packed for oneDNN)."""
    model = load_model(args.checkpoint_path, "cpu", getattr(torch, args.dtype))
    if batch_invariant:
        invariant.enable(model)
    draft = load_draft(args.draft_checkpoint_path, model.config, "cpu", getattr(torch, args.dtype),
                       arch=gen.SPECULATE["eagle3"]["arch"])
    if not args.compile:
        pack_linears(model)
        pack_linears(draft)
    spec = speculative.Speculator(model, draft, tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                                  tree_tokens=args.tree_tokens, stop_ids=())  # no stop: rounds keep coming
    spec.setup(1, args.context)
    if args.compile and packages.usable("cpu", 0.0, spec):  # as generate.py: packages where they serve
        step = packages.packaged_step(model, packages.folder(args.checkpoint_path))
        round_fn = packages.package_round(spec, packages.folder(args.checkpoint_path)).round
    elif args.compile:
        step = compiling.compile_step(gen.decode_one_token, "cpu", model)
        round_fn = compiling.compile_function(spec.round, "cpu", (model, draft), options=compiling.ROUND_OPTIONS)
    else:
        step, round_fn = gen.decode_one_token, spec.round
    return dict(model=model, step=step, spec=spec, round=round_fn, ms=dict(step=[], round=[]))


def prompt_ids(tokenizer, i):
    return torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])])


def step_seconds(model, step, prompt, n: int) -> list:
    """The seconds of each of n plain decode steps (`step`: decode_one_token's signature) after prompt."""
    token = gen.prefill(model, prompt, 0.0, None, None)
    pos = torch.tensor([prompt.size(1)])
    seconds = []
    for _ in range(n):
        t = time.perf_counter()
        token = step(model, token.clone(), pos, 0.0, None, None)
        seconds.append(time.perf_counter() - t)
        pos += 1
    return seconds


def rounds_from(spec, tokenizer, n, round_fn):
    """The seconds of each of n rounds, from a fresh prompt every 16 (the cache never fills)."""
    seconds = []
    for i in range(n):
        if i % 16 == 0:
            spec.prefill(prompt_ids(tokenizer, i // 16), 16 * (spec.depth + 1))
        t = time.perf_counter()
        round_fn()
        seconds.append(time.perf_counter() - t)
    return seconds


@torch.no_grad()
def turn(target, tokenizer, args, warm_up=False):
    """args.steps decode steps after a prefill, then args.rounds rounds; their medians (ms) go to target["ms"]."""
    steps = step_seconds(target["model"], target["step"], prompt_ids(tokenizer, 0), 3 if warm_up else args.steps)
    rounds = rounds_from(target["spec"], tokenizer, 3 if warm_up else args.rounds, target["round"])
    if not warm_up:
        target["ms"]["step"].append(statistics.median(steps) * 1e3)
        target["ms"]["round"].append(statistics.median(rounds) * 1e3)


def main(argv=None):
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    targets, compile_s = {}, {}
    for name, batch_invariant in (("plain", False), ("batch-invariant", True)):
        t = time.perf_counter()
        targets[name] = make_target(args, batch_invariant)
        turn(targets[name], tokenizer, args, warm_up=True)  # compiles the step and the round
        compile_s[name] = time.perf_counter() - t
    for n in range(args.turns):
        # Each turn in the other order: the copy that runs second can run slower (caches, clocks), and a
        # fixed order would charge that to one of them.
        order = list(targets.values())
        for target in order if n % 2 == 0 else order[::-1]:
            turn(target, tokenizer, args)
    ms = {name: {what: statistics.median(values) for what, values in t["ms"].items()} for name, t in targets.items()}
    report = dict(run_header("invariant_cost.py", argv), dtype=args.dtype, compile=args.compile,
                  checkpoint=args.checkpoint_path.name,
                  tree=dict(top_k=args.tree_top_k, depth=args.tree_depth, tokens=args.tree_tokens), ms=ms,
                  compile_s=compile_s, turn_medians_ms={name: t["ms"] for name, t in targets.items()},
                  cost={what: ms["batch-invariant"][what] / ms["plain"][what] - 1 for what in ("step", "round")})
    write_report(args.out, report, *markdown(report))
    return report


def markdown(report) -> tuple:
    """The report's title and lines."""
    ms, cost, tree = report["ms"], report["cost"], report["tree"]
    title = f"--batch_invariant's cost, {report['checkpoint']}, {report['dtype']}, " + (
        "compiled" if report["compile"] else "eager")
    return title, [
        f"- round: eagle3, tree top-k {tree['top_k']}, depth {tree['depth']}, {tree['tokens']} tokens", "",
        "| ms (medians of per-turn medians) | plain target | batch-invariant target | cost |",
        "|---|---|---|---|",
        *(f"| {label} | {ms['plain'][what]:.2f} | {ms['batch-invariant'][what]:.2f} | {100 * cost[what]:+.1f} % |"
          for label, what in (("decode step", "step"), ("round", "round"))),
        f"| compiling and warming up, s | {report['compile_s']['plain']:.0f} | "
        f"{report['compile_s']['batch-invariant']:.0f} | |", "",
        "Per-turn medians, ms (the spread the medians above come from): " + "; ".join(
            f"{what} {name} {min(t[what]):.2f}-{max(t[what]):.2f}" for what in ("step", "round")
            for name, t in report["turn_medians_ms"].items()) + "."]


if __name__ == "__main__":
    main()
