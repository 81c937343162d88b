"""Where a speculative round's time goes: catch-up, each tree level (draft forward and LM head),
verify, accept, compaction, bookkeeping and the Python between them, beside one plain decode step.

    python research/profile_round.py --speculate eagle3 --dtype bfloat16 --tree_tokens 16 --out /tmp/profile_round

Eager: torch.profiler over --rounds rounds, each phase labelled with record_function (a label's "self"
time is what no operator inside it accounts for: Python and dispatch). --compile: the whole round as one
graph against the compiled plain step, and each phase compiled and timed on its own. Rounds decode real
chat prompts, each from the state the previous one left. Writes OUT.json and OUT.md. The helpers below
are shared with the other research tools.
"""
import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import compiling  # noqa: E402
import defaults  # noqa: E402
import generate as gen  # noqa: E402
import invariant  # noqa: E402
import speculative  # noqa: E402
from autoshape import cpu_name  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from cpu import pack_linears  # noqa: E402
from quantize import mode_from_path  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a short story about a lighthouse keeper.",
           "What are the pros and cons of electric cars?", "How do I make a good cup of tea?"]
PHASES = ("catch_up", "grow", "verify", "accept", "compact", "advance")
DEPTH = {"eagle2": 6, "eagle3": defaults.EAGLE3_DEPTH}  # the papers' tree depths


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--draft_checkpoint_path", type=Path, help="default: eagle/ or eagle3/ beside the checkpoint")
    p.add_argument("--speculate", choices=sorted(DEPTH), default="eagle3")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--draft_dtype", choices=["float32", "bfloat16"], help="eagle3: the head's dtype (default: --dtype)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch_invariant", action="store_true", help="the target in batch-invariant mode")
    p.add_argument("--tree_top_k", type=int, default=10)
    p.add_argument("--tree_depth", type=int, help="default: 6 for eagle2, 8 for eagle3")
    p.add_argument("--tree_tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--context", type=int, default=512, help="cache slots (compiled attention reads all of them)")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = p.parse_args(argv)
    if args.draft_dtype is not None and args.speculate != "eagle3":
        p.error("--draft_dtype sets the dtype of an EAGLE-3 head; EAGLE-1/2 heads use the target's LM head")
    folder = gen.SPECULATE[args.speculate]["folder"]
    args.draft_checkpoint_path = args.draft_checkpoint_path or args.checkpoint_path.parent / folder
    args.tree_depth = args.tree_depth or DEPTH[args.speculate]
    if args.batch_invariant:
        problem = invariant.problem("cpu", args.dtype, args.compile, mode_from_path(args.checkpoint_path)[0], False)
        if problem:
            p.error(problem)
    return args


def run_header(script: str, argv) -> dict:
    """What every research report starts with: the command, when, and on what."""
    return dict(command=f"python research/{script} " + shlex.join(sys.argv[1:] if argv is None else argv),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"), hardware=cpu_name(),
                torch=torch.__version__, threads=torch.get_num_threads())


def write_report(out: Path, report: dict, markdown: str):
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(str(out) + ".md").write_text(markdown)
    print(markdown)


def load_pair(args, draft_dtype, batch_invariant: bool, speculate: str = "eagle3") -> tuple:
    """The target and the head that `speculate` runs on the CPU in args.dtype, as generate.py runs them
    (eager: packed for oneDNN)."""
    model = load_model(args.checkpoint_path, "cpu", getattr(torch, args.dtype))
    if batch_invariant:
        invariant.enable(model)
    draft = load_draft(args.draft_checkpoint_path, model.config, "cpu", getattr(torch, draft_dtype),
                       arch=gen.SPECULATE[speculate]["arch"])
    if not args.compile:
        pack_linears(model)
        pack_linears(draft)
    return model, draft


def make_speculator(args, model, draft):
    spec = speculative.Speculator(model, draft, tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                                  tree_tokens=args.tree_tokens, stop_ids=())  # no stop: rounds keep coming
    spec.setup(1, args.context)
    return spec


def prompt_ids(tokenizer, i):
    return torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])])


