"""Where a speculative round's time goes, on this machine: catch-up, each tree level (draft
forward and LM head), verify, accept, compaction, bookkeeping and the rest (Python and framework
overhead), next to one vanilla decode step in the same dtype and mode.

    python scripts/profile_round.py --speculate eagle3 --dtype bfloat16 --tree_tokens 16 \\
        --out benchmarks/profile_round-SmolLM2-135M-Instruct-cpu-bf16

Eager: torch.profiler over --rounds rounds, each phase of Speculator.round (and each draft
forward and LM-head pass inside the tree growth) labelled with record_function; a label's time is
its wall time, its "self" time what no operator inside it accounts for (Python and dispatch).
--compile: the whole compiled round (one graph) timed against the compiled vanilla step, and each
phase compiled on its own and timed, to show which phases compilation speeds up. Rounds run on
real chat prompts; every round starts from the state the previous one left (a real decode).
Writes OUT.json and OUT.md.
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
sys.path.insert(0, str(ROOT))

import generate as gen  # noqa: E402
import speculative  # noqa: E402
from benchmark import hardware_name  # noqa: E402  (scripts/ is on the path: this file's folder)
from checkpoint import load_draft, load_model  # noqa: E402
from model import pack_linears  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a short story about a lighthouse keeper.",
           "What are the pros and cons of electric cars?", "How do I make a good cup of tea?"]
PHASES = ("catch_up", "grow", "verify", "accept", "compact", "advance")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="default: eagle/ (eagle, eagle2) or eagle3/ (eagle3) beside the checkpoint")
    p.add_argument("--speculate", choices=["eagle2", "eagle3"], default="eagle3")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--draft_dtype", choices=["float32", "bfloat16"], default=None,
                   help="eagle3: the head's dtype (default: --dtype), as generate.py --draft_dtype")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch_invariant", action="store_true", help="the target in batch-invariant mode (generate.py's)")
    p.add_argument("--tree_top_k", type=int, default=10)
    p.add_argument("--tree_depth", type=int, default=None, help="default: 6 for eagle2, 8 for eagle3")
    p.add_argument("--tree_tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--context", type=int, default=512,
                   help="tokens the caches hold (compiled attention reads all of them): an MT-bench turn of "
                        "128 new tokens needs about 300-500")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = p.parse_args(argv)
    if args.draft_dtype is not None and args.speculate != "eagle3":
        p.error("--draft_dtype sets the dtype of an EAGLE-3 head; EAGLE-1/2 heads use the target's LM head")
    args.draft_checkpoint_path = args.draft_checkpoint_path or args.checkpoint_path.parent / gen.SPECULATE[
        args.speculate]["folder"]
    args.tree_depth = args.tree_depth or gen.SPECULATE[args.speculate]["depth"]
    if args.batch_invariant:
        problem = gen.batch_invariant_problem("cpu", args.dtype, args.compile, args.checkpoint_path)
        if problem:
            p.error(problem)
    return args


def make_speculator(args, model, draft, tokenizer):
    spec = speculative.Speculator(model, draft, tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                                  tree_tokens=args.tree_tokens, stop_ids=())  # no stop: rounds keep coming
    spec.setup(1, args.context)
    return spec


def prompt_ids(tokenizer, i):
    return torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])])


def rounds_from(spec, tokenizer, n, round_fn, before=None):
    """n rounds, restarting from a fresh prompt every 16 (so the cache never fills); before() runs
    before each round (to reset per-round counters). Returns the seconds of each round."""
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
def vanilla_step_seconds(model, decode_fn, context: int, n=20) -> float:
    model.setup_caches(1, context)
    token = gen.prefill(model, prompt_ids_cache["probe"], 0.0, None, None)
    pos = torch.tensor([prompt_ids_cache["probe"].size(1)])
    times = []
    for _ in range(n + 3):
        t = time.perf_counter()
        token = decode_fn(model, token.clone(), pos, 0.0, None, None)
        times.append(time.perf_counter() - t)
        pos += 1
    return statistics.median(times[3:])


prompt_ids_cache = {}


@torch.no_grad()
def profile_eager(args, model, draft, tokenizer) -> dict:
    spec = make_speculator(args, model, draft, tokenizer)
    level = {"n": 0}
    for name in PHASES:
        if name == "accept":
            continue
        method = getattr(spec, name)
        setattr(spec, name, labelled(name, method))
    accept = speculative.accept
    speculative.accept = labelled("accept", accept)
    draft_forward, draft_log_probs = draft.forward, draft.log_probs

    def forward(*a, **k):  # the first draft forward of a round is the catch-up's
        with torch.profiler.record_function(f"draft forward {level['n']}"):
            level["n"] += 1
            return draft_forward(*a, **k)

    def log_probs(*a, **k):
        with torch.profiler.record_function("draft LM head"):
            return draft_log_probs(*a, **k)

    draft.forward, draft.log_probs = forward, log_probs
    try:
        rounds_from(spec, tokenizer, 4, spec.round, lambda: level.update(n=0))  # warm-up
        with torch.profiler.profile() as prof:
            with torch.profiler.record_function("round"):
                pass
            seconds = rounds_from(spec, tokenizer, args.rounds,
                                  labelled("round", spec.round), lambda: level.update(n=0))
    finally:
        speculative.accept = accept
        del draft.forward, draft.log_probs
    events = {e.key: e for e in prof.key_averages()}
    n = args.rounds

    def ms(key, attr="cpu_time_total"):
        e = events.get(key)
        return getattr(e, attr) / 1e3 / n if e is not None else 0.0

    rows = [dict(part="catch-up (draft forward over the accepted tokens)", ms=ms("catch_up"), self_ms=ms("catch_up", "self_cpu_time_total"))]
    for d in range(1, args.tree_depth):
        rows.append(dict(part=f"tree level {d}: draft forward over {args.tree_top_k} nodes",
                         ms=ms(f"draft forward {d}"), self_ms=ms(f"draft forward {d}", "self_cpu_time_total")))
    heads = ms("draft LM head")
    rows.append(dict(part=f"draft LM heads ({args.tree_depth} passes, all levels)", ms=heads,
                     self_ms=ms("draft LM head", "self_cpu_time_total")))
    forwards = sum(ms(f"draft forward {d}") for d in range(1, args.tree_depth))
    rows.append(dict(part="tree growth, the rest (top-k, scores, masks, rerank, tree tensors)",
                     ms=ms("grow") - forwards - heads, self_ms=None))
    rows.append(dict(part="tree growth, total (the rows above from level 1)", ms=ms("grow"),
                     self_ms=ms("grow", "self_cpu_time_total")))
    rows.append(dict(part=f"verify: target forward over {args.tree_tokens} tree tokens", ms=ms("verify"),
                     self_ms=ms("verify", "self_cpu_time_total")))
    for part, key in (("accept", "accept"), ("compaction (K/V of accepted nodes)", "compact"),
                      ("bookkeeping (new tokens, state)", "advance")):
        rows.append(dict(part=part, ms=ms(key), self_ms=ms(key, "self_cpu_time_total")))
    total = statistics.mean(seconds) * 1e3
    rows.append(dict(part="between the phases (Python)", ms=total - sum(ms(p) for p in PHASES), self_ms=None))
    ops = sorted((e for e in prof.key_averages() if not e.key.startswith(("draft ", "round", *PHASES))),
                 key=lambda e: -e.self_cpu_time_total)[:12]
    return dict(round_ms=total, rows=rows,
                top_ops=[dict(op=e.key, self_ms=e.self_cpu_time_total / 1e3 / n, calls=e.count / n) for e in ops],
                dispatched_ops_per_round=sum(e.count for e in prof.key_averages()
                                             if e.key.startswith("aten::")) / n)


def labelled(name, fn):
    def call(*a, **k):
        with torch.profiler.record_function(name):
            return fn(*a, **k)
    return call


@torch.no_grad()
def profile_compiled(args, model, draft, tokenizer) -> dict:
    """The compiled round (one graph), and each phase compiled as a graph of its own and timed in
    a phased round (each phase's time includes the call of its graph: a little above its share of
    the one-graph round). Compiled as generate.py compiles (speculative.compile_function: on a CPU,
    frozen weights and C++ GEMM templates)."""
    spec = make_speculator(args, model, draft, tokenizer)
    t = time.perf_counter()
    whole = speculative.compile_function(torch._dynamo.dont_skip_tracing(spec.round), "cpu", (model, draft),
                                         options=speculative.ROUND_OPTIONS)
    rounds_from(spec, tokenizer, 2, whole)
    compile_s = time.perf_counter() - t
    round_ms = statistics.median(rounds_from(spec, tokenizer, args.rounds, whole)) * 1e3

    def phase(fn):
        return speculative.compile_function(torch._dynamo.dont_skip_tracing(fn), "cpu", (model, draft),
                                            options=speculative.ROUND_OPTIONS)

    def rest(tree, logits, features):
        node, n_accepted, bonus = speculative.accept(tree, logits, *spec.sampling)
        spec.advance(tree, spec.compact(tree, node), n_accepted, bonus, features)

    parts = dict(catch_up=phase(spec.catch_up), grow=phase(spec.grow), verify=phase(spec.verify), rest=phase(rest))
    seconds = {name: [] for name in parts}

    def phased():
        def timed(name, *a):
            t = time.perf_counter()
            out = parts[name](*a)
            seconds[name].append(time.perf_counter() - t)
            return out
        tree = timed("grow", timed("catch_up"))
        timed("rest", tree, *timed("verify", tree))

    rounds_from(spec, tokenizer, 2, phased)
    for times in seconds.values():
        times.clear()
    rounds_from(spec, tokenizer, args.rounds, phased)
    phases = {name: statistics.median(times) * 1e3 for name, times in seconds.items()}
    return dict(round_ms=round_ms, compile_s=compile_s, phases_ms=phases)


def main(argv=None):
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.checkpoint_path, "cpu", dtype)
    if args.batch_invariant:
        gen.set_batch_invariant(model)
    draft = load_draft(args.draft_checkpoint_path, model.config, "cpu", getattr(torch, args.draft_dtype or args.dtype))
    gen.check_head(args.speculate, draft, args.draft_checkpoint_path)
    if not args.compile:  # as generate.make_decoder runs eager mode: half-precision weights prepacked for oneDNN
        pack_linears(model)
        pack_linears(draft)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    prompt_ids_cache["probe"] = prompt_ids(tokenizer, 0)
    report = dict(command="python scripts/profile_round.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), hardware=hardware_name("cpu"),
                  torch=torch.__version__, threads=torch.get_num_threads(), dtype=args.dtype,
                  batch_invariant=args.batch_invariant,
                  draft_dtype=args.draft_dtype or args.dtype,
                  speculate=args.speculate, tree=dict(top_k=args.tree_top_k, depth=args.tree_depth,
                                                      tokens=args.tree_tokens))
    report["vanilla_step_ms_eager"] = vanilla_step_seconds(model, gen.decode_one_token, args.context) * 1e3
    report["eager"] = profile_eager(args, model, draft, tokenizer)
    if args.compile:
        gen.compile_decoding("cpu", False, model)
        report["vanilla_step_ms_compiled"] = vanilla_step_seconds(model, gen.decode_one_token, args.context) * 1e3
        report["compiled"] = profile_compiled(args, model, draft, tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(args.out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(str(args.out) + ".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report) -> str:
    step = report["vanilla_step_ms_eager"]
    e = report["eager"]
    lines = [f"# One speculative round, {report['speculate']}, {report['dtype']} (draft "
             f"{report.get('draft_dtype', report['dtype'])}, {report['threads']} threads, "
             f"torch {report['torch']}{', batch-invariant target' if report.get('batch_invariant') else ''})", "", f"- command: `{report['command']}`",
             f"- hardware: {report.get('hardware', 'not recorded')}; "
             f"date {report.get('date', 'not recorded')}",
             f"- tree: top_k {report['tree']['top_k']}, depth {report['tree']['depth']}, "
             f"{report['tree']['tokens']} tokens", "",
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
        names = dict(catch_up="catch-up", grow=f"tree growth (depth {report['tree']['depth']}, top-k "
                                                f"{report['tree']['top_k']})",
                     verify=f"verify ({report['tree']['tokens']} tokens)", rest="accept, compaction, bookkeeping")
        for name, ms in c["phases_ms"].items():
            lines.append(f"| {names[name]} | {ms:.2f} | {ms / cstep:.3f} |")
        lines.append(f"| sum of the phases | {sum(c['phases_ms'].values()):.2f} | "
                     f"{sum(c['phases_ms'].values()) / cstep:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
