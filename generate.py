"""Text generation: plain decoding with a static KV cache, or EAGLE speculative decoding.

    python generate.py --chat --prompt "What is the capital of France?" --speculate eagle3

The decode step is one compiled graph (CUDA graphs on GPU), and so is a speculative round
(speculative.py). The next token never leaves the device: the host looks at generated tokens
only to stream them or, every few steps, to stop at an end-of-turn token. What is not given on
the command line comes from defaults.py's table. Under torchrun the target is sharded (tp.py)."""
import argparse
import itertools
import json
import resource
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

import defaults
import invariant
import packages
import tp
from autoshape import auto_tree, probe_prompts
from checkpoint import load_draft, load_model
from compiling import compile_prefill, compile_round, compile_step, device_sync, missing_cpu_compile_settings
from cpu import pack_linears, packed_bytes
from model import Transformer
from quantize import mode_from_path
from sampling import cut_at_stop, is_stop, sample
from speculative import Speculator, speculative_generate
from tokenizer import TextStreamer, load_tokenizer
from trees import mc_sim_7b_63, static_tree

STOP_CHECK_EVERY = 16  # decode steps between host syncs that look for a stop token when not streaming
WARM_UP_TOKENS = 32    # a warm-up's tokens (rounds and plain steps taking turns): every graph runs once


# Plain decoding
def prefill(model: Transformer, prompt: Tensor, temperature, top_k, top_p) -> Tensor:
    """Run the prompt [B, L] through the model, filling cache slots 0..L-1; returns the first new token [B]."""
    logits = model(prompt, torch.arange(prompt.size(1), device=prompt.device), last_logits=True)
    return sample(logits[:, -1], temperature, top_k, top_p)


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, temperature, top_k, top_p) -> Tensor:
    """token [B], input_pos [1] -> next token [B]. This is the function that is compiled."""
    logits = model(token[:, None], input_pos)
    return sample(logits[:, -1], temperature, top_k, top_p)


@torch.no_grad()
def generate(model: Transformer, prompt: Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, stop_ids=(),
             callback: Optional[Callable[[Tensor], None]] = None,
             prefill_fn=prefill, decode_fn=decode_one_token) -> list:
    """Generate up to max_new_tokens after prompt [B, L] (every row continues the same way from
    its own prompt). Returns, per row, the list of new token ids, cut after the first stop token
    (which is kept). callback(tokens [B]) is called with each new token (streaming)."""
    B, L = prompt.shape
    if L + max_new_tokens > model.config.block_size:
        raise ValueError(f"prompt ({L}) + max_new_tokens ({max_new_tokens}) exceed the context ({model.config.block_size})")
    model.setup_caches(B, L + max_new_tokens)  # no-op when the caches are already large enough
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=prompt.device)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=prompt.device)

    token = prefill_fn(model, prompt, temperature, top_k, top_p)
    out[:, 0] = token
    input_pos = torch.tensor([L], device=prompt.device)
    for n in range(1, max_new_tokens + 1):  # n tokens are out; the last n ends the loop
        if callback is not None:
            callback(out[:, n - 1])
        # Stop checks are the only host syncs: every step while streaming, else every few steps.
        check = stop.numel() and (callback is not None or n % STOP_CHECK_EVERY == 0)
        if n == max_new_tokens or (check and bool(is_stop(out[:, :n], stop).any(dim=1).all())):  # every row stopped
            break
        token = decode_fn(model, token.clone(), input_pos, temperature, top_k, top_p)
        out[:, n] = token
        input_pos += 1
    return [cut_at_stop(row, stop_ids) for row in out[:, :n].tolist()]