def rounds_from(spec, tokenizer, n, round_fn, before=None):
    """The seconds of each of n rounds, from a fresh prompt every 16 (the cache never fills); before()
    runs before each round."""
    seconds = []
    for i in range(n):
        if i % 16 == 0:
            spec.prefill(prompt_ids(tokenizer, i // 16), 16 * (spec.depth + 1))
        if before is not None:
            before()
        t = time.perf_counter()
        round_fn()
        seconds.append(time.perf_counter() - t)
    return seconds


@torch.no_grad()
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


def vanilla_step_seconds(model, step, prompt, context: int, n=20) -> float:
    """The median of n decode steps after 3 more to warm up."""
    model.setup_caches(1, context)
    return statistics.median(step_seconds(model, step, prompt, n + 3)[3:])


def labelled(name, fn):
    def call(*a, **k):
        with torch.profiler.record_function(name):
            return fn(*a, **k)
    return call


@torch.no_grad()
def profile_eager(args, model, draft, tokenizer) -> dict:
    spec = make_speculator(args, model, draft)
    level = {"n": 0}
    for name in PHASES:
        if name != "accept":  # a function of speculative.py, not a method: patched there below
            setattr(spec, name, labelled(name, getattr(spec, name)))
    accept = speculative.accept
    speculative.accept = labelled("accept", accept)
    draft_forward, draft_log_probs = draft.forward, draft.log_probs

    def forward(*a, **k):  # the first draft forward of a round is the catch-up's
        with torch.profiler.record_function(f"draft forward {level['n']}"):
            level["n"] += 1
            return draft_forward(*a, **k)

    draft.forward, draft.log_probs = forward, labelled("draft LM head", draft_log_probs)
    try:
        rounds_from(spec, tokenizer, 4, spec.round, lambda: level.update(n=0))  # warm-up
        with torch.profiler.profile() as prof:
            seconds = rounds_from(spec, tokenizer, args.rounds, labelled("round", spec.round),
                                  lambda: level.update(n=0))
    finally:
        speculative.accept = accept
        del draft.forward, draft.log_probs
    events = {e.key: e for e in prof.key_averages()}
    n = args.rounds

    def ms(key, attr="cpu_time_total"):
        e = events.get(key)
        return getattr(e, attr) / 1e3 / n if e is not None else 0.0

    def row(part, key=None):
        return dict(part=part, ms=ms(key), self_ms=ms(key, "self_cpu_time_total"))

    rows = [row("catch-up (draft forward over the accepted tokens)", "catch_up")]
    rows += [row(f"tree level {d}: draft forward over {args.tree_top_k} nodes", f"draft forward {d}")
             for d in range(1, args.tree_depth)]
    heads = ms("draft LM head")
    rows.append(row(f"draft LM heads ({args.tree_depth} passes, all levels)", "draft LM head"))
    forwards = sum(ms(f"draft forward {d}") for d in range(1, args.tree_depth))
    rows.append(dict(part="tree growth, the rest (top-k, scores, masks, rerank, tree tensors)",
                     ms=ms("grow") - forwards - heads, self_ms=None))
    rows.append(row("tree growth, total (the rows above from level 1)", "grow"))
    rows.append(row(f"verify: target forward over {args.tree_tokens} tree tokens", "verify"))
    rows += [row(part, key) for part, key in (("accept", "accept"), ("compaction (K/V of accepted nodes)", "compact"),
                                              ("bookkeeping (new tokens, state)", "advance"))]
    total = statistics.mean(seconds) * 1e3
    rows.append(dict(part="between the phases (Python)", ms=total - sum(ms(p) for p in PHASES), self_ms=None))
    ops = sorted((e for e in prof.key_averages() if not e.key.startswith(("draft ", "round", *PHASES))),
                 key=lambda e: -e.self_cpu_time_total)[:12]
    return dict(round_ms=total, rows=rows,
                top_ops=[dict(op=e.key, self_ms=e.self_cpu_time_total / 1e3 / n, calls=e.count / n) for e in ops],
                dispatched_ops_per_round=sum(e.count for e in prof.key_averages()
                                             if e.key.startswith("aten::")) / n)


@torch.no_grad()
def profile_compiled(args, model, draft, tokenizer) -> dict:
    """The round compiled as one graph (as generate.py compiles it), and each phase compiled on its own
    and timed in a phased round: each includes its graph's call, a little above its share of the whole."""
    spec = make_speculator(args, model, draft)

    def compiled(fn):
        return compiling.compile_function(fn, "cpu", (model, draft), options=compiling.ROUND_OPTIONS)

    t = time.perf_counter()
    whole = compiled(spec.round)
    rounds_from(spec, tokenizer, 2, whole)
    compile_s = time.perf_counter() - t
    round_ms = statistics.median(rounds_from(spec, tokenizer, args.rounds, whole)) * 1e3

    def rest(tree, logits, features):
        node, n_accepted, bonus = speculative.accept(tree, logits, *spec.sampling)
        spec.advance(tree, spec.compact(tree, node), n_accepted, bonus, features)

    parts = dict(catch_up=compiled(spec.catch_up), grow=compiled(spec.grow), verify=compiled(spec.verify),
                 rest=compiled(rest))
    seconds = {name: [] for name in parts}

    def phased():
        def timed(name, *a):
            t = time.perf_counter()
            out = parts[name](*a)
            seconds[name].append(time.perf_counter() - t)
            return out
        tree = timed("grow", timed("catch_up"))
        timed("rest", tree, *timed("verify", tree))

    rounds_from(spec, tokenizer, 2, phased)  # compiles each phase
    for times in seconds.values():
        times.clear()
    rounds_from(spec, tokenizer, args.rounds, phased)
    phases = {name: statistics.median(times) * 1e3 for name, times in seconds.items()}
    return dict(round_ms=round_ms, compile_s=compile_s, phases_ms=phases)


def main(argv=None):
    args = parse_args(argv)
    model, draft = load_pair(args, args.draft_dtype or args.dtype, args.batch_invariant, args.speculate)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    probe = prompt_ids(tokenizer, 0)
    report = dict(run_header("profile_round.py", argv), dtype=args.dtype, batch_invariant=args.batch_invariant,
                  draft_dtype=args.draft_dtype or args.dtype, speculate=args.speculate,
                  tree=dict(top_k=args.tree_top_k, depth=args.tree_depth, tokens=args.tree_tokens))
    report["vanilla_step_ms_eager"] = vanilla_step_seconds(model, gen.decode_one_token, probe, args.context) * 1e3
    report["eager"] = profile_eager(args, model, draft, tokenizer)
    if args.compile:
        step = compiling.compile_step(gen.decode_one_token, "cpu", model)
        report["vanilla_step_ms_compiled"] = vanilla_step_seconds(model, step, probe, args.context) * 1e3
        report["compiled"] = profile_compiled(args, model, draft, tokenizer)
    write_report(args.out, report, markdown(report))


def markdown(report) -> str:
    step = report["vanilla_step_ms_eager"]
    e, tree = report["eager"], report["tree"]
    lines = [f"# One speculative round, {report['speculate']}, {report['dtype']} (draft {report['draft_dtype']}, "
             f"{report['threads']} threads, torch {report['torch']}"
             f"{', batch-invariant target' if report['batch_invariant'] else ''})", "",
             f"- command: `{report['command']}`", f"- hardware: {report['hardware']}; date {report['date']}",
             f"- tree: top_k {tree['top_k']}, depth {tree['depth']}, {tree['tokens']} tokens", "",
             f"Eager: a vanilla step {step:.1f} ms; a round {e['round_ms']:.1f} ms = {e['round_ms'] / step:.2f} steps, "
             f"{e['dispatched_ops_per_round']:.0f} aten calls.", "",
             "| part | ms per round | in vanilla steps | of which outside any operator (ms) |", "|---|---|---|---|"]
    for r in e["rows"]:
        self_ms = "" if r["self_ms"] is None else f"{r['self_ms']:.2f}"
        lines.append(f"| {r['part']} | {r['ms']:.2f} | {r['ms'] / step:.3f} | {self_ms} |")
    lines += ["", "Operators by self time (ms per round):", "", "| operator | ms | calls |", "|---|---|---|"]
    lines += [f"| {o['op']} | {o['self_ms']:.2f} | {o['calls']:.0f} |" for o in e["top_ops"]]
    if "compiled" in report:
        c, cstep = report["compiled"], report["vanilla_step_ms_compiled"]
        lines += ["", f"Compiled: a vanilla step {cstep:.1f} ms; a round {c['round_ms']:.1f} ms = "
                      f"{c['round_ms'] / cstep:.2f} compiled steps (compilation {c['compile_s']:.0f} s). "
                      "Each phase compiled on its own:", "",
                  "| phase | ms per round | in compiled vanilla steps |", "|---|---|---|"]
        names = dict(catch_up="catch-up", grow=f"tree growth (depth {tree['depth']}, top-k {tree['top_k']})",
                     verify=f"verify ({tree['tokens']} tokens)", rest="accept, compaction, bookkeeping")
        for name, ms in c["phases_ms"].items():
            lines.append(f"| {names[name]} | {ms:.2f} | {ms / cstep:.3f} |")
        total = sum(c["phases_ms"].values())
        lines.append(f"| sum of the phases | {total:.2f} | {total / cstep:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
