"""Where a compiled verify's time goes: the target's forward over T tree tokens, compiled as a round
compiles it on a CPU (Inductor's CPU settings: frozen weights, the C++ GEMM templates), timed and
profiled kernel by kernel for each T.

    python research/profile_verify.py --dtype bfloat16 --tokens 1 4 8 12 16 --out /tmp/profile_verify

T = 1 is a plain decode step's forward; T > 1 is a chain of T nodes in the tree region after a
--prefix-token prefix, as Speculator.verify passes it (a chain's mask costs what any tree's does).
Each T is a graph of its own, compiled with Inductor's kernel profiling on, so that the profiler sees
each generated kernel apart. Per T: the median time in plain steps, the GEMMs' FLOPs and weight
bytes, and the kernels by self time, grouped into GEMMs, attention and the rest. Writes OUT.json and OUT.md.
"""
import argparse
import statistics
import sys
import timeit
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import compiling  # noqa: E402
import invariant  # noqa: E402
from checkpoint import load_model  # noqa: E402
from model import TreeMask  # noqa: E402
from common import run_header, write_report  # noqa: E402
from quantize import mode_from_path  # noqa: E402

# How a profiler event's name says what it is (the first rule that matches wins).
GROUPS = (("GEMM", ("gemm", "template", "mm", "linear", "matmul")),
          ("attention", ("attention", "flash", "sdpa", "softmax")))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--batch_invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="the target in batch-invariant mode (the compiled CPU default)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 12, 16], help="the T to compile and profile")
    p.add_argument("--prefix", type=int, default=200, help="tokens in the cache before the verified ones")
    p.add_argument("--context", type=int, default=512, help="cache slots (as generate.py's smallest cache)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per T")
    p.add_argument("--top", type=int, default=10, help="kernels listed per T")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or not 1 <= args.prefix <= args.context - 2 * max(args.tokens):
        p.error(f"--tokens must be >= 1 and --prefix in [1, context - 2 * max(tokens)] = "
                f"[1, {args.context - 2 * max(args.tokens)}]")
    quantized = mode_from_path(args.checkpoint_path)[0]
    problem = invariant.problem("cpu", args.dtype, True, quantized, False) if args.batch_invariant else None
    if problem:
        p.error(problem)
    return args


def forward_inputs(model, T: int, prefix: int) -> tuple:
    """The arguments of the target's forward for T tokens after `prefix` cached ones."""
    tokens = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
    if T == 1:
        return tokens, torch.tensor([prefix])
    chain = torch.ones(T, T, dtype=torch.bool).tril()[None]  # node i sees nodes 0..i
    slots = model.max_seq_length - T + torch.arange(T)
    return tokens, prefix + torch.arange(T)[None], slots, TreeMask(torch.tensor([prefix]), chain)


@torch.no_grad()
def profile(model, T: int, args) -> dict:
    inputs, forward = forward_inputs(model, T, args.prefix), model  # through the module: its hooks run
    compile_s = timeit.timeit(lambda: forward(*inputs), number=1)  # the first call compiles
    seconds = timeit.repeat(lambda: forward(*inputs), number=1, repeat=args.repeats + 3)
    with torch.profiler.profile() as prof:
        for _ in range(args.repeats):
            forward(*inputs)
    kernels = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                     key=lambda e: -e.self_cpu_time_total)
    ms = {e.key: e.self_cpu_time_total / 1e3 / args.repeats for e in kernels}
    groups = {}
    for name, value in ms.items():
        kind = next((g for g, words in GROUPS if any(w in name.lower() for w in words)), "other")
        groups[kind] = groups.get(kind, 0.0) + value
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return dict(tokens=T, ms=statistics.median(seconds[3:]) * 1e3, compile_s=compile_s,
                gemm_gflop=sum(2 * T * m.in_features * m.out_features for m in linears) / 1e9,
                weight_gb=sum(m.weight.numel() * m.weight.element_size() for m in linears) / 1e9,
                profiled_ms=sum(ms.values()), groups_ms=groups,
                kernels=[dict(name=e.key, ms=ms[e.key], calls=e.count / args.repeats) for e in kernels[:args.top]])


def main(argv=None):
    args = parse_args(argv)
    model = load_model(args.checkpoint_path, "cpu", getattr(torch, args.dtype))
    if args.batch_invariant:
        invariant.enable(model)
    model.setup_caches(1, args.context)
    with torch.no_grad():  # the prefix's K/V, eagerly
        model(torch.randint(0, model.config.vocab_size, (1, args.prefix), generator=torch.Generator().manual_seed(0)),
              torch.arange(args.prefix))
    torch._inductor.config.cpp.enable_kernel_profile = True  # each generated kernel a profiler event
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(args.tokens) + 1)
    model.forward = compiling.compile_function(model.forward, "cpu", (model,), options=compiling.ROUND_OPTIONS)
    rows = [profile(model, T, args) for T in args.tokens]
    step = next((r["ms"] for r in rows if r["tokens"] == 1), None)
    report = dict(run_header("profile_verify.py", argv), dtype=args.dtype, batch_invariant=args.batch_invariant,
                  prefix=args.prefix, context=args.context, step_ms=step, rows=rows)
    write_report(args.out, report, *markdown(report))


def markdown(report) -> tuple:
    """The report's title and lines."""
    step = report["step_ms"]
    title = f"The compiled target forward over T tokens, {report['dtype']}" + (
        ", batch-invariant" if report["batch_invariant"] else "")
    lines = [f"- a prefix of {report['prefix']} tokens in a cache of {report['context']} slots", "",
             "| T | ms | plain steps | GEMM GFLOP | GEMM ms | attention ms | other ms | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        g = r["groups_ms"]
        steps = f"{r['ms'] / step:.2f}" if step else ""
        lines.append(f"| {r['tokens']} | {r['ms']:.2f} | {steps} | {r['gemm_gflop']:.2f} | {g.get('GEMM', 0):.2f} | "
                     f"{g.get('attention', 0):.2f} | {g.get('other', 0):.2f} | {r['compile_s']:.0f} |")
    for r in report["rows"]:
        lines += ["", f"T = {r['tokens']}: kernels by self time (ms per forward; the profiled sum "
                      f"{r['profiled_ms']:.2f} ms)", "", "| kernel | ms | calls |", "|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['ms']:.3f} | {k['calls']:.0f} |" for k in r["kernels"]]
    return title, lines


if __name__ == "__main__":
    main()
