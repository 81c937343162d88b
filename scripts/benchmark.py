"""Plain decoding against EAGLE speculative decoding: on MT-bench, or on random weights of a real shape.

    python scripts/benchmark.py --compile --num_questions 16 --max_new_tokens 128 --methods eagle2 eagle3
    python scripts/benchmark.py --random_weights --model_name llama-2-7b --compile

MT-bench: every method in one process on the same prompts (later turns continue vanilla's answers), at
each of --temperatures. vanilla: one target forward per token; chain: the EAGLE-1/2 head guessing
--chain_depth tokens; eagle: EAGLE-1's static tree; eagle2, eagle3: the dynamic tree (--tree_tokens auto
measures its shape); lookup: prompt lookup alone; eagle2+lookup, eagle3+lookup: the tree plus --lookup
prompt-lookup nodes, decoded adaptively. More rows: --peers (transformers' generate), --eager_float32,
and with --batch_invariant plain decoding without the mode (its cost).

Random weights: (a) plain decoding's weight GB/s beside a device copy; (b) a round of eagle, eagle2 and
eagle3 at each --tree_sizes against a plain step timed the same way (compiled, else CUDA-graph replays on
CUDA, eager on a CPU); (c) the speedups these predict for each --tau; (d) with --tp_timing under torchrun,
the step without its all-reduces and the all-reduces alone. Both modes run tensor-parallel under torchrun
and write OUT.json (MT-bench: every answer's token ids) and OUT.md. Results: benchmarks/RESULTS.md.
"""
import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import defaults  # noqa: E402
import generate as gen  # noqa: E402
import invariant  # noqa: E402
import packages  # noqa: E402
import tp  # noqa: E402
from attention import use_attention  # noqa: E402
from autoshape import auto_tree, cpu_name, probe_prompts  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from compiling import compile_prefill, compile_round, compile_step, cuda_graph, device_sync  # noqa: E402
from cpu import pack_linears  # noqa: E402
from draft import Eagle3Draft, EagleDraft, draft_config_for, dynamic_tree_slots, eagle3_layer_ids  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from quantize import GROUPSIZES, mode_from_path, pack_int4, quantize_model  # noqa: E402
from speculative import Speculator  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from trees import mc_sim_7b_63, static_tree  # noqa: E402

METHODS = ("vanilla", "chain", "eagle", "eagle2", "eagle3", "lookup", "eagle2+lookup", "eagle3+lookup")
HEADS = {"eagle": ("draft_checkpoint_path", "EAGLE-1/2"), "eagle3": ("draft3_checkpoint_path", "EAGLE-3")}
HEAD_OF = {"chain": "eagle", "eagle": "eagle", "eagle2": "eagle", "eagle3": "eagle3", "lookup": None,
           "eagle2+lookup": "eagle", "eagle3+lookup": "eagle3"}  # the head each method runs
ADAPTIVE = ("eagle2+lookup", "eagle3+lookup")  # decoded with speculative_generate(adaptive=True)
PEERS = ("hf", "hf_prompt_lookup")  # --peers
EAGER_FLOAT32 = "vanilla_eager_float32"  # --eager_float32
NOT_INVARIANT = "vanilla_not_invariant"  # --batch_invariant: plain decoding without the mode
RANDOM_METHODS = ("eagle", "eagle2", "eagle3")
TREE_TOP_K, TREE_TOKENS = 10, 60  # the papers' dynamic tree: depth 6, and 8 for EAGLE-3
TREE_DEPTH = {"eagle2": 6, "eagle3": defaults.EAGLE3_DEPTH}
EAGLE3_DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' reduced vocabulary
# The shared data folder sits beside the checkout, or inside it where the checkout travels alone.
QUESTION_FILES = [ROOT.parent / "shared/data/mt_bench/question.jsonl", ROOT / "shared/data/mt_bench/question.jsonl"]
DEFAULT_QUESTIONS = next((f for f in QUESTION_FILES if f.is_file()), QUESTION_FILES[0])


def tree_tokens_arg(value: str):
    try:
        return value if value == "auto" else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tree nodes or 'auto', got {value!r}") from None


