"""The held-out check of --tree_tokens auto: the shape auto chooses against the best shape of a
sweep, all timed end to end, side by side in one run, on prompts auto never measured on.

    python scripts/check_auto.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth \\
        --out benchmarks/check_auto-SmolLM2-135M-Instruct-cpu-fp32

auto measures afresh here (no cache) on generate.PROBE_TEXTS. The check decodes MT-bench first
turns that the benchmark's 16-question subset does not contain (the third question of each
category), greedy, eager, and times vanilla decoding and every shape -- auto's choice, the
shapes it ranked next, and a fixed grid from one-guess chains to 60-token trees -- in --passes
passes, each in a new shuffled order. A configuration's time is its fastest pass: on a shared
machine noise only ever slows a run down. Every speculative answer must equal vanilla's.
"""
import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import generate as gen  # noqa: E402
import speculative  # noqa: E402
from benchmark import QUESTION_FILES, load_questions  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from model import pack_linears  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

# (top_k, depth, tokens): from the smallest tree (one guess) to the papers' 60-token tree.
GRID = [(4, 1, 2), (6, 1, 3), (10, 1, 4), (4, 2, 4), (8, 2, 8), (4, 4, 8), (6, 3, 12), (8, 4, 16),
        (10, 6, 16), (10, 6, 32), (10, 6, 60)]


