"""Where a compiled speculative round's time goes on a CPU: the round as it runs, each phase of it
compiled and timed alone from the same state (catch-up, tree growth, verify, acceptance with
compaction and bookkeeping), and the plain decode step they are measured against; then the round's
kernels by self time.

    python research/round_parts.py --tree 4,4,16 --lookup 8 --out /tmp/round_parts
"""
import argparse
import json
import statistics
import sys
import timeit
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import compiling  # noqa: E402
import invariant  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from common import run_header, write_report  # noqa: E402
from generate import decode_one_token  # noqa: E402
from speculative import Speculator  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--speculate", choices=["eagle2", "eagle3"], default="eagle3")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--batch_invariant", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tree", default="4,4,16", help="TOP_K,DEPTH,TOKENS")
    p.add_argument("--lookup", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kernels", action="store_true", help="Inductor's kernel profiling on, and kernel tables")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.checkpoint_path, "cpu", dtype)
    if args.batch_invariant:
        invariant.enable(model)
    folder = args.checkpoint_path.parent / ("eagle3" if args.speculate == "eagle3" else "eagle")
    draft = load_draft(folder, model.config, "cpu", dtype, arch=args.speculate.rstrip("2"))
    k, d, t = (int(x) for x in args.tree.split(","))
    tok = load_tokenizer(args.checkpoint_path.parent)
    spec = Speculator(model, draft, tree_top_k=k, tree_depth=d, tree_tokens=t, lookup=args.lookup,
                      stop_ids=tok.stop_ids)
    spec.setup(1, args.context + 2 * (spec.depth + 1))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain how a bicycle stays upright, in detail."}])
    torch._inductor.config.cpp.enable_kernel_profile = args.kernels
    torch._dynamo.config.recompile_limit = 64
    with torch.no_grad():
        spec.prefill(torch.tensor([prompt]), 300)
        for _ in range(3):  # a few eager rounds: a realistic state with a catch-up of several pairs
            spec.round()
    state = [(b, b.clone()) for b in spec.buffers(recurse=False)]

    def restore():
        for b, saved in state:
            b.copy_(saved)

    def compiled(fn):
        return compiling.compile_function(fn, "cpu", (model, draft), options=compiling.ROUND_OPTIONS)

    def timed(fn, name):
        with torch.no_grad():
            restore()
            c = timeit.timeit(fn, number=1)
            times = []
            for _ in range(args.repeats):
                restore()
                times.append(timeit.timeit(fn, number=1))
        ms = statistics.median(times) * 1e3
        print(f"{name:24s} {ms:8.2f} ms   (compile {c:.0f} s)", file=sys.stderr, flush=True)
        return ms

    with torch.no_grad():
        restore()
        root_hidden = spec.catch_up()
        tree = spec.grow(root_hidden)
        tree_l = spec.add_lookup(tree)
        logits, features = spec.verify(tree_l)
    token, pos = spec.root.clone(), spec.prefix_len.clone()
    step = compiling.compile_step(decode_one_token, "cpu", model)
    rows = {}
    rows["plain step"] = timed(lambda: step(model, token, pos, 0.0, None, None), "plain step")
    rows["round"] = timed(compiled(spec.round), "round")
    rows["catch_up"] = timed(compiled(spec.catch_up), "catch_up")
    rows["grow"] = timed(compiled(lambda: spec.grow(root_hidden)), "grow")
    rows["add_lookup"] = timed(compiled(lambda: spec.add_lookup(tree)), "add_lookup")
    rows["verify"] = timed(compiled(lambda: spec.verify(tree_l)), "verify")
    rows["finish"] = timed(compiled(lambda: spec.finish(tree_l, logits, features)), "finish")
    rows["draft_1_token"] = timed(compiled(lambda: draft(
        model.tok_embeddings(spec.root[:, None]), spec.cu_features[:, :1], spec.prefix_len[:, None])), "draft 1 token")

    def kernels(fn):
        with torch.no_grad():
            restore()
            fn()
            with torch.profiler.profile() as prof:
                for _ in range(args.repeats):
                    restore()
                    fn()
        events = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                        key=lambda e: -e.self_cpu_time_total)
        return [dict(name=e.key, ms=e.self_cpu_time_total / 1e3 / args.repeats, calls=e.count / args.repeats)
                for e in events]

    tables = {}
    if args.kernels:
        tables["round"] = kernels(compiled(spec.round))
        tables["step"] = kernels(lambda: step(model, token, pos, 0.0, None, None))
    report = dict(run_header("round_parts.py", argv), rows_ms=rows, kernels=tables)
    lines = ["| part | ms | plain steps |", "|---|---|---|"]
    lines += [f"| {n} | {v:.2f} | {v / rows['plain step']:.2f} |" for n, v in rows.items()]
    for name, table in tables.items():
        total = sum(x["ms"] for x in table)
        lines += ["", f"{name} kernels by self time (profiled sum {total:.2f} ms)", "", "| kernel | ms | calls |",
                  "|---|---|---|"]
        lines += [f"| `{x['name'][:100]}` | {x['ms']:.3f} | {x['calls']:.0f} |" for x in table[:args.top]]
    write_report(args.out, report, f"round_parts {args.tree} +{args.lookup}", lines)


if __name__ == "__main__":
    main()
