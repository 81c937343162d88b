"""Speed of vanilla decoding and of EAGLE speculative decoding on MT-bench, side by side.

    python scripts/benchmark.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth \\
        --compile --num_questions 16 --max_new_tokens 128 --out benchmarks/mt_bench-smollm2

Methods, run in one process on exactly the same prompts so that their ratios are side by side:
    vanilla  one target forward per token: the reference for speedup and for output equality
    chain    the EAGLE draft without a tree: a chain of --chain_depth guesses per round
    eagle    EAGLE-1's static tree mc_sim_7b_63 (26 nodes, depth 5)
    eagle2   EAGLE-2's dynamic tree (--tree_top_k, --tree_depth, --tree_tokens; "auto" measures)
    eagle3   an EAGLE-3 head (--draft3_checkpoint_path) growing the dynamic tree (--tree_depth3)
    lookup   prompt lookup alone (--lookup_alone guesses from the longest earlier match), no draft
    eagle2+lookup, eagle3+lookup   the dynamic tree with --lookup more nodes of lookup's guesses,
             decoded adaptively (rounds or plain steps, whichever is faster as the answer goes):
             what generate.py runs for --speculate eagle2/eagle3 by default
at each of --temperatures (default 0 and 1). Every MT-bench question is asked in its two turns
with the chat template: turn 1 is answered, the answer appended, then turn 2 is answered. Turn 2
follows vanilla's answer to turn 1 at the same temperature for every method, so that all methods
decode the same prompts (at temperature 0 their answers are equal anyway). An answer's time is
the whole call, prefill included; tokens/s is total tokens over total time.

--peers adds Hugging Face transformers, the baseline EAGLE's published speedups are measured
against, as two more rows on the same weights, prompts, dtype, device and stop tokens:
    hf                 model.generate: greedy at T=0, at T>0 sampling with top_k=0, top_p=1
    hf_prompt_lookup   the same with prompt-lookup decoding (--prompt_lookup_num_tokens)

Writes OUT.json (one record per method x temperature x category, "overall" included), OUT.md
(tables) and OUT.png (speedups; needs matplotlib from requirements-dev.txt, or pass --no_plot).

    python scripts/benchmark.py --random_weights --model_name llama-2-7b --compile --out benchmarks/llama-2-7b

Random-weights mode builds a real-shaped model (any model.py config name) with random weights
directly on the device, no download (--quantize int8/int4: quantized in memory there), and
measures (a) vanilla decode tok/s and the weight bandwidth it achieves, next to a device-to-device
copy measured in the same run, (b) one round of each speculative method (random drafts: eagle's
static tree, eagle2 and eagle3 at each --tree_sizes) against one vanilla step timed the same way,
and (c) the speedup those costs predict for each --tau. Timed the same way: with --compile, the
first --compiled_rounds rounds (the headline --tree_tokens first) and the step are compiled; the
other rounds are replays of the eager round captured in a CUDA graph ("cuda graph": the kernels
without their launch overhead, and no compile per size) on CUDA, eager elsewhere, each against a
step timed in the same way. Writes OUT.json (after every measurement) and OUT.md.

--time_budget SECONDS stops either mode in time (no new question, no new round; what was left out
is recorded), and --dry_run only checks the arguments (scripts/gpu_check.sh --dry_run).

Both modes run tensor-parallel under torchrun (tp.py; rank 0 writes the files, which record
"tensor_parallel" and the weight bytes each rank holds). With --tp_timing, random-weights mode
adds (d): the compiled decode step next to the same step without its all-reduces and the
all-reduces alone, to show what the collectives cost (benchmarks/README.md has the commands):

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 scripts/benchmark.py \
        --random_weights --model_name SmolLM2-1.7B --tp_timing --compile
"""
import argparse
import json
import os
import resource
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import generate as gen  # noqa: E402
import speculative  # noqa: E402
import tp  # noqa: E402
from checkpoint import load_draft, load_model  # noqa: E402
from draft import Eagle3Draft, EagleDraft, draft_config_for, dynamic_tree_slots, eagle3_layer_ids  # noqa: E402
from model import ModelArgs, Transformer, pack_linears, set_attention_backend  # noqa: E402
from quantize import pack_int4, quantize_model  # noqa: E402
from tree import mc_sim_7b_63, static_tree  # noqa: E402

METHODS = ("vanilla", "chain", "eagle", "eagle2", "eagle3", "lookup", "eagle2+lookup", "eagle3+lookup")
HEAD_OF = {"chain": "eagle", "eagle": "eagle", "eagle2": "eagle", "eagle3": "eagle3", "lookup": None,
           "eagle2+lookup": "eagle", "eagle3+lookup": "eagle3"}  # which head a method runs (lookup: none)
