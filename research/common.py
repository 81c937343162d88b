"""What the research tools share: loading the target and head as generate.py runs them on a CPU,
timing plain steps and speculative rounds on chat prompts, and writing a report."""
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import generate as gen  # noqa: E402
import invariant  # noqa: E402
import speculative  # noqa: E402
from autoshape import cpu_name  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from cpu import pack_linears  # noqa: E402

PROMPTS = ["Explain how a refrigerator keeps food cold.", "Write a short story about a lighthouse keeper.",
           "What are the pros and cons of electric cars?", "How do I make a good cup of tea?"]


def run_header(script: str, argv) -> dict:
    """What every research report starts with: the command, when, and on what."""
    return dict(command=f"python research/{script} " + shlex.join(sys.argv[1:] if argv is None else argv),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"), hardware=cpu_name(),
                torch=torch.__version__, threads=torch.get_num_threads())


def write_report(out: Path, report: dict, title: str, lines: list):
    """OUT.json, and OUT.md (printed too): the title, the command and the machine, then lines."""
    markdown = "\n".join([f"# {title} ({report['threads']} threads, torch {report['torch']})", "",
                          f"- command: `{report['command']}`",
                          f"- hardware: {report['hardware']}; date {report['date']}", *lines]) + "\n"
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
