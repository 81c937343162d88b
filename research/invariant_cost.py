"""What --batch_invariant costs on this CPU: a plain decode step and a speculative round of the target
without the mode and in it, in one process (two copies of the weights), timed in alternating turns so
that drift on the machine hits both. defaults.py turns the mode on where both costs stay small
(benchmarks/RESULTS.md, "Batch-invariant cost"); this is how they are measured.

    python research/invariant_cost.py --compile --dtype bfloat16 --out /tmp/invariant_cost-cpu-bf16

The round is Speculator.round (one graph with --compile, as generate.py compiles it) with the default
compiled CPU tree unless the tree flags say otherwise, on profile_round.py's chat prompts. Eager runs
are timed too. Writes OUT.json and OUT.md (default OUT: benchmarks/invariant_cost-MODEL-cpu-DTYPE).
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
from profile_round import (load_pair, make_speculator, prompt_ids, rounds_from, run_header, step_seconds,  # noqa: E402
                           write_report)
from tokenizer import load_tokenizer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth",
                   help="model.pth, or a quantized model_int8.pth / model_int4.gNN.pth")
    p.add_argument("--draft_checkpoint_path", type=Path, help="default: eagle3/ beside the checkpoint")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--compile", action="store_true")
    top_k, depth, tokens = defaults.row("cpu", True).tree
    p.add_argument("--tree_top_k", type=int, default=top_k)
    p.add_argument("--tree_depth", type=int, default=depth)
    p.add_argument("--tree_tokens", type=int, default=tokens)
    p.add_argument("--context", type=int, default=512, help="cache slots (the mode needs at least 512)")
    p.add_argument("--steps", type=int, default=20, help="decode steps a turn")
    p.add_argument("--rounds", type=int, default=16, help="rounds a turn")
    p.add_argument("--turns", type=int, default=6, help="turns of (steps, rounds) for each target, alternating")
    p.add_argument("--out", type=Path, help="output path without suffix")
    args = p.parse_args(argv)
    args.draft_checkpoint_path = args.draft_checkpoint_path or args.checkpoint_path.parent / "eagle3"
    model = args.checkpoint_path.parent.name
    args.out = args.out or ROOT / "benchmarks" / f"invariant_cost-{model}-cpu-{args.dtype}"
    return args


def make_target(args, batch_invariant: bool):
    """One copy of the target and head, its step and its round, compiled as generate.py compiles them."""
    model, draft = load_pair(args, args.dtype, batch_invariant)
    model.setup_caches(1, args.context)
    step = compiling.compile_step(gen.decode_one_token, "cpu", model) if args.compile else gen.decode_one_token
    spec = make_speculator(args, model, draft)
    round_fn = spec.round
    if args.compile:
        round_fn = compiling.compile_function(spec.round, "cpu", (model, draft), options=compiling.ROUND_OPTIONS)
    return dict(model=model, step=step, spec=spec, round=round_fn, step_s=[], round_s=[])


@torch.no_grad()
def turn(target, tokenizer, args, warm_up=False):
    """args.steps decode steps after a prefill, then args.rounds rounds; their medians go to the target's lists."""
    steps = step_seconds(target["model"], target["step"], prompt_ids(tokenizer, 0), 3 if warm_up else args.steps)
    rounds = rounds_from(target["spec"], tokenizer, 3 if warm_up else args.rounds, target["round"])
    if not warm_up:
        target["step_s"].append(statistics.median(steps))
        target["round_s"].append(statistics.median(rounds))


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
    ms = {name: dict(step=statistics.median(t["step_s"]) * 1e3, round=statistics.median(t["round_s"]) * 1e3)
          for name, t in targets.items()}
    report = dict(run_header("invariant_cost.py", argv), dtype=args.dtype, compile=args.compile,
                  checkpoint=args.checkpoint_path.name,
                  tree=dict(top_k=args.tree_top_k, depth=args.tree_depth, tokens=args.tree_tokens),
                  ms=ms, compile_s=compile_s,
                  turn_medians_ms={name: dict(step=[x * 1e3 for x in t["step_s"]], round=[x * 1e3 for x in t["round_s"]])
                                   for name, t in targets.items()},
                  cost=dict(step=ms["batch-invariant"]["step"] / ms["plain"]["step"] - 1,
                            round=ms["batch-invariant"]["round"] / ms["plain"]["round"] - 1))
    write_report(args.out, report, markdown(report))
    return report


def markdown(report) -> str:
    ms, cost, tree = report["ms"], report["cost"], report["tree"]
    return "\n".join([
        f"# --batch_invariant's cost, {report['checkpoint']}, {report['dtype']}, "
        f"{'compiled' if report['compile'] else 'eager'} ({report['threads']} threads, torch {report['torch']})", "",
        f"- command: `{report['command']}`",
        f"- hardware: {report['hardware']}; date {report['date']}",
        f"- round: eagle3, tree top-k {tree['top_k']}, depth {tree['depth']}, {tree['tokens']} tokens", "",
        "| ms (medians of per-turn medians) | plain target | batch-invariant target | cost |",
        "|---|---|---|---|",
        f"| decode step | {ms['plain']['step']:.2f} | {ms['batch-invariant']['step']:.2f} | {100 * cost['step']:+.1f} % |",
        f"| round | {ms['plain']['round']:.2f} | {ms['batch-invariant']['round']:.2f} | {100 * cost['round']:+.1f} % |",
        f"| compiling and warming up, s | {report['compile_s']['plain']:.0f} | "
        f"{report['compile_s']['batch-invariant']:.0f} | |", "",
        "Per-turn medians, ms (the spread the medians above come from): " + "; ".join(
            f"{what} {name} {min(t[what]):.2f}-{max(t[what]):.2f}" for what in ("step", "round")
            for name, t in report["turn_medians_ms"].items()) + ".", ""])


if __name__ == "__main__":
    main()