def held_out_prompts(tokenizer, question_file: Path, n_subset: int = 16) -> list:
    """First turns of the questions that load_questions(n_subset + 8) adds to the benchmark's
    subset load_questions(n_subset): one more question from each of the eight categories."""
    used = {q["question_id"] for q in load_questions(question_file, n_subset)}
    held = [q for q in load_questions(question_file, n_subset + 8) if q["question_id"] not in used]
    return [(q["category"], tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}]))
            for q in held]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--speculate", choices=["eagle2", "eagle3"], default="eagle2")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="default: the method's head next to the checkpoint (as generate.py)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--draft_dtype", choices=["float32", "bfloat16"], default=None,
                   help="eagle3: the head's dtype (default: --dtype), as generate.py --draft_dtype")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--question_file", type=Path, default=next((f for f in QUESTION_FILES if f.is_file()), None))
    p.add_argument("--benchmark_questions", type=int, default=16,
                   help="the size of the benchmark's subset, whose questions are not used here")
    p.add_argument("--out", type=str, default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    if args.question_file is None or not args.question_file.is_file():
        p.error("no MT-bench question file: pass --question_file")
    if args.draft_checkpoint_path is None:
        args.draft_checkpoint_path = args.checkpoint_path.parent / gen.SPECULATE[args.speculate]["folder"]
    if args.draft_dtype is not None and args.speculate != "eagle3":
        p.error("--draft_dtype sets the dtype of an EAGLE-3 head")
    if args.max_new_tokens < 1 or args.passes < 1:
        p.error("--max_new_tokens and --passes must be >= 1")

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.checkpoint_path, "cpu", dtype)
    draft = load_draft(args.draft_checkpoint_path, model.config, "cpu", getattr(torch, args.draft_dtype or args.dtype))
    gen.check_head(args.speculate, draft, args.draft_checkpoint_path)
    pack_linears(model)
    pack_linears(draft)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    stop_ids = tokenizer.stop_ids
    prompts = held_out_prompts(tokenizer, args.question_file, args.benchmark_questions)
    if not prompts:
        sys.exit(f"error: {args.question_file} has no question outside the first {args.benchmark_questions}")

    choice, table, costs, how = speculative.shape_table(model, draft, gen.probe_prompts(tokenizer),
                                                        stop_ids=stop_ids, temperature=0.0)
    print(f"auto ({how}): {choice or 'vanilla decoding'}", file=sys.stderr)
    predicted = {tuple(s.values()): (speedup, tau, cost) for speedup, tau, cost, s in table}
    shapes = ([tuple(choice.values())] if choice else []) + [tuple(s.values()) for *_, s in table[:4]] + GRID
    shapes = list(dict.fromkeys(shapes))  # unique, in order

    longest = max(len(ids) for _, ids in prompts) + args.max_new_tokens + 2 * 9
    model.setup_caches(1, longest + 64)  # once, for every shape: no configuration pays for an allocation
    specs = {s: speculative.Speculator(model, draft, tree_top_k=s[0], tree_depth=s[1], tree_tokens=s[2],
                                       stop_ids=stop_ids) for s in shapes}
    for spec in specs.values():
        spec.setup(1, longest)

    def run(config):
        """Seconds and tokens for all held-out prompts; the answers, for the equality check."""
        answers, tokens, rounds = [], 0, 0
        t = time.perf_counter()
        for _, ids in prompts:
            prompt = torch.tensor([ids])
            if config == "vanilla":
                out = gen.generate(model, prompt, args.max_new_tokens, stop_ids=stop_ids)[0]
            else:
                out, per_round = speculative.speculative_generate(specs[config], prompt, args.max_new_tokens)
                out, rounds = out[0], rounds + len(per_round[0])
            answers.append(out)
            tokens += len(out)
        return time.perf_counter() - t, tokens, rounds, answers

    configs = ["vanilla", *shapes]
    with torch.no_grad():
        run("vanilla"), run(shapes[0])  # warm-up: first-call allocations and oneDNN's kernel choices
        best, answers, info = {}, {}, {}
        for i in range(args.passes):
            order = configs[:]
            random.Random(i).shuffle(order)
            for config in order:
                seconds, tokens, rounds, outs = run(config)
                best[config] = min(best.get(config, float("inf")), seconds)
                answers[config], info[config] = outs, (tokens, rounds)
                print(f"pass {i + 1}: {config}: {tokens / seconds:.1f} tok/s", file=sys.stderr)

    vanilla_rate = info["vanilla"][0] / best["vanilla"]
    rows = []
    for s in shapes:
        tokens, rounds = info[s]
        speedup = tokens / best[s] / vanilla_rate
        rows.append(dict(top_k=s[0], depth=s[1], tokens=s[2], tok_s=tokens / best[s], speedup=speedup,
                         tau=tokens / max(rounds, 1), predicted_speedup=predicted.get(s, (None,))[0],
                         predicted_tau=predicted.get(s, (None, None))[1], equal=answers[s] == answers["vanilla"],
                         chosen=bool(choice) and s == tuple(choice.values())))
    rows.sort(key=lambda r: -r["speedup"])
    best_row = rows[0]
    chosen = next((r for r in rows if r["chosen"]), None)
    chosen_speedup = chosen["speedup"] if chosen else 1.0  # auto's "no tree": vanilla decoding
    report = dict(
        command="python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        date=time.strftime("%Y-%m-%d"), machine=platform.processor() or platform.machine(),
        cpu_count=torch.get_num_threads(), torch=torch.__version__, dtype=args.dtype,
        draft_dtype=args.draft_dtype or args.dtype, speculate=args.speculate,
        head=str(args.draft_checkpoint_path), max_new_tokens=args.max_new_tokens, passes=args.passes,
        prompts=[c for c, _ in prompts], auto=how, auto_step_ms=costs.step * 1e3,
        choice=choice, vanilla_tok_s=vanilla_rate, rows=rows,
        chosen_over_best=chosen_speedup / max(best_row["speedup"], 1.0),
        all_equal=all(r["equal"] for r in rows))
    md = [f"# Held-out check of --tree_tokens auto ({args.speculate}, {args.dtype}, draft "
          f"{args.draft_dtype or args.dtype}, eager, CPU)", "",
          f"`{report['command']}`", "",
          f"{report['date']}, {report['machine']}, {report['cpu_count']} threads, torch {report['torch']}. "
          f"auto {how}; held-out prompts: the first turns of {len(prompts)} MT-bench questions outside the "
          f"benchmark's subset (one per category), {args.max_new_tokens} new tokens each, greedy; best of "
          f"{args.passes} passes in shuffled order. Vanilla: {vanilla_rate:.1f} tok/s.", "",
          f"auto chose **{choice or 'vanilla decoding'}**: {chosen_speedup:.2f}x; the best shape of the sweep "
          f"({best_row['top_k']}, {best_row['depth']}, {best_row['tokens']}): {best_row['speedup']:.2f}x; chosen / "
          f"best = **{report['chosen_over_best']:.2f}** (the target: >= 0.90). Every answer equal to vanilla's: "
          f"{report['all_equal']}.", "",
          "| top_k | depth | tokens | tok/s | speedup | tau | predicted speedup | predicted tau | equal |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        pred = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        md.append(f"| {r['top_k']} | {r['depth']} | {r['tokens']}{' (auto)' if r['chosen'] else ''} | "
                  f"{r['tok_s']:.1f} | {r['speedup']:.2f} | {r['tau']:.2f} | {pred(r['predicted_speedup'])} | "
                  f"{pred(r['predicted_tau'])} | {'yes' if r['equal'] else 'NO'} |")
    print("\n".join(md))
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
        Path(args.out + ".md").write_text("\n".join(md) + "\n")
    if not report["all_equal"]:
        sys.exit("error: a speculative answer differs from vanilla's")


if __name__ == "__main__":
    main()