ADAPTIVE = ("eagle2+lookup", "eagle3+lookup")  # decoded with speculative_generate(adaptive=True)
PEERS = ("hf", "hf_prompt_lookup")  # --peers: transformers, after our methods (vanilla stays the reference)
EAGER_FLOAT32 = "vanilla_eager_float32"  # --eager_float32: plain decoding as the CPU ran it before --compile
NOT_INVARIANT = "vanilla_not_invariant"  # --batch_invariant: plain decoding without the mode, what it costs
PLAIN_STEP = gen.decode_one_token  # the uncompiled step (generate.compile_decoding rebinds gen's name)
RANDOM_METHODS = ("eagle", "eagle2", "eagle3")  # random-weights mode: one round of each
# The shared data folder sits beside the checkout on the development machine and inside it on the GPU machine.
QUESTION_FILES = [ROOT.parent / "shared/data/mt_bench/question.jsonl", ROOT / "shared/data/mt_bench/question.jsonl"]
DEFAULT_QUESTIONS = next((f for f in QUESTION_FILES if f.is_file()), QUESTION_FILES[0])
EAGLE3_DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' reduced vocabulary (or the target's, if smaller)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=ROOT / "checkpoints/SmolLM2-135M-Instruct/model.pth")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="EAGLE-1/2 head for chain, eagle, eagle2 (default: the eagle/ folder beside the checkpoint)")
    p.add_argument("--draft3_checkpoint_path", type=Path, default=None,
                   help="EAGLE-3 head for eagle3 (default: the eagle3/ folder beside the checkpoint)")
    p.add_argument("--draft3_dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="eagle3: the EAGLE-3 head's dtype (default: --dtype); outputs do not depend on it")
    p.add_argument("--question_file", type=Path, default=DEFAULT_QUESTIONS, help="MT-bench format, one JSON per line")
    p.add_argument("--num_questions", type=int, default=None,
                   help="ask only this many questions, taken in turn from each category (default: all)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="vanilla always runs: it is the reference (default: every method whose head is there)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--max_new_tokens", type=int, default=256, help="per answer")
    p.add_argument("--chain_depth", type=int, default=5, help="chain: guesses per round")
    p.add_argument("--lookup", type=int, default=8, help="eagle2+lookup, eagle3+lookup: lookup nodes per tree")
    p.add_argument("--lookup_alone", type=int, default=10,
                   help="lookup: guesses per round (as transformers' prompt_lookup_num_tokens, default 10)")
    p.add_argument("--tree_top_k", type=int, default=None,
                   help="eagle2/eagle3 (and random weights): children per node (default 10; auto: searched unless given)")
    p.add_argument("--tree_depth", type=int, default=None,
                   help="eagle2 (and random weights): levels of guesses (default 6; auto: searched unless given)")
    p.add_argument("--tree_depth3", type=int, default=None,
                   help="eagle3: levels of guesses (default 8, as in the EAGLE-3 paper; auto: searched unless given)")
    p.add_argument("--tree_tokens", type=gen._tree_tokens_arg, default=60,
                   help="eagle2/eagle3: nodes per round, root included, or auto (measured per method and temperature)")
    p.add_argument("--compile", action="store_true", help="compile the decode step and the rounds")
    p.add_argument("--compile_prefill", action="store_true")
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention", choices=["auto", "sdpa", "triton"], default="auto", help="as in generate.py")
    p.add_argument("--batch_invariant", action="store_true",
                   help="as in generate.py: the target in batch-invariant mode (vanilla too), so that bf16 greedy "
                        "answers equal vanilla's")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=None,
                   help="output path without suffix (default: benchmarks/mt_bench-MODEL or benchmarks/random-NAME)")
    p.add_argument("--no_plot", action="store_true", help="skip OUT.png (no matplotlib needed)")
    p.add_argument("--peers", action="store_true",
                   help="also run transformers' generate and its prompt-lookup decoding on the same checkpoint "
                        "(needs transformers from requirements-dev.txt)")
    p.add_argument("--prompt_lookup_num_tokens", type=int, default=10, help="--peers: hf_prompt_lookup's candidates per forward")
    p.add_argument("--eager_float32", action="store_true",
                   help=f"also run plain decoding eager in float32 on a float32 copy of the weights ({EAGER_FLOAT32}), "
                        f"the CPU default before compiled runs: the baseline of the speed claims against it")
    p.add_argument("--time_budget", type=float, default=None,
                   help="seconds: start no new question (random weights: no new round) after this; recorded")
    p.add_argument("--dry_run", action="store_true",
                   help="check the arguments (all but the device's presence), print the plan and exit")
    r = p.add_argument_group("random-weights mode")
    r.add_argument("--random_weights", action="store_true", help="real-shaped model with random weights, no checkpoint")
    r.add_argument("--model_name", type=str, default=None, help="a model.py config, e.g. llama-2-7b, SmolLM2-135M")
    r.add_argument("--tree_sizes", nargs="+", type=int, default=[16, 32, 48, 60, 64, 96, 128])
    r.add_argument("--tau", nargs="+", type=float, default=[3.5, 4.0, 4.5],
                   help="mean accepted tokens per round to predict the speedup for")
    r.add_argument("--steps", type=int, default=None, help="timed decode steps and rounds (default: 100 GPU, 10 CPU)")
    r.add_argument("--prompt_length", type=int, default=128)
    r.add_argument("--tp_timing", action="store_true",
                   help="under torchrun: also time the decode step without its all-reduces, and the all-reduces alone")
    p.add_argument("--tp_timeout", type=float, default=tp.DEFAULT_TIMEOUT_S,
                   help="under torchrun: seconds a rank waits for the others before it gives up")
    r.add_argument("--quantize", choices=["int8", "int4"], default=None, help="quantize the random target in memory")
    r.add_argument("--groupsize", type=int, default=32, help="int4 groupsize")
    r.add_argument("--compiled_rounds", type=int, default=None,
                   help="with --compile: compile this many rounds, the headline first (default: all); "
                        "the others are timed as CUDA-graph replays of the eager round (eager on a CPU)")
    args = p.parse_args(argv)

    errors = []
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.dry_run:
        errors.append(f"--device {args.device} requested but CUDA is not available")
    if args.attention == "triton" and not args.device.startswith("cuda"):
        errors.append(f"--attention triton runs on CUDA, not on --device {args.device} (use --attention sdpa)")
    if args.max_new_tokens < 1:
        errors.append(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_questions is not None and args.num_questions < 1:
        errors.append(f"--num_questions must be >= 1, got {args.num_questions}")
    if args.chain_depth < 1:
        errors.append(f"--chain_depth must be >= 1, got {args.chain_depth}")
    if any(t < 0 for t in args.temperatures):
        errors.append(f"--temperatures must be >= 0 (0 = greedy), got {args.temperatures}")
    if args.tp_timing and not (args.random_weights and tp.launched_by_torchrun()):
        errors.append("--tp_timing times a tensor-parallel step of --random_weights: run it under "
                      "python -m torch.distributed.run (--nproc_per_node 1 for the one-rank reference)")
    if args.time_budget is not None and args.time_budget < 0:
        errors.append(f"--time_budget must be >= 0 seconds, got {args.time_budget}")
    if args.random_weights:
        if args.model_name is None:
            errors.append("--random_weights needs --model_name (a config name of model.py, e.g. llama-2-7b)")
        else:
            try:
                ModelArgs.from_name(args.model_name)
            except ValueError as e:
                errors.append(str(e))
        args.methods = [m for m in RANDOM_METHODS if m in (args.methods or RANDOM_METHODS)]
        if not args.methods:
            errors.append(f"--random_weights measures rounds of {', '.join(RANDOM_METHODS)}; --methods names none")
        if args.tree_tokens == "auto":
            errors.append("--random_weights measures fixed tree sizes: give --tree_tokens a number (the headline size)")
        if args.quantize == "int4" and args.groupsize not in (32, 64, 128, 256):
            errors.append(f"--groupsize must be 32, 64, 128 or 256, got {args.groupsize}")
    else:
        if args.model_name is not None or args.quantize is not None:
            errors.append("--model_name and --quantize apply to --random_weights; a checkpoint carries its own "
                          "config and quantization")
        if not args.question_file.is_file():
            errors.append(f"--question_file not found: {args.question_file}")
        if not args.checkpoint_path.is_file():
            errors.append(f"checkpoint not found: {args.checkpoint_path} (prepare one with scripts/prepare.sh)")
        heads = {"eagle": args.draft_checkpoint_path or args.checkpoint_path.parent / "eagle",
                 "eagle3": args.draft3_checkpoint_path or args.checkpoint_path.parent / "eagle3"}
        args.draft_checkpoint_path, args.draft3_checkpoint_path = heads["eagle"], heads["eagle3"]
        if args.methods is None:  # every method whose head is on disk
            args.methods = [m for m in METHODS[1:] if HEAD_OF[m] is None or heads[HEAD_OF[m]].exists()]
        args.methods = ["vanilla"] + [m for m in METHODS[1:] if m in args.methods]
        for head in dict.fromkeys(HEAD_OF[m] for m in args.methods[1:] if HEAD_OF[m] is not None):
            if not heads[head].exists():
                needing = " ".join(m for m in args.methods[1:] if HEAD_OF[m] == head)
                flag = "--draft3_checkpoint_path" if head == "eagle3" else "--draft_checkpoint_path"
                errors.append(f"methods {needing} need an {'EAGLE-3' if head == 'eagle3' else 'EAGLE-1/2'} head: "
                              f"{heads[head]} not found (pass {flag}, or leave them out of --methods)")
    if args.peers and args.random_weights:
        errors.append("--peers adds rows to the MT-bench run; random-weights mode has no checkpoint to give transformers")
    elif args.peers:
        try:
            import transformers  # noqa: F401
        except ImportError:
            errors.append("--peers needs transformers: pip install -r requirements-dev.txt")
    if args.prompt_lookup_num_tokens < 1:
        errors.append(f"--prompt_lookup_num_tokens must be >= 1, got {args.prompt_lookup_num_tokens}")
    if not args.no_plot and not args.random_weights and not args.dry_run:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            errors.append("the PNG plot needs matplotlib: pip install -r requirements-dev.txt (or pass --no_plot)")
    if errors:
        p.error("\n  ".join(errors))
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") or args.batch_invariant else "float32"
    if args.batch_invariant and args.random_weights:
        p.error("--batch_invariant is for MT-bench runs (a trained target and head), not --random_weights")
    if args.batch_invariant:
        problem = gen.batch_invariant_problem(args.device, args.dtype, args.compile, args.checkpoint_path)
        if problem:
            p.error(problem)
    if args.out is None:
        name = f"random-{args.model_name}" if args.random_weights else f"mt_bench-{args.checkpoint_path.parent.name}"
        args.out = ROOT / "benchmarks" / name
    if args.random_weights:  # the shape of the rounds measured (auto is for MT-bench)
        args.tree_top_k, args.tree_depth = args.tree_top_k or 10, args.tree_depth or 6
    if args.steps is None:
        args.steps = 100 if args.device.startswith("cuda") else 10
    if args.time_budget is None:
        args.time_budget = float("inf")
    return args


# ---------------------------------------------------------------------------------------------
# Shared by both modes
# ---------------------------------------------------------------------------------------------
def hardware_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{speculative.cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def peak_memory_gb(device: str) -> float:
    """GPU: the peak since the last torch.cuda.reset_peak_memory_stats(); CPU: the process's peak RSS."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def allow_many_graphs():
    """Every tree size and temperature compiles its own graph of the same function (Speculator.round,
    decode_one_token); dynamo's default limit of 8 per function would fall back or fail."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def header(args, argv) -> dict:
    return {"hardware": hardware_name(args.device), "device": args.device, "dtype": args.dtype,
            "draft3_dtype": getattr(args, "draft3_dtype", None) or args.dtype,
            "compiled": args.compile, "attention": args.attention, "torch": torch.__version__,
            "batch_invariant": getattr(args, "batch_invariant", False),
            "tensor_parallel": args.shard.world_size if args.shard else 1,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "python scripts/benchmark.py " + shlex.join(sys.argv[1:] if argv is None else argv)}


def write_json(path: Path, report: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# MT-bench
# ---------------------------------------------------------------------------------------------
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
    if n is None or n >= len(questions):
        return questions
    by_category = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    picked, rank = [], 0
    while len(picked) < n:
        picked += [qs[rank] for qs in by_category.values() if rank < len(qs)][: n - len(picked)]
        rank += 1
    return sorted(picked, key=questions.index)


def tree_shapes(args, model: Transformer, drafts: dict, probes: list, stop_ids) -> dict:
    """{(method, temperature): the speculative tree's shape, or None where --tree_tokens auto
    chose vanilla decoding}. A shape is dict(static=...) or dict(tree_top_k, tree_depth, tree_tokens).
    auto measures on probes (generate.probe_prompts: no evaluation data), in the mode of the run."""
    statics = {"chain": static_tree([[0] * d for d in range(1, args.chain_depth + 1)]), "eagle": static_tree(mc_sim_7b_63)}
    shapes = {}
    for method in args.methods[1:]:
        for T in args.temperatures:
            if method == "lookup":
                shapes[method, T] = dict(lookup=args.lookup_alone)
                continue
            if method in statics:
                shapes[method, T] = dict(static=statics[method])
                continue
            if method.endswith("+lookup"):  # the plain method's tree, and lookup's chain
                base = method.removesuffix("+lookup")
                shape = shapes.get((base, T)) or tree_shapes(
                    argparse.Namespace(**{**vars(args), "methods": ["vanilla", base], "temperatures": [T]}),
                    model, drafts, probes, stop_ids)[base, T]
                shapes[method, T] = None if shape is None else dict(shape, lookup=args.lookup)
                continue
            depth = args.tree_depth3 if method == "eagle3" else args.tree_depth
            if args.tree_tokens != "auto":
                shapes[method, T] = dict(tree_top_k=args.tree_top_k or 10, tree_depth=depth or gen.SPECULATE[method][
                    "depth"], tree_tokens=args.tree_tokens)
                continue
            head = args.draft3_checkpoint_path if method == "eagle3" else args.draft_checkpoint_path
            print(f"{method} at temperature {T:g}:", file=sys.stderr)
            shapes[method, T] = speculative.auto_shape(
                model, drafts[HEAD_OF[method]], probes, stop_ids=stop_ids, temperature=T,
                top_ks=speculative.AUTO_TOP_K if args.tree_top_k is None else (args.tree_top_k,),
                depths=range(1, 9) if depth is None else (depth,),
                cuda_graphs=args.compile and args.device.startswith("cuda"),
                compiled_cpu=args.compile and args.device == "cpu",
                cache_key=dict(speculative.machine_key(args.device), model=speculative.file_key(args.checkpoint_path),
                               draft=speculative.file_key(head), dtype=args.dtype, compiled=args.compile,
                               draft_dtype=(args.draft3_dtype or args.dtype) if method == "eagle3" else args.dtype,
                               packed=not args.compile))
    return shapes


def build_decoders(args, model: Transformer, drafts: dict, stop_ids, context: int, probes) -> tuple:
    """{(method, temperature): decode(prompt_ids, max_new_tokens) -> (ids, generate.Forwards or None)},
    and the tree shapes (tree_shapes). All methods share the target and the drafts and their
    caches, allocated here once for the largest tree, before anything is compiled."""
    device = args.device
    shapes = tree_shapes(args, model, drafts, probes, stop_ids)
    specs = {key: speculative.Speculator(model, drafts.get(HEAD_OF[key[0]]), stop_ids=stop_ids, temperature=key[1],
                                         **shape)
             for key, shape in shapes.items() if shape is not None}
    room = context + 2 * (max([s.depth for s in specs.values()], default=0) + 1)  # the last round's overshoot
    model.setup_caches(1, room + max([s.n_nodes for s in specs.values()], default=0))
    for head, draft in drafts.items():
        regions = [s.draft_region() for (m, _), s in specs.items() if HEAD_OF[m] == head]
        draft.setup_caches(1, room + max(regions, default=0))
    if args.compile:
        allow_many_graphs()
        gen.compile_decoding(device, args.compile_prefill, model)

    def vanilla(sampling):
        def decode(prompt_ids, max_new_tokens):
            prompt = torch.tensor([prompt_ids], device=device)
            # gen.prefill / gen.decode_one_token are looked up now: compile_decoding rebinds them
            return gen.generate(model, prompt, max_new_tokens, stop_ids=stop_ids, prefill_fn=gen.prefill,
                                decode_fn=gen.decode_one_token, **sampling)[0], None
        return decode

    decoders = {}
    for T in args.temperatures:
        for method in args.methods:
            if (method, T) in specs:  # generate.py's decoder: caches, compiled round, its checks
                decoders[method, T] = gen.speculative_decoder(args, specs[method, T], context, method in ADAPTIVE)
            else:  # vanilla, or a method for which --tree_tokens auto chose vanilla decoding
                decoders[method, T] = vanilla(dict(temperature=T, top_k=None, top_p=None))
    return decoders, shapes


def build_peers(args, model: Transformer, stop_ids) -> dict:
    """{(peer, temperature): decode(prompt_ids, max_new_tokens) -> (ids, Forwards: tokens per forward
    after the first)} for --peers: transformers' generate on a copy of the target's weights, same dtype
    and device, same stop tokens, so that its rows are measured exactly like ours. Eager, with
    generate's default cache (dynamic: it grows with the answer; a static one is what
    transformers compiles with, and its prompt lookup refuses one), SDPA attention, use_cache."""
    from convert_hf_checkpoint import hf_model_from_ours

    hf = hf_model_from_ours(model)
    stop = sorted(stop_ids)

    def peer(options):
        def decode(prompt_ids, max_new_tokens):
            prompt = torch.tensor([prompt_ids], device=args.device)
            lengths = []

            def record_length(input_ids, scores, **kwargs):
                # A stopping criterion that never stops: generate checks its criteria once per
                # forward, so the lengths it sees give the tokens each forward emitted.
                lengths.append(input_ids.shape[1])
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

            with torch.inference_mode():
                out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                  eos_token_id=stop or None, pad_token_id=stop[0] if stop else None, use_cache=True,
                                  stopping_criteria=[record_length], **options)
            # As speculative_generate counts rounds: the first forward is the prefill (with prompt
            # lookup it also checks guesses from the prompt, so it may emit more than one token).
            return out[0, len(prompt_ids):].tolist(), gen.Forwards([b - a for a, b in zip(lengths, lengths[1:])])
        return decode

    decoders = {}
    for T in args.temperatures:
        # generate's own defaults would sample from the top 50 only: top_k=0 and top_p=1 keep the
        # whole distribution, as our methods sample from it
        options = dict(do_sample=True, temperature=T, top_k=0, top_p=1.0) if T > 0 else dict(do_sample=False)
        decoders["hf", T] = peer(options)
        decoders["hf_prompt_lookup", T] = peer(dict(options, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens))
    return decoders


def eager_float32(args, stop_ids, context: int) -> dict:
    """{(EAGER_FLOAT32, temperature): decode} for --eager_float32: generate() on a float32 copy of
    the checkpoint, eager, as generate.py ran on a CPU before compiled runs were its default."""
    model = load_model(args.checkpoint_path, args.device, torch.float32, args.shard)
    model.setup_caches(1, context)

    def plain(T):
        def decode(prompt_ids, max_new_tokens):
            prompt = torch.tensor([prompt_ids], device=args.device)
            return gen.generate(model, prompt, max_new_tokens, stop_ids=stop_ids, temperature=T)[0], None
        return decode
    return {(EAGER_FLOAT32, T): plain(T) for T in args.temperatures}


def not_invariant(args, stop_ids, context: int) -> dict:
    """{(NOT_INVARIANT, temperature): decode} for --batch_invariant: plain decoding of a copy of the
    target without batch invariance, compiled on its own (its graph has the usual attention and
    Inductor settings), beside the invariant vanilla: the mode's cost, measured in the same run."""
    model = load_model(args.checkpoint_path, args.device, getattr(torch, args.dtype), args.shard)
    model.setup_caches(1, context)
    step = gen.compile_step(PLAIN_STEP, args.device, model) if args.compile else PLAIN_STEP

    def plain(T):
        def decode(prompt_ids, max_new_tokens):
            prompt = torch.tensor([prompt_ids], device=args.device)
            return gen.generate(model, prompt, max_new_tokens, stop_ids=stop_ids, temperature=T,
                                decode_fn=step)[0], None
        return decode
    return {(NOT_INVARIANT, T): plain(T) for T in args.temperatures}


def summarize(answers: list, header_fields: dict, peaks: dict) -> list:
    """One record per method x temperature x category ("overall" first): totals, tok/s, speedup
    over vanilla in the same group, tau (tokens per target forward, bonus included; 1 for
    vanilla), for methods decoded adaptively the plain steps among the forwards and tau over the
    rounds alone (what the head accepts), and, at temperature 0, the fraction of answers equal to
    vanilla's."""
    records = []
    groups = {}
    for a in answers:
        for category in ("overall", a["category"]):
            groups.setdefault((a["method"], a["temperature"], category), []).append(a)
    for (method, T, category), group in groups.items():
        tokens, seconds = sum(a["tokens"] for a in group), sum(a["seconds"] for a in group)
        rounds, accepted = sum(a["rounds"] for a in group), sum(a["accepted"] for a in group)
        plain_steps = sum(a["plain_steps"] for a in group)  # each emitted 1 token
        records.append(dict(
            header_fields, method=method, temperature=T, category=category,
            questions=len({a["question_id"] for a in group}), answers=len(group), tokens=tokens, rounds=rounds,
            seconds=seconds, tokens_per_s=tokens / seconds, speedup=None,
            mean_accepted=accepted / rounds if rounds else None, plain_steps=plain_steps,
            round_tau=(accepted - plain_steps) / (rounds - plain_steps) if rounds > plain_steps else None,
            equal_to_vanilla=(sum(a["equal_to_vanilla"] for a in group) / len(group)) if T == 0 else None,
            peak_memory_gb=peaks[method, T]))
    vanilla = {(r["temperature"], r["category"]): r["tokens_per_s"] for r in records if r["method"] == "vanilla"}
    for r in records:
        r["speedup"] = r["tokens_per_s"] / vanilla[r["temperature"], r["category"]]
    order = {m: i for i, m in enumerate(METHODS + PEERS + (EAGER_FLOAT32, NOT_INVARIANT))}
    return sorted(records, key=lambda r: (r["category"] != "overall", r["category"], r["temperature"], order[r["method"]]))


def conversation(tokenizer, q: dict, turn: int, answers: list) -> list:
    """The prompt ids of question q's turn (0-based): its user turns up to `turn`, each earlier one
    followed by its answer in answers, in the chat template."""
    messages = []
    for i in range(turn + 1):
        messages.append({"role": "user", "content": q["turns"][i]})
        if i < turn:
            messages.append({"role": "assistant", "content": answers[i]})
    return tokenizer.apply_chat_template(messages)


def run_mt_bench(args, argv=None) -> dict:
    from tqdm import tqdm

    from tokenizer import load_tokenizer

    device, dtype = args.device, getattr(torch, args.dtype)
    args.attention = set_attention_backend(args.attention, device)
    model = load_model(args.checkpoint_path, device, dtype, args.shard)
    if args.batch_invariant:
        gen.set_batch_invariant(model)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    paths = {"eagle": args.draft_checkpoint_path, "eagle3": args.draft3_checkpoint_path}
    draft_dtypes = {"eagle": dtype, "eagle3": getattr(torch, args.draft3_dtype or args.dtype)}
    drafts = {head: load_draft(paths[head], model.config, device, draft_dtypes[head])
              for head in dict.fromkeys(HEAD_OF[m] for m in args.methods[1:] if HEAD_OF[m] is not None)}
    for method in args.methods[1:]:
        if HEAD_OF[method] is not None:
            gen.check_head("eagle3" if HEAD_OF[method] == "eagle3" else "eagle2", drafts[HEAD_OF[method]],
                           paths[HEAD_OF[method]])
    questions = load_questions(args.question_file, args.num_questions)
    start = time.perf_counter()

    # Room for the longest conversation: every turn, each answer up to max_new_tokens (plus slack
    # for an answer that re-encodes into more tokens than it was generated as).
    longest = max(len(conversation(tokenizer, q, len(q["turns"]) - 1, [""] * len(q["turns"]))) for q in questions)
    most_turns = max(len(q["turns"]) for q in questions)
    context = min(model.config.block_size, longest + most_turns * (args.max_new_tokens + 32))
    probe_ids = conversation(tokenizer, questions[0], 0, [])
    peers = build_peers(args, model, tokenizer.stop_ids) if args.peers else {}  # from the plain weights
    if not args.compile:  # eager half precision on a CPU: weights in oneDNN's layout (a no-op elsewhere)
        for module in (model, *drafts.values()):
            pack_linears(module)
    decoders, shapes = build_decoders(args, model, drafts, tokenizer.stop_ids, context, gen.probe_prompts(tokenizer))
    if args.peers:  # run after ours, vanilla first
        decoders.update(peers)
        args.methods = [*args.methods, *PEERS]
    if args.eager_float32:
        decoders.update(eager_float32(args, tokenizer.stop_ids, context))
        args.methods = [*args.methods, EAGER_FLOAT32]
    if args.batch_invariant:
        decoders.update(not_invariant(args, tokenizer.stop_ids, context))
        args.methods = [*args.methods, NOT_INVARIANT]

    # Warm-up (compilation, with --compile): every decoder once on the first prompt, not timed.
    for (method, T), decode in tqdm(decoders.items(), desc="warm-up", file=sys.stderr):
        decode(probe_ids, min(args.max_new_tokens, 32))
    # The plain step and the machine's read bandwidth, in this run (before the answers: a quiet moment)
    step = decode_step_bandwidth(model, probe_ids, device)
    step["read_gb_s"] = read_bandwidth_gb_s(device)
    step["fraction_of_read"] = step["gb_s"] / step["read_gb_s"]
    print(f"plain decode step {step['step_ms']:.2f} ms: {step['gb_s']:.1f} GB/s of weights, "
          f"{step['fraction_of_read']:.0%} of the {step['read_gb_s']:.1f} GB/s read bandwidth", file=sys.stderr)

    answers, peaks = [], {key: 0.0 for key in decoders}
    total = sum(len(q["turns"]) for q in questions) * len(decoders)
    bar = tqdm(total=total, desc="MT-bench answers", unit="answer", file=sys.stderr)
    asked = []
    for index, q in enumerate(questions):
        if asked and time.perf_counter() - start > args.time_budget:  # (the first question is always asked)
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
                reference = None
                for method in args.methods:
                    torch.manual_seed(args.seed + 1000 * index + turn)  # the same seed for every method
                    if device.startswith("cuda"):
                        torch.cuda.reset_peak_memory_stats(device)
                    speculative.device_sync(device)
                    t = time.perf_counter()
                    ids, forwards = decoders[method, T](prompt_ids, max_new)
                    speculative.device_sync(device)
                    seconds = time.perf_counter() - t
                    peaks[method, T] = max(peaks[method, T], peak_memory_gb(device))
                    if method == "vanilla":
                        reference = ids
                    if forwards is None:  # vanilla decoding (also eagle2 where --tree_tokens auto chose it)
                        rounds = accepted = len(ids) - 1  # one forward per token after prefill's
                        plain_steps = 0
                    else:  # "rounds": target forwards, --adaptive's plain steps included
                        rounds, accepted = len(forwards.emitted), sum(forwards.emitted)
                        plain_steps = forwards.plain_steps
                    answers.append(dict(question_id=q["question_id"], category=q["category"], turn=turn + 1,
                                        method=method, temperature=T, prompt_tokens=len(prompt_ids), tokens=len(ids),
                                        seconds=seconds, rounds=rounds, accepted=accepted, plain_steps=plain_steps,
                                        equal_to_vanilla=ids == reference if T == 0 else None, ids=ids))
                    bar.set_postfix_str(f"q{q['question_id']} T={T:g} {method}: {len(ids) / seconds:.1f} tok/s")
                    bar.update()
                replies.append(tokenizer.decode([i for i in reference if i not in tokenizer.stop_ids]))
    bar.close()

    fields = dict(header(args, argv), model=args.checkpoint_path.parent.name)
    if args.peers:
        import transformers

        fields["transformers"] = transformers.__version__
    records = summarize(answers, {k: fields[k] for k in ("hardware", "model", "dtype", "compiled", "date", "command")},
                        peaks)
    for r in records:
        shape = shapes.get((r["method"], r["temperature"]))
        r["tree_tokens"] = None if shape is None else (
            shape["static"].parents.numel() if "static" in shape else shape.get("tree_tokens", 1)) + shape.get("lookup", 0)
    return dict(fields, mode="mt_bench", weight_bytes_per_rank=tp.weight_bytes(model), decode_step=step,
                drafts={head: str(paths[head]) for head in drafts},
                question_file=str(args.question_file), questions=len(asked), questions_left_out=len(questions) - len(asked),
                max_new_tokens=args.max_new_tokens, context=context, seed=args.seed, methods=method_notes(args, shapes),
                peak_memory_note="GPU: peak allocated per method; CPU: the whole process's peak RSS, shared by all methods",
                records=records, answers=answers)


def method_notes(args, shapes) -> dict:
    notes = {"vanilla": "one target forward per token",
             "chain": f"static chain of {args.chain_depth} guesses (EAGLE-1/2 head, no tree)",
             "eagle": "EAGLE-1 static tree mc_sim_7b_63: 26 nodes, depth 5",
             "eagle2": "EAGLE-2 dynamic tree (EAGLE-1/2 head)", "eagle3": "EAGLE-3 head, dynamic tree",
             "lookup": f"prompt lookup alone: {args.lookup_alone} guesses from the longest earlier match, no draft",
             "eagle2+lookup": f"as eagle2, with {args.lookup} more tree nodes from prompt lookup, decoded adaptively",
             "eagle3+lookup": f"as eagle3, with {args.lookup} more tree nodes from prompt lookup, decoded adaptively"}

    def shape_text(shape):
        return "vanilla decoding" if shape is None else \
            f"top_k {shape['tree_top_k']}, depth {shape['tree_depth']}, {shape['tree_tokens']} tokens"

    for method in ("eagle2", "eagle3", "eagle2+lookup", "eagle3+lookup"):
        chosen = {T: shape for (m, T), shape in shapes.items() if m == method}
        if chosen:
            notes[method] += (" (--tree_tokens auto chose " if args.tree_tokens == "auto" else ": ") + ", ".join(
                f"T={T:g}: {shape_text(shape)}" for T, shape in chosen.items()) + (")" if args.tree_tokens == "auto" else "")
    if args.peers:
        import transformers

        notes["hf"] = (f"transformers {transformers.__version__} model.generate on a copy of the weights: greedy at "
                       f"T=0, at T>0 sampling with top_k=0, top_p=1; eager, its default dynamic KV cache, SDPA; "
                       f"τ counts the forwards after the first")
        notes["hf_prompt_lookup"] = (f"as hf, with prompt-lookup decoding (prompt_lookup_num_tokens "
                                     f"{args.prompt_lookup_num_tokens}): guesses copied from earlier n-grams of the "
                                     f"prompt and answer, checked in one forward")
    notes[NOT_INVARIANT] = ("plain decoding of a copy of the target without batch invariance (the mode's cost; its "
                            "answers may differ from vanilla's in bf16)")
    notes[EAGER_FLOAT32] = "plain decoding, eager, float32 (a copy of the weights): the CPU default before --compile"
    return {m: notes[m] for m in args.methods}


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def mt_bench_markdown(report: dict) -> str:
    lines = [f"# MT-bench: {report['model']}, {report['hardware']}", "",
             f"- date: {report['date']}", f"- command: `{report['command']}`",
             f"- device {report['device']}, dtype {report['dtype']}, compiled: {report['compiled']}, "
             f"attention: {report['attention']}, torch {report['torch']}"
             + (", batch-invariant target" if report.get("batch_invariant") else ""),
             f"- heads: {', '.join(f'{k}: {v}' for k, v in report['drafts'].items()) or 'none'}",
             f"- {report['questions']} questions (both turns) from {Path(report['question_file']).name}, "
             f"up to {report['max_new_tokens']} new tokens per answer"
             + (f" ({report['questions_left_out']} more left out by --time_budget)" if report["questions_left_out"] else ""),
             *[f"- {m}: {note}" for m, note in report["methods"].items()],
             f"- peak memory: {report['peak_memory_note']}",
             *([f"- plain decode step (vanilla, T=0, median of 40): {report['decode_step']['step_ms']:.2f} ms, "
                f"{report['decode_step']['gb_s']:.1f} GB/s of weights = {report['decode_step']['fraction_of_read']:.0%} "
                f"of the machine's read bandwidth, {report['decode_step']['read_gb_s']:.1f} GB/s (both in this run)"]
               if "decode_step" in report else []), "",
             "| method | temperature | tok/s | speedup | τ | equal to vanilla | peak memory (GB) | tokens | rounds |",
             "|---|---|---|---|---|---|---|---|---|"]
    overall = [r for r in report["records"] if r["category"] == "overall"]
    for r in overall:
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}× | "
                     f"{_fmt(r['mean_accepted'])} | {_fmt(r['equal_to_vanilla'], '.0%')} | {r['peak_memory_gb']:.2f} | "
                     f"{r['tokens']} | {r['rounds']} |")
    adaptive = [r for r in overall if r.get("plain_steps")]
    if adaptive:
        lines += ["", "τ above counts every target forward; --adaptive's plain steps (1 token each) are among "
                  "them. Over the speculative rounds alone (what the head accepts):", ""]
        lines += [f"- {r['method']} at T={r['temperature']:g}: τ {_fmt(r['round_tau'])} over "
                  f"{r['rounds'] - r['plain_steps']} rounds; {r['plain_steps']} plain steps "
                  f"({r['plain_steps'] / r['rounds']:.0%} of the forwards)" for r in adaptive]
    methods = list(report["methods"])
    lines += ["", "Per category: vanilla tok/s, and speedup (τ) of each method.", "",
              "| category | temperature | vanilla tok/s | " + " | ".join(methods[1:]) + " |",
              "|---|---|---|" + "---|" * (len(methods) - 1)]
    by_key = {(r["category"], r["temperature"], r["method"]): r for r in report["records"]}
    for category, T in dict.fromkeys((r["category"], r["temperature"]) for r in report["records"]):
        cells = [f"{by_key[category, T, m]['speedup']:.2f}× ({_fmt(by_key[category, T, m]['mean_accepted'])})"
                 for m in methods[1:]]
        lines.append(f"| {category} | {T:g} | {by_key[category, T, 'vanilla']['tokens_per_s']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mt_bench_plot(report: dict, path: Path):
    """Speedup over vanilla per category and overall, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(dict.fromkeys(r["temperature"] for r in report["records"]))
    categories = list(dict.fromkeys(r["category"] for r in report["records"]))
    methods = [m for m in report["methods"] if m != "vanilla"]
    by_key = {(r["category"], r["temperature"], r["method"]): r["speedup"] for r in report["records"]}
    fig, axes = plt.subplots(len(temps), 1, figsize=(max(6, 1.1 * len(categories)), 3.2 * len(temps)), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, T in zip(axes[:, 0], temps):
        for i, m in enumerate(methods):
            xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(categories))]
            ax.bar(xs, [by_key[c, T, m] for c in categories], width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(categories)), categories, rotation=20)
        ax.set_ylabel("speedup over vanilla")
        ax.set_title(f"{report['model']}, temperature {T:g}, {report['dtype']} ({report['hardware'][:60]})", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Random weights: roofline and round cost of a real-shaped model, no checkpoint needed
# ---------------------------------------------------------------------------------------------
def random_init(module: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A module built on the meta device, allocated directly on `device` in `dtype` (a 7B model never
    exists in float32) and filled with random weights: norms 1, everything else N(0, 0.02^2)."""
    module = module.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return module.eval()


def random_model(config: ModelArgs, device: str, dtype: torch.dtype, shard=None) -> Transformer:
    """With a tp.Shard, only this rank's part. Every rank draws the same random numbers for the
    replicated weights (same seed, same shapes in the same order)."""
    with torch.device("meta"):
        model = Transformer(config)
    if shard is not None:
        tp.shard_model(model, shard)
    model = random_init(model, device, dtype)
    if config.tie_embeddings:  # to_empty made two tensors of the shared one
        model.output.weight = model.tok_embeddings.weight
    return model


def random_drafts(config: ModelArgs, methods, device: str, dtype: torch.dtype) -> dict:
    """Random drafts for the methods: {"eagle": an EAGLE-1/2 head, "eagle3": an EAGLE-3 head with
    a reduced vocabulary, as published}."""
    drafts = {}
    with torch.device("meta"):
        if {"eagle", "eagle2"} & set(methods):
            drafts["eagle"] = EagleDraft(draft_config_for(config))
        if "eagle3" in methods:
            drafts["eagle3"] = Eagle3Draft(draft_config_for(config), min(EAGLE3_DRAFT_VOCAB, config.vocab_size),
                                           eagle3_layer_ids(config.n_layer))
    for arch, draft in drafts.items():
        vocab = draft.vocab if arch == "eagle3" else None  # a buffer, not a weight: to_empty would lose it
        drafts[arch] = random_init(draft, device, dtype)
        if vocab is not None:
            drafts[arch].vocab = torch.arange(vocab.numel(), device=device)
    return drafts


def copy_bandwidth_gb_s(device: str, nbytes: int, repeats: int = 20) -> float:
    """Device-to-device copy of nbytes, counted as read + write (2 * nbytes per copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    speculative.device_sync(device)
    t = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    speculative.device_sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - t) / 1e9


def read_bandwidth_gb_s(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Reading nbytes (float32, summed), the median of repeats: what a decode step's weight reads
    can reach at most. 1 GiB: far past any cache."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):
        speculative.device_sync(device)
        t = time.perf_counter()
        x.sum()
        speculative.device_sync(device)
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times[1:])[repeats // 2] / 1e9


@torch.no_grad()
def decode_step_bandwidth(model: Transformer, prompt_ids, device: str, steps: int = 40) -> dict:
    """One plain decode step as the run decodes (gen.decode_one_token, compiled if the run is):
    the median of `steps` after a warm-up, and the bandwidth of the weights it reads."""
    token = gen.prefill(model, torch.tensor([prompt_ids], device=device), 0.0, None, None)
    position = torch.tensor([len(prompt_ids)], device=device)
    times = []
    for _ in range(steps + 5):
        speculative.device_sync(device)
        t = time.perf_counter()
        token = gen.decode_one_token(model, token.clone(), position, 0.0, None, None)
        speculative.device_sync(device)
        times.append(time.perf_counter() - t)
        position += 1
    step, weight_bytes = sorted(times[5:])[steps // 2], gen.model_bytes_per_token(model)
    return dict(step_ms=step * 1e3, weight_bytes=weight_bytes, gb_s=weight_bytes / step / 1e9)


def seconds_per_call(fn, calls: int, device: str, warmup: int = 3) -> float:
    """Mean time of fn() over `calls` back-to-back calls (one sync at each end), after warm-up
    calls that compile and record CUDA graphs."""
    for _ in range(warmup):
        fn()
    speculative.device_sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    speculative.device_sync(device)
    return (time.perf_counter() - t) / calls


def round_plan(args) -> list:
    """(method, tree size) pairs in the order they are measured: the headline size of each method
    first (what a short --time_budget or --compiled_rounds keeps), then the other sizes."""
    dynamic = [m for m in ("eagle2", "eagle3") if m in args.methods]
    first = [(m, args.tree_tokens) for m in dynamic] + [("eagle", 26)] * ("eagle" in args.methods)
    rest = [(m, T) for m in dynamic for T in sorted(args.tree_sizes) if T != args.tree_tokens]
    return first + rest


@torch.no_grad()
def run_random_weights(args, argv=None) -> dict:
    start = time.perf_counter()
    device, dtype = args.device, getattr(torch, args.dtype)
    cuda = device.startswith("cuda")
    args.attention = set_attention_backend(args.attention, device)
    config = ModelArgs.from_name(args.model_name)
    torch.manual_seed(args.seed)
    model = random_model(config, device, dtype, args.shard)
    parameters = sum(p.numel() for p in model.parameters())
    quantized = quantize_model(model, args.quantize, args.groupsize) if args.quantize else []
    pack_int4(model)
    drafts = random_drafts(config, args.methods, device, dtype)  # in the float dtype, also for a quantized target
    plan = round_plan(args)
    n_compiled = 0 if not args.compile else len(plan) if args.compiled_rounds is None else args.compiled_rounds
    warmup, P, depth = 3, args.prompt_length, max(args.tree_depth, 5)  # 5: the static tree's depth
    largest = max(T for _, T in plan)
    # prompt, warm-up and timed rounds (each emits at most depth + 1 tokens; one more warm-up
    # round before a CUDA-graph capture), room for the last round's overshoot, the tree region
    context = P + (warmup + args.steps + 2) * (depth + 1) + 2 * (depth + 1)
    model.setup_caches(1, context + largest)
    for draft in drafts.values():
        draft.setup_caches(1, context + max(largest, dynamic_tree_slots(args.tree_top_k, args.tree_depth)))
    weight_bytes = gen.model_bytes_per_token(model)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    kv_bytes = model.kv_storage.numel() * model.kv_storage.element_size()
    draft_bytes = sum(t.numel() * t.element_size() for d in drafts.values() for t in d.state_dict().values())
    eager_decode = gen.decode_one_token  # compile_decoding rebinds the module's name
    if args.compile:
        allow_many_graphs()
        gen.compile_decoding(device, args.compile_prefill, model)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    copy_bytes = (1 << 30) if cuda else (256 << 20)
    copy_gb_s = copy_bandwidth_gb_s(device, copy_bytes)
    report = dict(header(args, argv), mode="random_weights", model=args.model_name, config=config.to_dict(),
                  weights="random", quantize=args.quantize and (args.quantize if args.quantize == "int8"
                                                                else f"int4 g{args.groupsize}"),
                  quantized=quantized, parameters=parameters,
                  weight_bytes_per_token=weight_bytes, prompt_length=P, steps=args.steps,
                  tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                  memory_needed_gb=(state_bytes + kv_bytes + draft_bytes + 2 * copy_bytes) / 1e9,
                  copy_gb_s=copy_gb_s, time_budget_s=args.time_budget, rounds=[], skipped=[],
                  weight_bytes_per_rank=tp.weight_bytes(model))

    def save():  # after every measurement: a run stopped from outside keeps what it measured
        report.update(peak_memory_gb=peak_memory_gb(device), seconds=time.perf_counter() - start)
        write_json(Path(str(args.out) + ".json"), report)

    # (a) vanilla decode: one step per call, positions after the prompt, timed in each way rounds
    # are: compiled (with --compile), and as CUDA-graph replays of the eager step (CUDA) or eager.
    prompt = torch.randint(0, config.vocab_size, (1, P), device=device)
    token = gen.prefill(model, prompt, 0.0, None, None)
    input_pos = torch.tensor([P], device=device)

    def step_with(decode):
        def step():
            token.copy_(decode(model, token.clone(), input_pos, 0.0, None, None))
            input_pos.add_(1)
        return step

    cheap = "cuda graph" if cuda else "eager"  # how the rounds that are not compiled are timed
    steps = {}
    if args.compile:
        t = time.perf_counter()
        steps["compiled"] = seconds_per_call(step_with(gen.decode_one_token), args.steps, device, warmup)
        report["vanilla_warmup_s"] = time.perf_counter() - t - steps["compiled"] * args.steps
    if n_compiled < len(plan):
        eager = step_with(eager_decode)
        steps[cheap] = seconds_per_call(speculative.cuda_graph(eager) if cuda else eager, args.steps, device, warmup)
    main = steps.get("compiled", steps.get(cheap))
    report["vanilla"] = dict(tokens_per_s=1 / main, step_ms=main * 1e3, gb_s=weight_bytes / main / 1e9,
                             fraction_of_copy=weight_bytes / main / 1e9 / copy_gb_s, timing=next(iter(steps)),
                             step_ms_by_timing={k: v * 1e3 for k, v in steps.items()})
    save()
    tp_timing = tp_step_timing(model, step_with(gen.decode_one_token if args.compile else eager_decode), main, args) \
        if args.tp_timing else None

    # (b) one round per (method, size): draft catch-up and growth, verify, accept, compaction
    statics = {"eagle": static_tree(mc_sim_7b_63)}
    for i, (method, T) in enumerate(plan):
        if time.perf_counter() - start > args.time_budget:
            report["skipped"] = [dict(method=m, tree_tokens=n, why="time budget") for m, n in plan[i:]]
            print(f"--time_budget {args.time_budget:g} s reached: {len(plan) - i} rounds left out", file=sys.stderr)
            break
        draft = drafts["eagle3" if method == "eagle3" else "eagle"]
        if method in statics:
            spec = speculative.Speculator(model, draft, static=statics[method])
        else:
            spec = speculative.Speculator(model, draft, tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                                          tree_tokens=T)
        spec.setup(1, context)
        timing = "compiled" if i < n_compiled else cheap
        if timing == "compiled":
            speculative.compile_round(spec, args.compile_prefill)
        spec.prefill(prompt, context - P - 2 * (depth + 1))
        t = time.perf_counter()
        round_fn = speculative.cuda_graph(spec.round) if timing == "cuda graph" else spec.round
        round_s = seconds_per_call(round_fn, args.steps, device, warmup)
        compile_s = time.perf_counter() - t - round_s * args.steps
        report["rounds"].append(dict(method=method, tree_tokens=T, timing=timing, round_ms=round_s * 1e3,
                                     cost_vs_step=round_s / steps[timing], warmup_s=compile_s))
        print(f"{method} {T:4d} tree tokens ({timing}): a round takes {round_s * 1e3:.2f} ms = "
              f"{round_s / steps[timing]:.2f} vanilla steps", file=sys.stderr)
        save()

    # (c) what those costs predict: a round emits tau tokens, vanilla needs tau steps for them
    report["tp_timing"] = tp_timing
    report["predicted"] = [dict(tau=tau, method=r["method"], tree_tokens=r["tree_tokens"], timing=r["timing"],
                                speedup=tau / r["cost_vs_step"]) for tau in args.tau for r in report["rounds"]]
    save()
    return report


def tp_step_timing(model: Transformer, step, step_s: float, args) -> dict:
    """(d) of --tp_timing: a tensor-parallel decode step (step_s, measured) against the same step
    with its all-reduces removed (each rank computes its own shard and nothing else: the tokens
    are wrong, the work is the same) and against the all-reduces alone, 2 per layer of [1, 1, dim]
    each, chained as in the model (each added to the residual stream before the next). If the
    step costs its shard's compute plus its collectives, step = without + all-reduces."""
    sharded = [m for m in model.modules() if getattr(m, "tp_reduce", None) is not None]
    for m in sharded:
        m.tp_reduce = None
    local_s = seconds_per_call(step, args.steps, args.device, 3)
    for m in sharded:
        m.tp_reduce = tp.all_reduce_sum
    x = torch.zeros(1, 1, model.config.dim, dtype=model.norm.weight.dtype, device=args.device)

    def all_reduces():
        y = x
        for _ in sharded:
            y = y + tp.all_reduce_sum(y)
        return y

    if args.compile:
        all_reduces = torch.compile(all_reduces, mode="reduce-overhead", fullgraph=True)
    reduce_s = seconds_per_call(all_reduces, args.steps, args.device, 3)
    print(f"tensor parallel over {args.shard.world_size}: step {step_s * 1e3:.2f} ms, without all-reduces "
          f"{local_s * 1e3:.2f} ms, {len(sharded)} all-reduces alone {reduce_s * 1e3:.2f} ms", file=sys.stderr)
    return dict(step_ms=step_s * 1e3, step_without_all_reduces_ms=local_s * 1e3, all_reduces_ms=reduce_s * 1e3,
                overhead_ms=(step_s - local_s) * 1e3, all_reduces_per_step=len(sharded),
                all_reduce_bytes=x.numel() * x.element_size())


def random_weights_markdown(report: dict) -> str:
    v = report["vanilla"]
    by_timing = ", ".join(f"{k} {ms:.2f} ms" for k, ms in v["step_ms_by_timing"].items())
    lines = [f"# {report['model']} (random weights{', ' + report['quantize'] if report['quantize'] else ''}), "
             f"{report['hardware']}", "",
             f"- date: {report['date']}", f"- command: `{report['command']}`",
             f"- device {report['device']}, dtype {report['dtype']}, compiled: {report['compiled']}, "
             f"attention: {report['attention']}, torch {report['torch']}",
             f"- {report['parameters'] / 1e9:.3f} B parameters; a decode step reads "
             f"{report['weight_bytes_per_token'] / 1e9:.3f} GB of weights; memory needed ≈ "
             f"{report['memory_needed_gb']:.1f} GB (peak {report['peak_memory_gb']:.1f} GB)",
             f"- prompt {report['prompt_length']} tokens; {report['steps']} timed steps / rounds; "
             f"EAGLE-2/3 top_k {report['tree_top_k']}, depth {report['tree_depth']}, random drafts; "
             f"whole run {report['seconds']:.0f} s",
             *[f"- {line}" for line in report["quantized"]],
             "", "## (a) vanilla decode against the copy bandwidth", "",
             "| tok/s | step (ms) | weights GB/s | copy GB/s (read + write) | fraction of copy | step by timing |",
             "|---|---|---|---|---|---|",
             f"| {v['tokens_per_s']:.1f} | {v['step_ms']:.2f} | {v['gb_s']:.1f} | {report['copy_gb_s']:.1f} | "
             f"{v['fraction_of_copy']:.0%} ({v['timing']}) | {by_timing} |", "",
             "## (b) one round against one vanilla step timed the same way", "",
             "| method | tree tokens | timing | round (ms) | cost in vanilla steps | warm-up incl. compile (s) |",
             "|---|---|---|---|---|---|",
             *[f"| {r['method']} | {r['tree_tokens']} | {r['timing']} | {r['round_ms']:.2f} | {r['cost_vs_step']:.2f} | "
               f"{r['warmup_s']:.1f} |" for r in report["rounds"]]]
    if report["skipped"]:
        lines += ["", "Left out by --time_budget: " + ", ".join(f"{s['method']} {s['tree_tokens']}"
                                                                for s in report["skipped"])]
    lines += ["", "## (c) predicted speedup = τ × step / round", "",
              "| τ | " + " | ".join(f"{r['method']} {r['tree_tokens']}" for r in report["rounds"]) + " |",
              "|---|" + "---|" * len(report["rounds"])]
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
        shard, device = tp.start(args.device, args.tp_timeout, vars(args))
    except ValueError as e:
        sys.exit(f"error: {e}")
    args.shard, args.device = shard, device
    torch.manual_seed(args.seed)
    try:
        report = run_random_weights(args, argv) if args.random_weights else run_mt_bench(args, argv)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    tp.finish()
    if shard is not None and shard.rank > 0:
        return report  # rank 0 writes the files
    out = str(args.out)  # not with_suffix: "random-llama-3.1-8b" has a dot of its own
    write_json(Path(out + ".json"), report)
    if args.random_weights:
        Path(out + ".md").write_text(random_weights_markdown(report))
    else:
        Path(out + ".md").write_text(mt_bench_markdown(report))
        if not args.no_plot:
            mt_bench_plot(report, Path(out + ".png"))
    print(f"wrote {out}.json, .md" + ("" if args.no_plot or args.random_weights else " and .png"), file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