def model_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights a decode step reads: the state dict (quantized weights and scales are buffers)
    but one row of an untied embedding and k of E experts, plus oneDNN-packed weights (outside it)."""
    seen, total, c = set(), 0, model.config
    for name, p in model.state_dict(keep_vars=True).items():
        if id(p) in seen or (name == "tok_embeddings.weight" and model.output.weight is not p):
            continue
        seen.add(id(p))
        size = p.numel() * p.element_size()
        # an expert stack's weight, or its int8 scales
        experts = c.num_experts and name.rsplit(".", 1)[0].endswith(("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))
        total += size * c.num_activated_experts // c.num_experts if experts else size
    return total + packed_bytes(model)


def peak_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_reserved() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


# Command line
# --speculate METHOD: the head it takes (its default folder beside the checkpoint)
SPECULATE = {
    "eagle": dict(folder="eagle", arch="eagle"),  # EAGLE-1's static tree (mc_sim_7b_63, or --tree FILE.json)
    "eagle2": dict(folder="eagle", arch="eagle"),
    "eagle3": dict(folder="eagle3", arch="eagle3"),
    "lookup": dict(folder=None, arch=None),  # no draft: prompt lookup's chain alone
}
# Flags of earlier versions, each with what replaces it.
REMOVED = {
    "--prompt_file": "--prompt @FILE", "--tree_top_k": "--tree TOP_K,DEPTH,TOKENS",
    "--tree_depth": "--tree TOP_K,DEPTH,TOKENS", "--tree_tokens": "--tree TOP_K,DEPTH,TOKENS (or --tree auto)",
    "--num_samples": "scripts/benchmark.py for repeated timings", "--top_p": "top_p= of generate() in Python",
    "--compile_prefill": "scripts/benchmark.py --compile_prefill", "--draft_dtype": "scripts/benchmark.py --draft3_dtype",
    "--adaptive": "nothing: adaptive decoding is always on here (scripts/benchmark.py runs both)",
    "--no-adaptive": "scripts/benchmark.py, which runs rounds without plain steps for the methods without +lookup",
    "--attention": "nothing: the device decides (attention.py)", "--tp_timeout": "the environment variable EAGLE_TP_TIMEOUT (seconds)",
}


def tree_arg(value: str):
    """--tree: "auto", "TOP_K,DEPTH,TOKENS", or a JSON file of child-rank paths (eagle's static tree)."""
    if value == "auto" or value.endswith(".json"):
        return value
    try:
        top_k, depth, tokens = (int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, TOP_K,DEPTH,TOKENS (e.g. 10,6,60) or a .json file, "
                                         f"got {value!r}") from None
    return top_k, depth, tokens


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for arg in argv:
        if arg.split("=")[0] in REMOVED:
            p.error(f"{arg.split('=')[0]} was removed: use {REMOVED[arg.split('=')[0]]}")
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct/model.pth"))
    p.add_argument("--prompt", default="Hello, my name is", help="the prompt, or @FILE to read it from a file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--interactive", action="store_true", help="chat in the terminal, the answers streamed")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k most probable tokens")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step and the round (default: on a CPU; on CUDA when asked, CUDA graphs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: defaults.py's table (bfloat16 on CUDA and compiled on a CPU)")
    p.add_argument("--output_json", type=Path, default=None, help="write prompt, outputs and speed here")
    p.add_argument("--compare", action="store_true",
                   help="answer plainly, then with --speculate: both speeds, tau, whether the answers are identical")
    p.add_argument("--speculate", choices=["none", *SPECULATE], default="none",
                   help="eagle: EAGLE-1 static tree; eagle2: dynamic tree; eagle3: EAGLE-3 head; lookup: prompt lookup")
    p.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="the EAGLE head (default: eagle/ beside the checkpoint, eagle3/ for eagle3)")
    p.add_argument("--tree", type=tree_arg, default=None,
                   help="TOP_K,DEPTH,TOKENS of the dynamic tree; auto: measured on this machine; eagle: FILE.json")
    p.add_argument("--lookup", type=int, default=None, help="prompt lookup's guesses as this many more tree nodes")
    p.add_argument("--batch_invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="each token's logits bit for bit the same in a step and a verify: lossless in bf16 too")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def check_args(args):
    """Check args and fill in what defaults.py decides (a ValueError says what is wrong, in one line each)."""
    if args.compile is None:
        args.compile = defaults.compile_by_default(args.device, tp.launched_by_torchrun())
    prompt_file = Path(args.prompt[1:]) if args.prompt.startswith("@") else None
    tree_file = isinstance(args.tree, str) and args.tree.endswith(".json")
    takes_draft = args.speculate not in ("none", "lookup")
    if takes_draft and args.draft_checkpoint_path is None:
        args.draft_checkpoint_path = args.checkpoint_path.parent / SPECULATE[args.speculate]["folder"]
    missing = missing_cpu_compile_settings() if args.compile and args.device == "cpu" else []
    errors = [message for wrong, message in [
        (args.temperature < 0, f"--temperature must be >= 0 (0 = greedy), got {args.temperature}"),
        (args.top_k is not None and args.top_k < 1, f"--top_k must be >= 1, got {args.top_k}"),
        (args.max_new_tokens < 1, f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"),
        (args.interactive and tp.launched_by_torchrun(),
         "--interactive reads the terminal in one process; under torchrun pass --prompt"),
        (args.compare and (args.speculate == "none" or args.interactive),
         "--compare puts plain decoding beside --speculate METHOD, for one prompt (not --interactive)"),
        (prompt_file and not prompt_file.is_file(), f"--prompt {args.prompt}: file not found"),
        (args.device.startswith("cuda") and not torch.cuda.is_available(),
         f"--device {args.device} requested but CUDA is not available"),
        (missing, f"--compile on a CPU needs {', '.join(missing)}, which torch {torch.__version__} lacks: "
                  "upgrade torch or run without --compile"),
        (tree_file and args.speculate != "eagle", "--tree FILE.json sets the static tree of --speculate eagle"),
        (tree_file and args.speculate == "eagle" and not Path(args.tree).is_file(),
         f"--tree file not found: {args.tree}"),
        (args.tree is not None and not tree_file and args.speculate not in ("eagle2", "eagle3"),
         "--tree TOP_K,DEPTH,TOKENS (or auto) sizes the dynamic trees of eagle2 and eagle3"),
        (args.lookup is not None and (args.lookup < 0 or (args.speculate == "lookup" and args.lookup < 1)),
         f"--lookup must be >= 0 (>= 1 with --speculate lookup), got {args.lookup}"),
        (args.speculate == "lookup" and args.draft_checkpoint_path,
         "--speculate lookup has no draft: --lookup sets how many tokens it guesses"),
        (takes_draft and not args.draft_checkpoint_path.exists(),
         f"--speculate {args.speculate} needs an EAGLE draft: {args.draft_checkpoint_path} not found "
         "(pass --draft_checkpoint_path, or train one with scripts/train_eagle.py)"),
    ] if wrong]
    if errors:
        raise ValueError("\n  ".join(errors))
    if prompt_file:
        args.prompt = prompt_file.read_text()
    row = defaults.row(args.device, args.compile)
    quantized = mode_from_path(args.checkpoint_path)[0]
    if args.dtype == "auto":  # eager on a CPU the mode holds in bf16 only
        args.dtype = "bfloat16" if args.batch_invariant and not args.compile else row.dtype
    problem = invariant.problem(args.device, args.dtype, args.compile, quantized, tp.launched_by_torchrun())
    if args.batch_invariant is None:
        args.batch_invariant = defaults.invariant(row, quantized) and problem is None
    if args.batch_invariant and problem:
        raise ValueError(problem)
    args.tree_file = args.tree if args.speculate == "eagle" else None  # None: mc_sim_7b_63
    args.tree_top_k = args.tree_depth = args.tree_tokens = None
    if args.speculate in ("eagle2", "eagle3"):
        tree = defaults.tree(row, args.speculate) if args.tree is None else args.tree
        args.tree_top_k, args.tree_depth, args.tree_tokens = (None, None, "auto") if tree == "auto" else tree
    if args.lookup is None:
        args.lookup = defaults.lookup(row, args.speculate)
    # what the command line no longer sets; the Python API and scripts/benchmark.py do
    args.top_p, args.compile_prefill, args.adaptive, args.draft_dtype = None, False, True, None
    return args


class Forwards(NamedTuple):
    """The tokens each target forward after the prefill emitted for one answer (a round's accepted
    ones plus the bonus, or 1 for a plain step) and how many were plain steps: adaptive decoding's
    plain steps, counted as rounds of one token, would hide what the head accepts."""
    emitted: list
    plain_steps: int = 0

    @property
    def rounds(self) -> int:
        return len(self.emitted) - self.plain_steps

    @property
    def tau(self) -> Optional[float]:
        """Tokens per speculative round, bonus included; None where every forward was a plain step."""
        return (sum(self.emitted) - self.plain_steps) / self.rounds if self.rounds else None

    def describe(self) -> str:
        """'tau 2.31 over 20 rounds', plus the plain steps if there were any."""
        text = f"tau {self.tau:.2f} over {self.rounds} rounds" if self.rounds else "no speculative round"
        if self.plain_steps:
            text += (f" and {self.plain_steps} plain steps ({self.plain_steps / len(self.emitted):.0%} of the "
                     f"forwards: rounds measured slower than plain steps there; "
                     f"{sum(self.emitted) / len(self.emitted):.2f} tokens per forward overall)")
        return text


def cache_length(needed: int, block_size: int) -> int:
    """The KV cache length of a compiled run of `needed` tokens: the next power of two from 512, at most
    the context. Graphs have static shapes, so a prompt of another length reuses them (or the disk cache's)."""
    return min(block_size, max(512, 1 << (needed - 1).bit_length()))


def make_decoder(args, model: Transformer, stop_ids, max_seq_length: int, probes=None):
    """A function prompt_ids, max_new_tokens, callback -> (new ids, Forwards or None) for the method
    args ask for, compiled if asked, its caches allocated once for up to max_seq_length tokens (no
    later call changes a compiled shape). probes: the prompts (lists of ids) --tree auto measures
    on; when it picks no tree, args.speculate becomes "none"."""
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if not args.compile:
        pack_linears(model)  # eager half precision on a CPU: weights in oneDNN's layout (a no-op elsewhere)
    if args.speculate != "none":  # before --tree auto measures shapes: does any tree fit?
        invariant.check_tree(model, 2, args.compile)
    if args.speculate == "none":
        model.setup_caches(1, max_seq_length)
        step, first = decode_one_token, prefill
        if args.compile and packages.usable(args.device, args.temperature, model):
            step = packages.packaged_step(model, packages.folder(args.checkpoint_path))
        elif args.compile:
            step = compile_step(decode_one_token, args.device, model)
        if args.compile and args.compile_prefill:
            first = compile_prefill(prefill, args.device, model)

        def decode(prompt_ids, max_new_tokens, callback=None, warm_up=False):
            n = min(max_new_tokens, WARM_UP_TOKENS) if warm_up else max_new_tokens
            return generate(model, torch.tensor([prompt_ids], device=args.device), n, stop_ids=stop_ids,
                            callback=callback, prefill_fn=first, decode_fn=step, **sampling)[0], None
        return decode

    if args.speculate == "lookup":
        return speculative_decoder(args, Speculator(model, None, lookup=args.lookup, stop_ids=stop_ids, **sampling),
                                   max_seq_length, args.adaptive)
    draft_dtype = getattr(torch, args.draft_dtype) if args.draft_dtype else model.norm.weight.dtype
    draft = load_draft(args.draft_checkpoint_path, model.config, args.device, draft_dtype,
                       arch=SPECULATE[args.speculate]["arch"])
    if not args.compile:
        pack_linears(draft)
    if args.tree_tokens == "auto":
        shape = auto_tree(model, draft, probes, args.device, args.compile, (args.checkpoint_path, args.draft_checkpoint_path),
                          args.tree_top_k, args.tree_depth, lookup=args.lookup, stop_ids=stop_ids, **sampling)
        if shape is None:
            args.speculate = "none"
            return make_decoder(args, model, stop_ids, max_seq_length)
        args.tree_top_k, args.tree_depth, args.tree_tokens = shape["tree_top_k"], shape["tree_depth"], shape["tree_tokens"]
    if args.speculate == "eagle":
        tree = dict(static=static_tree(json.loads(Path(args.tree_file).read_text()) if args.tree_file else mc_sim_7b_63))
    else:
        tree = dict(tree_top_k=args.tree_top_k, tree_depth=args.tree_depth, tree_tokens=args.tree_tokens)
    spec = Speculator(model, draft, stop_ids=stop_ids, lookup=args.lookup, **tree, **sampling)
    return speculative_decoder(args, spec, max_seq_length, args.adaptive)


def speculative_decoder(args, spec: Speculator, max_seq_length: int, adaptive: bool):
    """make_decoder's decode function for a Speculator: caches for max_seq_length tokens plus the
    last round's overshoot, compiled if asked."""
    invariant.check_tree(spec.target, spec.n_nodes, args.compile)
    spec.setup(1, max_seq_length + 2 * (spec.depth + 1))
    if args.compile and packages.usable(args.device, spec.sampling[0], spec) and not args.compile_prefill:
        packages.package_round(spec, packages.folder(args.checkpoint_path))
    elif args.compile:
        compile_round(spec, args.compile_prefill)

    def decode(prompt_ids, max_new_tokens, callback=None, warm_up=False):
        prompt = torch.tensor([prompt_ids], device=args.device)
        modes = itertools.cycle(("round", "plain")) if warm_up and adaptive else None
        n = min(max_new_tokens, WARM_UP_TOKENS) if warm_up else max_new_tokens
        ids, per_round = speculative_generate(spec, prompt, n, callback=callback, adaptive=adaptive, force_modes=modes)
        if modes is not None and spec.draft is not None:
            spec.flush()  # a plain burst flushes only when short of room, which a short warm-up may never be
        return ids[0], Forwards(per_round[0], spec.plain_steps[0])
    return decode


def main(argv=None):
    args = parse_args(argv)
    try:  # under torchrun: this rank's part of the target, and its device (tp.py)
        shard, device = tp.start(args.device, tp.DEFAULT_TIMEOUT_S, vars(args))
        torch.manual_seed(args.seed)  # every rank draws the same random stream
        args.device, dtype = device, getattr(torch, args.dtype)
        t0 = time.perf_counter()
        model = load_model(args.checkpoint_path, device, dtype, shard)
        if args.batch_invariant:
            invariant.enable(model)
        tokenizer = load_tokenizer(args.checkpoint_path.parent)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    device_sync(device)
    print(f"Loaded {args.checkpoint_path} in {time.perf_counter() - t0:.2f} s ({device}, {args.dtype}"
          + (", batch-invariant" if args.batch_invariant else "") + ")"
          + (f", tensor parallel over {shard.world_size} ranks: {tp.weight_bytes(model) / 1e9:.3f} GB of weights each"
             if shard else ""), file=sys.stderr)

    if args.interactive:
        context = min(model.config.block_size, 4096)
        return interactive(make_decoder(args, model, tokenizer.stop_ids, context, probe_prompts(tokenizer)),
                           context, tokenizer, args)

    prompt_ids = (tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                  else tokenizer.encode(args.prompt))
    needed = len(prompt_ids) + args.max_new_tokens
    if needed > model.config.block_size:
        sys.exit(f"error: the prompt has {len(prompt_ids)} tokens; with --max_new_tokens {args.max_new_tokens} "
                 f"that is {needed}, more than the model's context of {model.config.block_size} tokens")
    context = cache_length(needed, model.config.block_size) if args.compile else needed
    try:
        if args.compare:
            return compare(args, model, tokenizer, prompt_ids, context)
        decode = make_decoder(args, model, tokenizer.stop_ids, context, probe_prompts(tokenizer, args.chat))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")

    if args.compile:  # the first call compiles (or loads the compiled graphs): a warm-up, not reported
        print("Compiling, or loading what an earlier run compiled (the first time takes minutes)...", file=sys.stderr)
        t = time.perf_counter()
        decode(prompt_ids, args.max_new_tokens, warm_up=True)
        print(f"Compilation and warm-up: {time.perf_counter() - t:.2f} s", file=sys.stderr)
    device_sync(device)
    t = time.perf_counter()
    ids, rounds = decode(prompt_ids, args.max_new_tokens)
    device_sync(device)
    seconds = time.perf_counter() - t
    tok_s = len(ids) / seconds
    text = tokenizer.decode(_strip_stop(ids, tokenizer.stop_ids))
    print(text, flush=True)
    print(f"\n{len(ids)} tokens in {seconds:.2f} s, {tok_s:.2f} tok/s", file=sys.stderr)
    try:
        tp.check_same_on_all_ranks("tokens", ids)
    except ValueError as e:
        sys.exit(f"error: {e}")
    report = {"checkpoint": str(args.checkpoint_path), "prompt_ids": prompt_ids, "token_ids": ids, "text": text,
              "new_tokens": len(ids), "tokens_per_s": tok_s,
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
              "dtype": args.dtype, "compiled": args.compile, "batch_invariant": args.batch_invariant,
              "speculate": args.speculate, "temperature": args.temperature, "top_k": args.top_k,
              "tensor_parallel": shard.world_size if shard else 1, "weight_bytes_per_rank": tp.weight_bytes(model)}
    if rounds is not None and rounds.emitted:  # tau: tokens per round (bonus included), plain steps apart
        histogram = {n: rounds.emitted.count(n) for n in range(1, max(rounds.emitted) + 1)}
        histogram[1] -= rounds.plain_steps  # rounds that accepted no guess
        report.update(mean_accepted=rounds.tau, rounds=rounds.rounds, plain_steps=rounds.plain_steps,
                      accepted_histogram=histogram)
        print(f"Speculative rounds: {rounds.describe()}", file=sys.stderr)
    else:
        report["bandwidth_gb_s"] = model_bytes_per_token(model) * tok_s / 1e9
        print(f"Bandwidth achieved: {report['bandwidth_gb_s']:.2f} GB/s (model weights read per token: "
              f"{model_bytes_per_token(model) / 1e9:.3f} GB{', per rank' if shard else ''})", file=sys.stderr)
    print(f"Memory used: {peak_memory_gb(device):.2f} GB", file=sys.stderr)
    if args.output_json and (shard is None or shard.rank == 0):
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=1))
    tp.finish()


