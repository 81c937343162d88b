"""What --batch_invariant costs on this machine: a plain decode step and a speculative round of the
target without the mode and in it, side by side in one process (two copies of the weights), timed
in turns so that a machine that drifts drifts for both. defaults.py turns the mode on where both
costs are at most 10 % (benchmarks/RESULTS.md, "Batch-invariant cost"); this is how they are measured.

    python research/invariant_cost.py --compile --dtype bfloat16 --out /tmp/invariant_cost-cpu-bf16

The round is speculative.Speculator.round (one graph when --compile, as generate.py compiles it)
with defaults.py's compiled CPU tree for this machine unless the tree flags say otherwise; every
round starts from the state the previous one left, restarting from a chat prompt every 16 rounds
(profile_round.rounds_from). Eager runs are timed too (the mode is not row-invariant in eager
float32, but its cost can be timed). Writes OUT.json and OUT.md.
"""
import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "research")]

import compiling  # noqa: E402
import defaults  # noqa: E402
import generate as gen  # noqa: E402
import invariant  # noqa: E402
import speculative  # noqa: E402
from autoshape import cpu_name  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from cpu import pack_linears  # noqa: E402
from profile_round import prompt_ids, rounds_from  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth",
                   help="model.pth, or a quantized model_int8.pth / model_int4.gNN.pth")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None, help="default: eagle3/ beside the checkpoint")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--tree_top_k", type=int, default=None)
    p.add_argument("--tree_depth", type=int, default=None)
    p.add_argument("--tree_tokens", type=int, default=None)
    p.add_argument("--context", type=int, default=512, help="slots of the caches (the mode needs at least 512)")
    p.add_argument("--steps", type=int, default=20, help="decode steps a turn")
    p.add_argument("--rounds", type=int, default=16, help="rounds a turn")
    p.add_argument("--turns", type=int, default=6, help="turns of (steps, rounds) for each target, alternating")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = p.parse_args(argv)
    tree = defaults.row("cpu", True).tree
    for name, value in zip(("tree_top_k", "tree_depth", "tree_tokens"), tree):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.draft_checkpoint_path = args.draft_checkpoint_path or args.checkpoint_path.parent / "eagle3"
    return args


def make_target(args, batch_invariant: bool):
    """One copy of the target and head, its step and its round, compiled as generate.py compiles them."""
    dtype = getattr(torch, args.dtype)
    model = load_model(args.checkpoint_path, "cpu", dtype)
    if batch_invariant:
        invariant.enable(model)
    draft = load_draft(args.draft_checkpoint_path, model.config, "cpu", dtype)
    if not args.compile:  # eager, as generate.py runs it
        pack_linears(model)
        pack_linears(draft)
    model.setup_caches(1, args.context)
    step = compiling.compile_step(gen.decode_one_token, "cpu", model) if args.compile else gen.decode_one_token
    spec = speculative.Speculator(model, draft, tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                                  tree_tokens=args.tree_tokens, stop_ids=())  # no stop: rounds keep coming
    spec.setup(1, args.context)
    round_fn = spec.round
    if args.compile:
        round_fn = compiling.compile_function(spec.round, "cpu", (model, draft), options=compiling.ROUND_OPTIONS)
    return dict(model=model, step=step, spec=spec, round=round_fn, step_s=[], round_s=[])


@torch.no_grad()
def turn(target, tokenizer, args, warm_up=False):
    """args.steps decode steps after a prefill, then args.rounds rounds (profile_round's: the same
    chat prompts); the medians go to the target's lists."""
    model, step = target["model"], target["step"]
    prompt = prompt_ids(tokenizer, 0)
    token = gen.prefill(model, prompt, 0.0, None, None)
    pos = torch.tensor([prompt.size(1)])
    seconds = []
    for _ in range(3 if warm_up else args.steps):
        t = time.perf_counter()
        token = step(model, token.clone(), pos, 0.0, None, None)
        seconds.append(time.perf_counter() - t)
        pos += 1
    rounds = rounds_from(target["spec"], tokenizer, 3 if warm_up else args.rounds, target["round"])
    if not warm_up:
        target["step_s"].append(statistics.median(seconds))
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
        # Each turn in the other order: whichever copy runs second after the other's rounds can
        # run slower (caches, clocks), and a fixed order would charge that to one of them.
        order = list(targets.values())
        for target in order if n % 2 == 0 else order[::-1]:
            turn(target, tokenizer, args)
    ms = {name: dict(step=statistics.median(t["step_s"]) * 1e3, round=statistics.median(t["round_s"]) * 1e3)
          for name, t in targets.items()}
    report = dict(command="python research/invariant_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), hardware=cpu_name(),
                  torch=torch.__version__, threads=torch.get_num_threads(), dtype=args.dtype, compile=args.compile,
                  checkpoint=args.checkpoint_path.name, tree=dict(top_k=args.tree_top_k, depth=args.tree_depth,
                                                                   tokens=args.tree_tokens),
                  ms=ms, compile_s=compile_s,
                  turn_medians_ms={name: dict(step=[x * 1e3 for x in t["step_s"]], round=[x * 1e3 for x in t["round_s"]])
                                   for name, t in targets.items()},
                  cost=dict(step=ms["batch-invariant"]["step"] / ms["plain"]["step"] - 1,
                            round=ms["batch-invariant"]["round"] / ms["plain"]["round"] - 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(args.out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(str(args.out) + ".md").write_text(markdown(report))
    print(markdown(report))
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