def model_config(name: str) -> ModelArgs:
    if name.endswith(".json"):
        return ModelArgs(**json.loads(Path(name).read_text())["model"])
    return ModelArgs.from_name(name)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dtypes = ["float32", "bfloat16", "float16"]
    add = p.add_argument
    add("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    add("--draft_checkpoint_path", type=Path, help="EAGLE-1/2 head (default: eagle/ beside the checkpoint)")
    add("--draft3_checkpoint_path", type=Path, help="EAGLE-3 head (default: eagle3/ beside the checkpoint)")
    add("--draft3_dtype", choices=dtypes, help="the EAGLE-3 head's dtype (default: --dtype)")
    add("--question_file", type=Path, default=DEFAULT_QUESTIONS, help="MT-bench format, one JSON per line")
    add("--num_questions", type=int, help="this many, taken in turn from each category (default: all)")
    add("--methods", nargs="+", choices=METHODS, help="default: all whose head is there; vanilla always runs")
    add("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    add("--max_new_tokens", type=int, default=256, help="per answer")
    add("--chain_depth", type=int, default=5, help="chain: guesses per round")
    add("--lookup", type=int, default=8, help="eagle2+lookup, eagle3+lookup: lookup nodes per tree")
    add("--lookup_alone", type=int, default=10, help="lookup (and --peers' prompt lookup): guesses per round")
    add("--tree_top_k", type=int, help=f"children per node (default {TREE_TOP_K}; auto searches unless given)")
    add("--tree_depth", type=int, help=f"eagle2's depth (default {TREE_DEPTH['eagle2']}; auto searches unless given)")
    add("--tree_depth3", type=int, help=f"eagle3's depth (default {TREE_DEPTH['eagle3']}; auto searches unless given)")
    add("--tree_tokens", type=tree_tokens_arg, default=TREE_TOKENS, help="nodes per tree, root included, or auto")
    add("--compile", action="store_true", help="compile the decode step and the rounds")
    add("--compile_prefill", action="store_true")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", choices=["auto", *dtypes], default="auto", help="auto: defaults.py's, as generate.py")
    add("--attention", choices=["auto", "sdpa", "triton"], default="auto")
    add("--batch_invariant", action="store_true", help="the target (vanilla's too) in batch-invariant mode")
    add("--seed", type=int, default=1234)
    add("--out", type=Path, help="path without suffix (default: benchmarks/mt_bench-MODEL or random-NAME)")
    add("--no_plot", action="store_true", help=argparse.SUPPRESS)  # no plot any more; older commands pass it
    add("--peers", action="store_true", help="add transformers' generate and its prompt lookup")
    add("--eager_float32", action="store_true", help="add plain decoding of a float32 copy, eager")
    add("--time_budget", type=float, help="seconds: no new question (or round) after them; recorded")
    add("--dry_run", action="store_true", help="check the arguments, print the plan and exit")
    add("--tp_timeout", type=float, default=tp.DEFAULT_TIMEOUT_S, help="under torchrun: seconds to wait for a rank")
    r = p.add_argument_group("random-weights mode").add_argument
    r("--random_weights", action="store_true")
    r("--model_name", help='a model.py config (e.g. llama-2-7b), or a JSON file {"model": {...}}')
    r("--tree_sizes", nargs="+", type=int, default=[16, 32, 48, 60, 64, 96, 128])
    r("--tau", nargs="+", type=float, default=[3.5, 4.0, 4.5], help="tokens per round to predict for")
    r("--steps", type=int, help="timed steps and rounds (default: 100 on CUDA, 10 on a CPU)")
    r("--prompt_length", type=int, default=128)
    r("--tp_timing", action="store_true", help="under torchrun: also the step without all-reduces, and those alone")
    r("--quantize", choices=["int8", "int4"], help="quantize the target in memory")
    r("--groupsize", type=int, default=32, help="int4 groupsize")
    args = p.parse_args(argv)

    errors = []

    def check(ok, message):
        if not ok:
            errors.append(message)

    check(not args.device.startswith("cuda") or torch.cuda.is_available() or args.dry_run,
          f"--device {args.device} requested but CUDA is not available")
    for flag, least in dict(max_new_tokens=1, num_questions=1, chain_depth=1, lookup=0, lookup_alone=1,
                            temperatures=0, time_budget=0, steps=1, prompt_length=1).items():
        value = getattr(args, flag)
        value = min(value) if isinstance(value, list) else value
        check(value is None or value >= least, f"--{flag} must be >= {least}, got {value}")
    check(not args.tp_timing or (args.random_weights and tp.launched_by_torchrun()),
          "--tp_timing times a tensor-parallel step of --random_weights: run it under "
          "python -m torch.distributed.run (--nproc_per_node 1 for the one-rank reference)")
    if args.random_weights:
        check(args.model_name is not None, "--random_weights needs --model_name (a model.py config name or a JSON file)")
        try:
            args.model_name and model_config(args.model_name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            errors.append(f"--model_name {args.model_name}: {e}")
        args.methods = [m for m in RANDOM_METHODS if m in (args.methods or RANDOM_METHODS)]
        check(args.methods, f"--random_weights measures rounds of {', '.join(RANDOM_METHODS)}; --methods names none")
        check(args.tree_tokens != "auto",
              "--random_weights measures fixed tree sizes: give --tree_tokens a number (the headline size)")
        check(args.quantize != "int4" or args.groupsize in GROUPSIZES,
              f"--groupsize must be one of {GROUPSIZES}, got {args.groupsize}")
        check(not (args.peers or args.batch_invariant),
              "--peers and --batch_invariant are for MT-bench runs (a checkpoint), not --random_weights")
        args.tree_top_k, args.tree_depth = args.tree_top_k or TREE_TOP_K, args.tree_depth or TREE_DEPTH["eagle2"]
    else:
        check(args.model_name is None and args.quantize is None,
              "--model_name and --quantize are for --random_weights; a checkpoint carries its own")
        check(args.question_file.is_file(), f"--question_file not found: {args.question_file}")
        check(args.checkpoint_path.is_file(),
              f"checkpoint not found: {args.checkpoint_path} (prepare one with scripts/prepare.sh)")
        heads = {head: getattr(args, flag) or args.checkpoint_path.parent / head for head, (flag, _) in HEADS.items()}
        args.draft_checkpoint_path, args.draft3_checkpoint_path = heads["eagle"], heads["eagle3"]
        if args.methods is None:  # every method whose head is on disk
            args.methods = [m for m in METHODS[1:] if HEAD_OF[m] is None or heads[HEAD_OF[m]].exists()]
        args.methods = ["vanilla"] + [m for m in METHODS[1:] if m in args.methods]
        for head, (flag, what) in HEADS.items():
            needing = " ".join(m for m in args.methods[1:] if HEAD_OF[m] == head)
            check(not needing or heads[head].exists(), f"methods {needing} need an {what} head: {heads[head]} not "
                  f"found (pass --{flag}, or leave them out of --methods)")
        check(not args.peers or importlib.util.find_spec("transformers"),
              "--peers needs transformers: pip install -r requirements-dev.txt")
    if errors:
        p.error("\n  ".join(errors))
    if args.dtype == "auto":  # as generate.py: eager on a CPU the mode holds in bf16 only
        eager_invariant = args.batch_invariant and not args.compile
        args.dtype = "bfloat16" if eager_invariant else defaults.row(args.device, args.compile).dtype
    problem = args.batch_invariant and invariant.problem(
        args.device, args.dtype, args.compile, mode_from_path(args.checkpoint_path)[0], tp.launched_by_torchrun())
    if problem:
        p.error(problem)
    name = f"mt_bench-{args.checkpoint_path.parent.name}"
    if args.random_weights:
        name = "random-" + (Path(args.model_name).stem if args.model_name.endswith(".json") else args.model_name)
    args.out = args.out or ROOT / "benchmarks" / name
    args.steps = args.steps or (100 if args.device.startswith("cuda") else 10)
    args.time_budget = float("inf") if args.time_budget is None else args.time_budget
    return args


# ---- shared by both modes ----------------------------------------------------------------
def allow_many_graphs():
    """Every tree size and temperature compiles its own graph of the same function: lift dynamo's
    per-function limit (8 by default), which would otherwise fall back or fail."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def header(args, argv) -> dict:
    hardware = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else \
        f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return dict(hardware=hardware, device=args.device, dtype=args.dtype, draft3_dtype=args.draft3_dtype or args.dtype,
                compiled=args.compile, attention=args.attention, torch=torch.__version__,
                batch_invariant=args.batch_invariant, tensor_parallel=args.shard.world_size if args.shard else 1,
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command="python scripts/benchmark.py " + shlex.join(sys.argv[1:] if argv is None else argv))


def header_markdown(report: dict, title: str) -> list:
    return [f"# {title}, {report['hardware']}", "", f"- date: {report['date']}", f"- command: `{report['command']}`",
            f"- device {report['device']}, dtype {report['dtype']}, compiled: {report['compiled']}, attention: "
            f"{report['attention']}, torch {report['torch']}" + (", batch-invariant target" if report["batch_invariant"] else "")]


def write_json(path: Path, report: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def seconds_per_call(fn, calls: int, device: str, warmup: int = 3) -> float:
    """Mean time of fn() over back-to-back calls (one sync at each end), after warm-ups (compiles, CUDA graphs)."""
    for _ in range(warmup):
        fn()
    device_sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    device_sync(device)
    return (time.perf_counter() - t) / calls


def copy_bandwidth_gb_s(device: str, repeats: int = 20) -> float:
    """A device-to-device copy, counted as read + write: the most a decode step's weight reads can
    reach. 1 GiB on CUDA, 256 MiB on a CPU: past any cache."""
    src = torch.ones((1 << 30) if device.startswith("cuda") else (256 << 20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / seconds_per_call(lambda: dst.copy_(src), repeats, device, warmup=1) / 1e9


def decode_speed(step_s: float, weight_bytes: int, copy_gb_s: float) -> dict:
    gb_s = weight_bytes / step_s / 1e9
    return dict(tokens_per_s=1 / step_s, step_ms=step_s * 1e3, gb_s=gb_s, fraction_of_copy=gb_s / copy_gb_s)


def step_timer(model: Transformer, step, prompt: torch.Tensor):
    """After prefilling prompt [1, L], a function that runs one greedy decode step (decode_one_token's
    signature) in place, one position further each call: what a CUDA graph replays."""
    token = gen.prefill(model, prompt, 0.0, None, None)
    input_pos = torch.tensor([prompt.size(1)], device=prompt.device)

    def one_step():
        token.copy_(step(model, token.clone(), input_pos, 0.0, None, None))
        input_pos.add_(1)
    return one_step


def plain_decoders(args, model: Transformer, stop_ids, name: str, compiled: bool) -> tuple:
    """({(name, T): decode(prompt_ids, max_new_tokens, warm_up=False) -> (ids, Forwards)}, the greedy step): plain
    decoding, compiled as generate.py compiles it (CUDA graphs on CUDA; packages where they serve, as for rounds)."""
    step, first = gen.decode_one_token, gen.prefill
    if compiled:
        step = compile_step(gen.decode_one_token, args.device, model)
        if args.compile_prefill:
            first = compile_prefill(gen.prefill, args.device, model)
    greedy = step
    if compiled and packages.usable(args.device, 0.0, model):
        greedy = packages.packaged_step(model, packages.folder(args.checkpoint_path))

    def decode(T, prompt_ids, max_new_tokens, warm_up=False):  # (a warm-up is just a shorter call here)
        prompt = torch.tensor([prompt_ids], device=args.device)
        ids = gen.generate(model, prompt, max_new_tokens, stop_ids=stop_ids, temperature=T, prefill_fn=first,
                           decode_fn=greedy if T == 0 else step)[0]
        return ids, gen.Forwards([1] * (len(ids) - 1))  # one token per forward after the prefill
    return {(name, T): partial(decode, T) for T in args.temperatures}, greedy


# ---- MT-bench --------------------------------------------------------------------------------
def load_questions(path: Path, n=None) -> list:
    """The question file's records; with n, n of them taken in turn from each category (file order kept)."""
    questions = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except ValueError:
            q = None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise ValueError(f"{path}:{i}: expected a JSON object with a non-empty list of strings 'turns'")
        questions.append(dict(q, question_id=q.get("question_id", i), category=q.get("category", "all")))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    by_category = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    in_turn = [qs[rank] for rank in range(len(questions)) for qs in by_category.values() if rank < len(qs)]
    return sorted(in_turn[:n], key=questions.index)


def conversation(tokenizer, q: dict, turn: int, answers: list) -> list:
    """The prompt ids of q's turn (0-based) in the chat template: its user turns up to `turn`, each
    earlier one followed by its answer in answers."""
    messages = [{"role": "user", "content": q["turns"][0]}]
    for i in range(turn):
        messages += [{"role": "assistant", "content": answers[i]}, {"role": "user", "content": q["turns"][i + 1]}]
    return tokenizer.apply_chat_template(messages)


def tree_shapes(args, model: Transformer, drafts: dict, probes: list, stop_ids) -> dict:
    """{(method, T): the Speculator's tree arguments, or None where --tree_tokens auto chose plain
    decoding}. A +lookup method grows its base method's tree (measured once) plus lookup nodes."""
    fixed = {"chain": dict(static=static_tree([[0] * d for d in range(1, args.chain_depth + 1)])),
             "eagle": dict(static=static_tree(mc_sim_7b_63)), "lookup": dict(lookup=args.lookup_alone)}
    shapes = {}
    for method in args.methods[1:]:
        base = method.removesuffix("+lookup")
        for T in args.temperatures:
            if method in fixed:
                shapes[method, T] = fixed[method]
            else:
                shape = shapes[base, T] if (base, T) in shapes else \
                    dynamic_shape(args, base, T, model, drafts, probes, stop_ids)
                shapes[method, T] = dict(shape, lookup=args.lookup) if shape and method != base else shape
    return shapes


def dynamic_shape(args, method: str, T: float, model: Transformer, drafts: dict, probes: list, stop_ids):
    """eagle2's or eagle3's tree: the flags', or with --tree_tokens auto autoshape.py's choice from
    costs measured on probe prompts in this run's mode."""
    depth = args.tree_depth3 if method == "eagle3" else args.tree_depth
    if args.tree_tokens != "auto":
        return dict(tree_top_k=args.tree_top_k or TREE_TOP_K, tree_depth=depth or TREE_DEPTH[method],
                    tree_tokens=args.tree_tokens)
    head = args.draft3_checkpoint_path if method == "eagle3" else args.draft_checkpoint_path
    print(f"{method} at temperature {T:g}:", file=sys.stderr)
    return auto_tree(model, drafts[HEAD_OF[method]], probes, args.device, args.compile, (args.checkpoint_path, head),
                     args.tree_top_k, depth, stop_ids=stop_ids, temperature=T)


def build_decoders(args, model: Transformer, drafts: dict, stop_ids, context: int, probes) -> tuple:
    """({(method, T): decode(prompt_ids, max_new_tokens, warm_up=False) -> (ids, Forwards)}, the tree shapes,
    the Speculators, vanilla's step). All methods share the target, the drafts and their caches, allocated once
    for the largest tree before anything is compiled."""
    shapes = tree_shapes(args, model, drafts, probes, stop_ids)
    specs = {key: Speculator(model, drafts.get(HEAD_OF[key[0]]), stop_ids=stop_ids, temperature=key[1], **shape)
             for key, shape in shapes.items() if shape is not None}
    room = context + 2 * (max([s.depth for s in specs.values()], default=0) + 1)  # the last round's overshoot
    model.setup_caches(1, room + max([s.n_nodes for s in specs.values()], default=0))
    for head, draft in drafts.items():
        regions = [s.draft_region() for (m, _), s in specs.items() if HEAD_OF[m] == head]
        draft.setup_caches(1, room + max(regions, default=0))
    if args.compile:
        allow_many_graphs()
    decoders, step = plain_decoders(args, model, stop_ids, "vanilla", args.compile)
    for T in args.temperatures:
        for method in args.methods[1:]:
            if (method, T) in specs:  # generate.py's decoder: caches, compiled round, its checks
                decoders[method, T] = gen.speculative_decoder(args, specs[method, T], context, method in ADAPTIVE)
            else:  # --tree_tokens auto chose plain decoding
                decoders[method, T] = decoders["vanilla", T]
    return decoders, shapes, specs, step


def build_peers(args, model: Transformer, stop_ids) -> dict:
    """{(peer, T): decode} for --peers: transformers' generate on a copy of the target's weights (same
    dtype, device, stop tokens), eager, with its dynamic cache (its prompt lookup refuses a static one)."""
    import convert_hf_checkpoint  # only here: it imports gguf, and hf_model_from_ours transformers

    hf = convert_hf_checkpoint.hf_model_from_ours(model)
    stop = sorted(stop_ids)

    def decode(options, prompt_ids, max_new_tokens, warm_up=False):  # (a warm-up is just a shorter call here)
        prompt = torch.tensor([prompt_ids], device=args.device)
        lengths = []

        def record_length(input_ids, scores, **kwargs):  # checked once per forward; never stops
            lengths.append(input_ids.shape[1])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        with torch.inference_mode():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                              eos_token_id=stop or None, pad_token_id=stop[0] if stop else None, use_cache=True,
                              stopping_criteria=[record_length], **options)
        # counted as our rounds: the first forward is the prefill (prompt lookup may emit more there)
        return out[0, len(prompt_ids):].tolist(), gen.Forwards([b - a for a, b in zip(lengths, lengths[1:])])

    decoders = {}
    for T in args.temperatures:  # the whole distribution, as ours (generate's default keeps the top 50)
        options = dict(do_sample=True, temperature=T, top_k=0, top_p=1.0) if T > 0 else dict(do_sample=False)
        decoders["hf", T] = partial(decode, options)
        decoders["hf_prompt_lookup", T] = partial(decode, dict(options, prompt_lookup_num_tokens=args.lookup_alone))
    return decoders


def summarize(answers: list, header_fields: dict, peaks: dict, specs: dict) -> list:
    """One record per method x temperature x category ("overall" first): tok/s, speedup over vanilla in
    the same group, tau (tokens per target forward, bonus included), adaptive decoding's plain steps and
    tau over the rounds alone, at T=0 the fraction of answers equal to vanilla's, and the tokens a round verifies."""
    records, groups = [], {}
    for a in answers:
        for category in ("overall", a["category"]):
            groups.setdefault((a["method"], a["temperature"], category), []).append(a)
    for (method, T, category), group in groups.items():
        tokens, seconds, rounds, accepted, plain_steps = (  # a plain step emits 1 token
            sum(a[key] for a in group) for key in ("tokens", "seconds", "rounds", "accepted", "plain_steps"))
        records.append(dict(
            header_fields, method=method, temperature=T, category=category,
            questions=len({a["question_id"] for a in group}), answers=len(group), tokens=tokens, rounds=rounds,
            seconds=seconds, tokens_per_s=tokens / seconds, speedup=None,
            mean_accepted=accepted / rounds if rounds else None, plain_steps=plain_steps,
            round_tau=(accepted - plain_steps) / (rounds - plain_steps) if rounds > plain_steps else None,
            equal_to_vanilla=(sum(a["equal_to_vanilla"] for a in group) / len(group)) if T == 0 else None,
            peak_memory_gb=peaks[method, T], tree_tokens=specs[method, T].n_nodes if (method, T) in specs else None))
    vanilla = {(r["temperature"], r["category"]): r["tokens_per_s"] for r in records if r["method"] == "vanilla"}
    for r in records:
        r["speedup"] = r["tokens_per_s"] / vanilla[r["temperature"], r["category"]]
    order = {m: i for i, m in enumerate(METHODS + PEERS + (EAGER_FLOAT32, NOT_INVARIANT))}
    return sorted(records, key=lambda r: (r["category"] != "overall", r["category"], r["temperature"], order[r["method"]]))


def run_mt_bench(args, argv=None) -> dict:
    device, dtype = args.device, getattr(torch, args.dtype)
    model = load_model(args.checkpoint_path, device, dtype, args.shard, args.attention)
    if args.batch_invariant:
        invariant.enable(model)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    stop_ids = tokenizer.stop_ids
    paths = {"eagle": args.draft_checkpoint_path, "eagle3": args.draft3_checkpoint_path}
    draft_dtypes = {"eagle": dtype, "eagle3": getattr(torch, args.draft3_dtype or args.dtype)}
    drafts = {head: load_draft(paths[head], model.config, device, draft_dtypes[head], args.attention, arch=head)
              for head in dict.fromkeys(HEAD_OF[m] for m in args.methods[1:] if HEAD_OF[m] is not None)}
    questions = load_questions(args.question_file, args.num_questions)
    start = time.perf_counter()

    # Room for the longest conversation: every turn, each answer up to max_new_tokens (plus slack for
    # an answer that re-encodes into more tokens than it was generated as).
    longest = max(len(conversation(tokenizer, q, len(q["turns"]) - 1, [""] * len(q["turns"]))) for q in questions)
    most_turns = max(len(q["turns"]) for q in questions)
    context = min(model.config.block_size, longest + most_turns * (args.max_new_tokens + 32))
    probe_ids = conversation(tokenizer, questions[0], 0, [])
    more = build_peers(args, model, stop_ids) if args.peers else {}  # from the weights before packing
    if not args.compile:  # eager half precision on a CPU: weights in oneDNN's layout (a no-op elsewhere)
        for module in (model, *drafts.values()):
            pack_linears(module)
    decoders, shapes, specs, step = build_decoders(args, model, drafts, stop_ids, context, probe_prompts(tokenizer))
    for name, wanted, copy_dtype, compiled in ((EAGER_FLOAT32, args.eager_float32, torch.float32, False),
                                               (NOT_INVARIANT, args.batch_invariant, dtype, args.compile)):
        if wanted:  # plain decoding of a copy of the target: eager float32, or without the mode
            copy = load_model(args.checkpoint_path, device, copy_dtype, args.shard, args.attention)
            if not compiled:
                pack_linears(copy)
            copy.setup_caches(1, context)
            more.update(plain_decoders(args, copy, stop_ids, name, compiled)[0])
    decoders.update(more)
    args.methods = [*args.methods, *dict.fromkeys(m for m, _ in more)]

    # compiles, with --compile; a speculative warm-up also takes plain steps, so that no graph compiles in a timed answer
    for decode in tqdm(decoders.values(), desc="warm-up", file=sys.stderr):
        decode(probe_ids, min(args.max_new_tokens, gen.WARM_UP_TOKENS), warm_up=True)
    # vanilla's step against the copy bandwidth, in this run, before the answers
    step_s = seconds_per_call(step_timer(model, step, torch.tensor([probe_ids], device=device)), 40, device)
    weight_bytes, copy_gb_s = gen.model_bytes_per_token(model), copy_bandwidth_gb_s(device)
    decode_step = dict(decode_speed(step_s, weight_bytes, copy_gb_s), weight_bytes=weight_bytes, copy_gb_s=copy_gb_s)

    answers, peaks, asked = [], {key: 0.0 for key in decoders}, []
    bar = tqdm(total=sum(len(q["turns"]) for q in questions) * len(decoders), desc="MT-bench answers", unit="answer",
               file=sys.stderr)
    for index, q in enumerate(questions):
        if asked and time.perf_counter() - start > args.time_budget:  # the first question is always asked
            print(f"--time_budget {args.time_budget:g} s reached: {len(asked)} of {len(questions)} questions asked",
                  file=sys.stderr)
            break
        asked.append(q)
        for T in args.temperatures:
            replies = []  # vanilla's answers: the conversation every method continues
            for turn in range(len(q["turns"])):
                prompt_ids = conversation(tokenizer, q, turn, replies)
                max_new = min(args.max_new_tokens, context - len(prompt_ids))
                if max_new < 1:
                    raise ValueError(f"question {q['question_id']} turn {turn + 1} does not fit the {context}-token context")
                for method in args.methods:
                    torch.manual_seed(args.seed + 1000 * index + turn)  # the same seed for every method
                    if device.startswith("cuda"):
                        torch.cuda.reset_peak_memory_stats(device)
                    device_sync(device)
                    t = time.perf_counter()
                    ids, forwards = decoders[method, T](prompt_ids, max_new)
                    device_sync(device)
                    seconds = time.perf_counter() - t
                    peaks[method, T] = max(peaks[method, T], gen.peak_memory_gb(device))
                    if method == "vanilla":
                        reference = ids
                    # rounds: target forwards after the prefill, adaptive decoding's plain steps included
                    answers.append(dict(question_id=q["question_id"], category=q["category"], turn=turn + 1,
                                        method=method, temperature=T, prompt_tokens=len(prompt_ids), tokens=len(ids),
                                        seconds=seconds, rounds=len(forwards.emitted), accepted=sum(forwards.emitted),
                                        plain_steps=forwards.plain_steps,
                                        equal_to_vanilla=ids == reference if T == 0 else None, ids=ids))
                    bar.set_postfix_str(f"q{q['question_id']} T={T:g} {method}: {len(ids) / seconds:.1f} tok/s")
                    bar.update()
                replies.append(tokenizer.decode([i for i in reference if i not in stop_ids]))
    bar.close()

    fields = dict(header(args, argv), model=args.checkpoint_path.parent.name)
    if args.peers:
        fields["transformers"] = importlib.import_module("transformers").__version__
    records = summarize(answers, {k: fields[k] for k in ("hardware", "model", "dtype", "compiled", "date", "command")},
                        peaks, specs)
    return dict(fields, mode="mt_bench", weight_bytes_per_rank=tp.weight_bytes(model), decode_step=decode_step,
                drafts={head: str(paths[head]) for head in drafts}, question_file=str(args.question_file),
                questions=len(asked), questions_left_out=len(questions) - len(asked),
                max_new_tokens=args.max_new_tokens, context=context, seed=args.seed,
                methods=method_notes(args, shapes, fields.get("transformers")),
                peak_memory_note="GPU: peak reserved per method; CPU: the whole process's peak RSS, shared by all methods",
                records=records, answers=answers)


def method_notes(args, shapes, transformers_version=None) -> dict:
    hybrid = f"with {args.lookup} more tree nodes from prompt lookup, decoded adaptively"
    notes = {"vanilla": "one target forward per token",
             "chain": f"static chain of {args.chain_depth} guesses (EAGLE-1/2 head, no tree)",
             "eagle": "EAGLE-1 static tree mc_sim_7b_63: 26 nodes, depth 5",
             "eagle2": "EAGLE-2 dynamic tree (EAGLE-1/2 head)", "eagle3": "EAGLE-3 head, dynamic tree",
             "lookup": f"prompt lookup alone: {args.lookup_alone} guesses from the longest earlier match, no draft",
             "eagle2+lookup": f"as eagle2, {hybrid}", "eagle3+lookup": f"as eagle3, {hybrid}",
             NOT_INVARIANT: "plain decoding of a copy of the target without batch invariance: the mode's cost",
             EAGER_FLOAT32: "plain decoding, eager, float32 (a copy of the weights)",
             "hf": f"transformers {transformers_version} model.generate, same weights, eager, SDPA; at T>0 top_k=0, top_p=1",
             "hf_prompt_lookup": f"as hf, with prompt_lookup_num_tokens {args.lookup_alone}"}
    auto = args.tree_tokens == "auto"
    for method in ("eagle2", "eagle3", "eagle2+lookup", "eagle3+lookup"):
        chosen = [f"T={T:g}: " + ("vanilla decoding" if s is None else f"top_k {s['tree_top_k']}, depth "
                                  f"{s['tree_depth']}, {s['tree_tokens']} tokens") for (m, T), s in shapes.items() if m == method]
        if chosen:
            notes[method] += (" (--tree_tokens auto chose " if auto else ": ") + ", ".join(chosen) + (")" if auto else "")
    return {m: notes[m] for m in args.methods}


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def mt_bench_markdown(report: dict) -> str:
    step = report["decode_step"]
    lines = [*header_markdown(report, f"MT-bench: {report['model']}"),
             f"- heads: {', '.join(f'{k}: {v}' for k, v in report['drafts'].items()) or 'none'}",
             f"- {report['questions']} questions (all turns) from {Path(report['question_file']).name}, "
             f"up to {report['max_new_tokens']} new tokens per answer"
             + (f" ({report['questions_left_out']} more left out by --time_budget)" if report["questions_left_out"] else ""),
             *[f"- {m}: {note}" for m, note in report["methods"].items()],
             f"- peak memory: {report['peak_memory_note']}",
             f"- plain decode step (vanilla, T=0, mean of 40): {step['step_ms']:.2f} ms, {step['gb_s']:.1f} GB/s of "
             f"weights = {step['fraction_of_copy']:.0%} of a copy's {step['copy_gb_s']:.1f} GB/s (this run)",
             "", "τ: tokens per target forward; of rounds: over the speculative rounds alone, without adaptive "
             "decoding's plain steps (1 token each).", "",
             "| method | temperature | tok/s | speedup | τ | τ of rounds | plain steps | equal to vanilla | "
             "peak memory (GB) | tokens | forwards |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in report["records"] if r["category"] == "overall"):
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}× | "
                     f"{_fmt(r['mean_accepted'])} | {_fmt(r['round_tau'])} | {r['plain_steps']} | "
                     f"{_fmt(r['equal_to_vanilla'], '.0%')} | {r['peak_memory_gb']:.2f} | {r['tokens']} | {r['rounds']} |")
    methods = list(report["methods"])[1:]
    lines += ["", "Per category: vanilla tok/s, and speedup (τ) of each method.", "",
              "| category | temperature | vanilla tok/s | " + " | ".join(methods) + " |",
              "|---|---|---|" + "---|" * len(methods)]
    by_key = {(r["category"], r["temperature"], r["method"]): r for r in report["records"]}
    for category, T in dict.fromkeys((r["category"], r["temperature"]) for r in report["records"]):
        cells = [f"{by_key[category, T, m]['speedup']:.2f}× ({_fmt(by_key[category, T, m]['mean_accepted'])})"
                 for m in methods]
        lines.append(f"| {category} | {T:g} | {by_key[category, T, 'vanilla']['tokens_per_s']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- random weights: bandwidth and round cost of a real-shaped model -------------------------
def random_modules(config: ModelArgs, methods, device: str, dtype: torch.dtype, shard=None) -> tuple:
    """The target (with a tp.Shard, this rank's part) and the heads the methods need ({"eagle": EAGLE-1/2,
    "eagle3": EAGLE-3 with the published reduced vocabulary}), built on the meta device and allocated
    on `device` in `dtype` (a 7B model never exists in float32): norms 1, the rest N(0, 0.02^2). Every
    rank draws the same replicated weights (same seed, same shapes in the same order)."""
    with torch.device("meta"):
        model = Transformer(config)
        drafts = {"eagle": EagleDraft(draft_config_for(config)),
                  "eagle3": Eagle3Draft(draft_config_for(config), min(EAGLE3_DRAFT_VOCAB, config.vocab_size),
                                        eagle3_layer_ids(config.n_layer))}
    drafts = {arch: d for arch, d in drafts.items() if arch in {HEAD_OF[m] for m in methods}}
    if shard is not None:
        tp.shard_model(model, shard)
    for module in (model, *drafts.values()):
        module.to(dtype=dtype).to_empty(device=device).eval()
        for name, p in module.named_parameters():
            p.data.fill_(1.0) if name.endswith("norm.weight") else p.data.normal_(0.0, 0.02)
    if config.tie_embeddings:  # to_empty made two tensors of the shared one
        model.output.weight = model.tok_embeddings.weight
    if "eagle3" in drafts:  # a buffer, not a weight: to_empty left it undefined
        drafts["eagle3"].vocab = torch.arange(drafts["eagle3"].draft_vocab_size, device=device)
    return model, drafts


def round_plan(args) -> list:
    """(method, tree size) in the order measured: each method's headline size first (what a short
    --time_budget keeps), then the other sizes."""
    dynamic = [m for m in ("eagle2", "eagle3") if m in args.methods]
    first = [(m, args.tree_tokens) for m in dynamic] + [("eagle", 26)] * ("eagle" in args.methods)
    return first + [(m, T) for m in dynamic for T in sorted(args.tree_sizes) if T != args.tree_tokens]


@torch.no_grad()
def run_random_weights(args, argv=None) -> dict:
    start = time.perf_counter()
    device, dtype, cuda = args.device, getattr(torch, args.dtype), args.device.startswith("cuda")
    config = model_config(args.model_name)
    model, drafts = random_modules(config, args.methods, device, dtype, args.shard)  # heads stay in dtype
    parameters = sum(p.numel() for p in model.parameters())
    quantized = quantize_model(model, args.quantize, args.groupsize) if args.quantize else []
    pack_int4(model)
    for module in (model, *drafts.values()):
        use_attention(module, args.attention)
    plan = round_plan(args)
    warmup, P, depth = 3, args.prompt_length, max(args.tree_depth, 5)  # 5: the static tree's depth
    largest = max(T for _, T in plan)
    # the prompt, warm-up and timed calls (each emits at most depth + 1 tokens; two more for a CUDA-graph
    # capture) and the last round's overshoot; the tree region comes on top
    context = P + (warmup + args.steps + 2) * (depth + 1) + 2 * (depth + 1)
    model.setup_caches(1, context + largest)
    for draft in drafts.values():
        draft.setup_caches(1, context + max(largest, dynamic_tree_slots(args.tree_top_k, args.tree_depth)))
    timing = "compiled" if args.compile else "cuda graph" if cuda else "eager"  # the step's and every round's
    if args.compile:
        allow_many_graphs()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    quantize = args.quantize if args.quantize != "int4" else f"int4 g{args.groupsize}"
    report = dict(header(args, argv), mode="random_weights", model=args.model_name, config=config.to_dict(),
                  weights="random", quantize=quantize, quantized=quantized, parameters=parameters,
                  weight_bytes_per_token=gen.model_bytes_per_token(model), prompt_length=P, steps=args.steps,
                  tree_top_k=args.tree_top_k, tree_depth=args.tree_depth, timing=timing,
                  copy_gb_s=copy_bandwidth_gb_s(device), time_budget_s=args.time_budget, rounds=[], skipped=[],
                  tp_timing=None, weight_bytes_per_rank=tp.weight_bytes(model))

    def save():  # after every measurement: a run stopped from outside keeps what it measured
        report.update(peak_memory_gb=gen.peak_memory_gb(device), seconds=time.perf_counter() - start)
        write_json(Path(str(args.out) + ".json"), report)

    def timed(fn):  # as this run times it: compiled (or eager) as it is, or replayed as a CUDA graph
        return cuda_graph(fn) if timing == "cuda graph" else fn

    def plain_step():  # a fresh decode step: a compiled one sees the model's hooks as they are now
        step = compile_step(gen.decode_one_token, device, model) if args.compile else gen.decode_one_token
        return timed(step_timer(model, step, prompt))

    # (a) plain decoding: one step per call, positions after the prompt
    prompt = torch.randint(0, config.vocab_size, (1, P), device=device)
    t = time.perf_counter()
    step_s = seconds_per_call(plain_step(), args.steps, device, warmup)
    report["vanilla"] = dict(decode_speed(step_s, report["weight_bytes_per_token"], report["copy_gb_s"]),
                             warmup_s=time.perf_counter() - t - step_s * args.steps)
    save()
    if args.tp_timing:
        report["tp_timing"] = tp_step_timing(model, plain_step, step_s, args)

    # (b) one round per (method, size): draft catch-up and growth, verify, accept, compaction
    for i, (method, T) in enumerate(plan):
        if time.perf_counter() - start > args.time_budget:
            report["skipped"] = [dict(method=m, tree_tokens=n, why="time budget") for m, n in plan[i:]]
            print(f"--time_budget {args.time_budget:g} s reached: {len(plan) - i} rounds left out", file=sys.stderr)
            break
        tree = dict(static=static_tree(mc_sim_7b_63)) if method == "eagle" else \
            dict(tree_top_k=args.tree_top_k, tree_depth=args.tree_depth, tree_tokens=T)
        spec = Speculator(model, drafts[HEAD_OF[method]], **tree)
        spec.setup(1, context)
        if args.compile:
            compile_round(spec, args.compile_prefill)
        spec.prefill(prompt, context - P - 2 * (depth + 1))
        t = time.perf_counter()
        round_s = seconds_per_call(timed(spec.round), args.steps, device, warmup)
        report["rounds"].append(dict(method=method, tree_tokens=T, timing=timing, round_ms=round_s * 1e3,
                                     cost_vs_step=round_s / step_s, warmup_s=time.perf_counter() - t - round_s * args.steps))
        print(f"{method} {T:4d} tree tokens ({timing}): a round takes {round_s * 1e3:.2f} ms = "
              f"{round_s / step_s:.2f} plain steps", file=sys.stderr)
        save()

    # (c) what those costs predict: a round emits tau tokens, plain decoding needs tau steps for them
    report["predicted"] = [dict(tau=tau, method=r["method"], tree_tokens=r["tree_tokens"], timing=r["timing"],
                                speedup=tau / r["cost_vs_step"]) for tau in args.tau for r in report["rounds"]]
    save()
    return report


def tp_step_timing(model: Transformer, plain_step, step_s: float, args) -> dict:
    """(d) --tp_timing: the tensor-parallel step (step_s) against the same step without its all-reduces (each
    rank computes its shard and nothing else: wrong tokens, the same work) and against the all-reduces alone,
    chained as in the model. If the step is its compute plus its collectives, step = without + all-reduces."""
    n = tp.set_all_reduces(model, False)
    local_s = seconds_per_call(plain_step(), args.steps, args.device)
    tp.set_all_reduces(model, True)
    x = torch.zeros(1, 1, model.config.dim, dtype=model.norm.weight.dtype, device=args.device)

    def all_reduces():
        y = x
        for _ in range(n):
            y = y + tp.all_reduce_sum(y)
        return y

    if args.compile:
        all_reduces = torch.compile(all_reduces, mode="reduce-overhead", fullgraph=True)
    reduce_s = seconds_per_call(all_reduces, args.steps, args.device)
    print(f"tensor parallel over {args.shard.world_size}: step {step_s * 1e3:.2f} ms, without all-reduces "
          f"{local_s * 1e3:.2f} ms, {n} all-reduces alone {reduce_s * 1e3:.2f} ms", file=sys.stderr)
    return dict(step_ms=step_s * 1e3, step_without_all_reduces_ms=local_s * 1e3, all_reduces_ms=reduce_s * 1e3,
                overhead_ms=(step_s - local_s) * 1e3, all_reduces_per_step=n, all_reduce_bytes=x.numel() * x.element_size())


def random_weights_markdown(report: dict) -> str:
    v, rounds = report["vanilla"], report["rounds"]
    quantized = f", {report['quantize']}" if report["quantize"] else ""
    lines = [*header_markdown(report, f"{report['model']} (random weights{quantized})"),
             f"- {report['parameters'] / 1e9:.3f} B parameters; a step reads {report['weight_bytes_per_token'] / 1e9:.3f} "
             f"GB of weights; peak memory {report['peak_memory_gb']:.1f} GB; whole run {report['seconds']:.0f} s",
             f"- prompt {report['prompt_length']} tokens; {report['steps']} timed steps and rounds, {report['timing']}; "
             f"random heads; EAGLE-2/3 top_k {report['tree_top_k']}, depth {report['tree_depth']}",
             *[f"- {line}" for line in report["quantized"]],
             "", "## (a) plain decoding against the copy bandwidth", "",
             "| tok/s | step (ms) | weights GB/s | copy GB/s (read + write) | fraction of copy |", "|---|---|---|---|---|",
             f"| {v['tokens_per_s']:.1f} | {v['step_ms']:.2f} | {v['gb_s']:.1f} | {report['copy_gb_s']:.1f} | "
             f"{v['fraction_of_copy']:.0%} |", "",
             "## (b) one round against one plain step timed the same way", "",
             "| method | tree tokens | round (ms) | cost in plain steps | warm-up incl. compile (s) |", "|---|---|---|---|---|",
             *[f"| {r['method']} | {r['tree_tokens']} | {r['round_ms']:.2f} | {r['cost_vs_step']:.2f} | {r['warmup_s']:.1f} |"
               for r in rounds]]
    if report["skipped"]:
        lines += ["", "Left out by --time_budget: " + ", ".join(f"{s['method']} {s['tree_tokens']}" for s in report["skipped"])]
    lines += ["", "## (c) predicted speedup = τ × step / round", "",
              "| τ | " + " | ".join(f"{r['method']} {r['tree_tokens']}" for r in rounds) + " |", "|---|" + "---|" * len(rounds)]
    for tau in dict.fromkeys(p["tau"] for p in report["predicted"]):
        lines.append(f"| {tau:g} | " + " | ".join(f"{p['speedup']:.2f}×" for p in report["predicted"] if p["tau"] == tau) + " |")
    t = report["tp_timing"]
    if t is not None:
        lines += ["", f"## (d) where a tensor-parallel step's time goes ({report['tensor_parallel']} ranks, "
                      f"{report['weight_bytes_per_rank'] / 1e9:.3f} GB of weights per rank)", "",
                  "| step (ms) | without all-reduces (ms) | overhead (ms) | all-reduces alone (ms) | all-reduces per step |",
                  "|---|---|---|---|---|",
                  f"| {t['step_ms']:.2f} | {t['step_without_all_reduces_ms']:.2f} | {t['overhead_ms']:.2f} | "
                  f"{t['all_reduces_ms']:.2f} | {t['all_reduces_per_step']} of {t['all_reduce_bytes']} bytes |"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        what = (f"random weights {args.model_name}{' ' + args.quantize if args.quantize else ''}: rounds of "
                + ", ".join(f"{m} {T}" for m, T in round_plan(args)) if args.random_weights
                else f"MT-bench {args.checkpoint_path}: {' '.join(args.methods)} at T={args.temperatures}")
        print(f"dry run: {what}; --device {args.device}, compile {args.compile}, time budget {args.time_budget:g} s, "
              f"out {args.out}", file=sys.stderr)
        return None
    try:  # under torchrun: this rank's part of the target, and its device (tp.py)
        args.shard, args.device = tp.start(args.device, args.tp_timeout, vars(args))
        torch.manual_seed(args.seed)
        report = run_random_weights(args, argv) if args.random_weights else run_mt_bench(args, argv)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    tp.finish()
    if args.shard is not None and args.shard.rank > 0:
        return report  # rank 0 writes the files
    out = str(args.out)  # not with_suffix: "random-llama-3.1-8b" has a dot of its own
    write_json(Path(out + ".json"), report)
    Path(out + ".md").write_text((random_weights_markdown if args.random_weights else mt_bench_markdown)(report))
    print(f"wrote {out}.json and .md", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