def compare(args, model: Transformer, tokenizer, prompt_ids, max_seq_length: int) -> dict:
    """--compare: the prompt answered plainly, then speculatively (streamed), with the same dtype,
    device and compile setting, each timed as one whole call after its warm-up (with --compile);
    prints both speeds, their ratio, tau and whether the answers are identical (at temperature 0
    they must be, in float32 or in batch-invariant mode: speculation is lossless). Returns the report."""
    plain = make_decoder(argparse.Namespace(**{**vars(args), "speculate": "none"}), model, tokenizer.stop_ids,
                         max_seq_length)
    speculative = make_decoder(args, model, tokenizer.stop_ids, max_seq_length, probe_prompts(tokenizer, args.chat))
    runs, compile_s, forwards = {}, {}, {}
    for name, decode in (("plain", plain), ("speculative", speculative)):
        if args.compile:  # compiling (or loading the compiled graphs from the disk cache) and a warm-up
            print(f"{name}: compiling, or loading what an earlier run compiled (the first time takes minutes)...",
                  file=sys.stderr)
            t = time.perf_counter()
            decode(prompt_ids, args.max_new_tokens, warm_up=True)
            compile_s[name] = time.perf_counter() - t
        streamer = TextStreamer(tokenizer) if name == "speculative" else None
        if streamer is not None:
            print("Assistant: " if args.chat else "", end="", flush=True)
        torch.manual_seed(args.seed)  # the same random stream for both (sampling)
        device_sync(args.device)
        t = time.perf_counter()
        ids, rounds = decode(prompt_ids, args.max_new_tokens,
                             callback=None if streamer is None else lambda tok: streamer.put(int(tok[0])))
        device_sync(args.device)
        seconds = time.perf_counter() - t
        runs[name] = dict(token_ids=ids, new_tokens=len(ids), seconds=seconds, tokens_per_s=len(ids) / seconds,
                          mean_accepted=1.0 if rounds is None else rounds.tau)
        if rounds is not None:
            runs[name].update(rounds=rounds.rounds, plain_steps=rounds.plain_steps)
        forwards[name] = rounds
    setting = f"{args.dtype}, {'compiled' if args.compile else 'eager'}" + (", batch-invariant" if args.batch_invariant else "")
    method = args.speculate  # "none" when --tree auto found no tree worth it
    shape = {"none": "", "eagle": ", static tree", "lookup": ""}.get(method, f", {args.tree_tokens}-token trees")
    shape += f" + {args.lookup} lookup tokens" if args.lookup and method != "none" else ""
    p, s = runs["plain"], runs["speculative"]
    print(f"\n\nplain decoding ({setting}):".ljust(46) + f"{p['new_tokens']:4d} tokens in {p['seconds']:6.2f} s = "
          f"{p['tokens_per_s']:7.2f} tok/s", file=sys.stderr)
    print(f"{method} ({setting}{shape}):".ljust(44) + f"{s['new_tokens']:4d} tokens in {s['seconds']:6.2f} s = "
          f"{s['tokens_per_s']:7.2f} tok/s, "
          + (forwards["speculative"].describe() if forwards["speculative"] is not None else "tau 1.00"), file=sys.stderr)
    speedup, identical = s["tokens_per_s"] / p["tokens_per_s"], p["token_ids"] == s["token_ids"]
    if args.temperature > 0:
        verdict = "sampled: the answers are drawn from the same distribution, not expected to be equal"
    elif identical:
        verdict = "the two answers are identical"
    elif args.dtype != "float32" and not args.batch_invariant:
        verdict = ("the answers differ (in bfloat16/float16 they can where two tokens nearly tie: a verify and a "
                   "one-token step round differently; float32 or --batch_invariant give identical answers)")
    else:
        verdict = "the answers differ: this is a bug, please report it"
    print(f"speedup {speedup:.2f}x; {verdict}", file=sys.stderr)
    if compile_s:
        print(f"compiling took {compile_s['plain']:.0f} s (plain) + {compile_s['speculative']:.0f} s (speculative), "
              f"warm-up run included; graphs are cached on disk, so a second run loads them", file=sys.stderr)
    report = {"checkpoint": str(args.checkpoint_path), "prompt_ids": prompt_ids, "dtype": args.dtype,
              "compiled": args.compile, "speculate": method, "temperature": args.temperature,
              "plain": p, "speculative": s, "speedup": speedup, "identical": identical, "compile_s": compile_s}
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=1))
    return report


