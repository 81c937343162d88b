"""The target's forward over T tokens (a decode step: T = 1; a verify: T = tree tokens) against a
static cache of S slots, timed with each of the two ways attention can meet grouped-query heads
on a CPU, side by side in one process:

    grouped   model.attention today: the G query heads that share a KV head are G * T rows of
              one SDPA call per KV head (model._grouped_sdpa)
    gqa       SDPA's own GQA mode (enable_gqa=True), as model.attention called it before

    python scripts/bench_attention.py --compile --dtype bfloat16 --slots 256 1024 --tokens 1 12 \\
        --out benchmarks/attention-SmolLM2-135M-Instruct-cpu-bf16-compiled-epyc

Compiled as generate.py --compile compiles (speculative.compile_function: frozen weights, the C++
GEMM templates); each (S, T, way) is its own graph. Writes OUT.json and OUT.md.
"""
import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import model as model_module  # noqa: E402
import speculative  # noqa: E402
from benchmark import hardware_name  # noqa: E402  (scripts/ is on the path: this file's folder)
from checkpoint import load_model  # noqa: E402


def gqa_sdpa(q, k, v, mask):
    """The attention that _grouped_sdpa replaced: SDPA's GQA mode, one query head at a time."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


WAYS = {"grouped": model_module._grouped_sdpa, "gqa": gqa_sdpa}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--slots", type=int, nargs="+", default=[256, 1024], help="static cache sizes S")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 12], help="query tokens T per forward")
    p.add_argument("--steps", type=int, default=40, help="timed forwards per case (median reported)")
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    if not args.checkpoint_path.is_file():
        p.error(f"no checkpoint at {args.checkpoint_path} (scripts/prepare.sh writes it)")
    if min(args.slots) < 2 or min(args.tokens) < 1 or args.steps < 1:
        p.error("--slots must be >= 2, --tokens and --steps >= 1")
    if max(args.tokens) >= min(args.slots):
        p.error(f"--tokens must be below the smallest --slots ({min(args.slots)})")
    return args


def time_forward(model, S: int, T: int, steps: int, compile: bool):
    """(median ms, logits) of the target's forward over T tokens written at the cache's middle,
    every earlier slot visible (causal within the T tokens), the rest of the S slots masked off."""
    start = S // 2 - T // 2
    idx = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(start, start + T)[None]
    mask = (torch.arange(S)[None, None] <= pos[..., None])  # [1, T, S]

    def forward(idx, pos, mask):
        return model(idx, pos, mask=mask)
    fn = speculative.compile_function(forward, "cpu", [model]) if compile else forward
    times = []
    with torch.no_grad():
        for i in range(steps + 3):  # 3 warm-up calls (the first compiles)
            t = time.perf_counter()
            logits = fn(idx, pos, mask)
            if i >= 3:
                times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, logits.float()


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    model = load_model(args.checkpoint_path, "cpu", getattr(torch, args.dtype), None)
    if model.config.n_head == model.config.n_local_heads:
        sys.exit("error: this model has as many KV heads as query heads (no GQA): the two ways are one")
    rows = []
    original = model_module._grouped_sdpa
    try:
        for S in args.slots:
            model.setup_caches(1, S)
            for T in args.tokens:
                row, logits = dict(slots=S, tokens=T), {}
                for way, fn in WAYS.items():
                    model_module._grouped_sdpa = fn
                    torch._dynamo.reset()
                    row[f"{way}_ms"], logits[way] = time_forward(model, S, T, args.steps, args.compile)
                row["speedup"] = row["gqa_ms"] / row["grouped_ms"]
                # the same computation both ways: only rounding may differ
                row["max_logit_diff"] = (logits["grouped"] - logits["gqa"]).abs().max().item()
                print(f"S={S} T={T}: grouped {row['grouped_ms']:.2f} ms, gqa {row['gqa_ms']:.2f} ms "
                      f"({row['speedup']:.2f}x)", file=sys.stderr)
                rows.append(row)
    finally:
        model_module._grouped_sdpa = original
        torch._dynamo.reset()
    report = dict(hardware=hardware_name("cpu"), torch=torch.__version__, dtype=args.dtype, compiled=args.compile,
                  threads=torch.get_num_threads(), model=args.checkpoint_path.parent.name,
                  heads=f"{model.config.n_head} query, {model.config.n_local_heads} KV",
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  command="python scripts/bench_attention.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  steps=args.steps, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Attention with grouped-query heads on a CPU: {report['model']}, {report['hardware']}", "",
             f"- date: {report['date']}", f"- command: `{report['command']}`",
             f"- torch {report['torch']}, {report['threads']} threads, {args.dtype}, "
             f"{'compiled (generate.py --compile)' if args.compile else 'eager'}; {report['heads']} heads",
             f"- the target's whole forward over T tokens, median of {args.steps}; S: static cache slots", "",
             "| S | T | grouped (ms) | gqa (ms) | gqa / grouped | largest logit difference |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['slots']} | {r['tokens']} | {r['grouped_ms']:.2f} | {r['gqa_ms']:.2f} | {r['speedup']:.2f}× | "
              f"{r['max_logit_diff']:.2g} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return report


if __name__ == "__main__":
    main()