def _strip_stop(ids, stop_ids):
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def interactive(decode, context: int, tokenizer, args):
    """Streamed multi-turn chat; the whole conversation is re-encoded and prefilled every turn."""
    messages = []
    print(f"Chat with the model (up to {context} tokens of context). An empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("\nYou: ").strip()
        except EOFError:
            return
        if not user:
            return
        messages.append({"role": "user", "content": user})
        prompt_ids = tokenizer.apply_chat_template(messages)
        if len(prompt_ids) >= context:
            print("(the conversation no longer fits in the context; starting over)", file=sys.stderr)
            messages = messages[-1:]
            prompt_ids = tokenizer.apply_chat_template(messages)
            if len(prompt_ids) >= context:
                print("(that message alone is too long)", file=sys.stderr)
                messages = []
                continue
        print("Assistant: ", end="", flush=True)
        streamer = TextStreamer(tokenizer)
        t = time.perf_counter()
        ids, _ = decode(prompt_ids, min(args.max_new_tokens, context - len(prompt_ids)),
                        callback=lambda tok: streamer.put(int(tok[0])))
        print(f"\n[{len(ids)} tokens, {len(ids) / (time.perf_counter() - t):.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": tokenizer.decode(_strip_stop(ids, tokenizer.stop_ids))})


if __name__ == "__main__":
    main()
