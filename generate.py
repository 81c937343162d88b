"""Text generation: vanilla decoding with a static KV cache, compiled with torch.compile.

    python generate.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth --chat \
        --prompt "What is the capital of France?" --compile

The decode step is one compiled graph (CUDA graphs on GPU). The next token never leaves the
device: the host looks at generated tokens only to stream them or, every few steps, to stop at
an end-of-turn token.

Tensor parallelism (tp.py): the same command under torchrun shards the target over the ranks;
rank 0 prints and writes the JSON report.

    python -m torch.distributed.run --nproc_per_node 2 generate.py --checkpoint_path ... --speculate eagle2
"""
import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

import tp
from checkpoint import load_draft, load_model
from draft import Eagle3Draft, EagleDraft
from model import (INVARIANT_WINDOW, PackedLinear, Transformer, eager_invariant_rows, pack_linears,
                   set_attention_backend)
import quantize
from quantize import mode_from_path, set_row_invariant
from sampling import all_stopped, cut_at_stop, sample
from speculative import (AUTO_TOP_K, Speculator, auto_shape, compile_function, compile_round, cpu_info, device_sync,
                         file_key, machine_key, missing_cpu_compile_settings, speculative_generate)

STOP_CHECK_EVERY = 16  # decode steps between host syncs that look for a stop token when not streaming


# ---------------------------------------------------------------------------------------------
# Vanilla decoding
# ---------------------------------------------------------------------------------------------
def prefill(model: Transformer, prompt: Tensor, temperature, top_k, top_p) -> Tensor:
    """Run the prompt [B, L] through the model, filling cache slots 0..L-1; returns the first new token [B]."""
    input_pos = torch.arange(prompt.size(1), device=prompt.device)
    with quantize.prefill_rows(model):
        logits = model(prompt, input_pos)
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
    model.setup_caches(B, L + max_new_tokens)  # no-op when the caches are already large enough
    if L + max_new_tokens > model.max_seq_length:
        raise ValueError(f"prompt ({L}) + max_new_tokens ({max_new_tokens}) exceed the KV cache ({model.max_seq_length})")
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=prompt.device)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=prompt.device)

    token = prefill_fn(model, prompt, temperature, top_k, top_p)
    out[:, 0] = token
    input_pos = torch.tensor([L], device=prompt.device)
    n = 1
    while True:
        if callback is not None:
            callback(out[:, n - 1])
        # Stop checks are the only host syncs: every step while streaming, else every few steps.
        if n == max_new_tokens or ((callback is not None or n % STOP_CHECK_EVERY == 0) and all_stopped(out[:, :n], stop)):
            break
        token = decode_fn(model, token.clone(), input_pos, temperature, top_k, top_p)
        out[:, n] = token
        input_pos += 1
        n += 1
    return [cut_at_stop(row, stop_ids) for row in out[:, :n].tolist()]



def model_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights read by one decode step: every parameter except the embedding table, of
    which a step reads one row (unless it doubles as the LM head), and of mixture-of-experts
    weights only the k of E experts the token is routed to. The state dict, not the parameters:
    quantized weights and their scales are buffers."""
    seen, total = set(), 0
    c = model.config
    for name, p in model.state_dict(keep_vars=True).items():
        if id(p) in seen or (name == "tok_embeddings.weight" and model.output.weight is not p):
            continue
        seen.add(id(p))
        size = p.numel() * p.element_size()
        # an expert stack's weight, or its int8 scales
        experts = c.num_experts and name.rsplit(".", 1)[0].endswith(("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))
        total += size * c.num_activated_experts // c.num_experts if experts else size
    for m in model.modules():  # eager half precision on a CPU: oneDNN's packed weights, not in the state dict
        if type(m) is PackedLinear:
            total += sum(t.numel() * t.element_size() for t in (m.weight, m.bias) if t is not None)
    return total


def peak_memory_gb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_reserved() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


def compile_decoding(device: str, compile_prefill: bool, model: Transformer):
    """The decode step becomes one graph of static shapes. On CUDA it replays as a CUDA graph
    ("triton.cudagraphs", all that mode="reduce-overhead" sets: torch.compile takes a mode or
    options, not both), with gpt-fast's settings: coordinate-descent tuning (a small graph, tuned
    once) and the FX graph cache. On a CPU it compiles with Inductor's CPU-inference settings
    (speculative.cpu_backend: frozen weights, C++ GEMM templates, cached on disk by the weights of
    model). The prompt length varies, so prefill is compiled with dynamic shapes and no CUDA
    graphs. Settings are per function, not global, so that a speculative round compiled in the
    same process keeps its own (speculative.ROUND_OPTIONS)."""
    global decode_one_token, prefill
    decode_one_token = compile_step(decode_one_token, device, model)
    if compile_prefill:
        prefill = compile_function(prefill, device, (model,), dynamic=True, options={"fx_graph_cache": True})
    set_tensor_parallel_flags()


def compile_step(step, device: str, model: Transformer):
    """step (decode_one_token's signature) compiled as compile_decoding compiles it: every plain
    decoding that is timed beside another goes through here, so that none of them runs without
    the CUDA graphs (a compiled SmolLM2 step without them took 6.7 ms on an H100, with them 1.1)."""
    return compile_function(step, device, (model,), options={
        "triton.cudagraphs": True, "coordinate_descent_tuning": device.startswith("cuda") and not tp.active(),
        "fx_graph_cache": True})


def set_tensor_parallel_flags():
    """Under tensor parallelism inductor may not choose kernels by timing them: two ranks could
    choose two that round differently, and diverge (coordinate-descent tuning is off per function
    then, in these options and speculative.ROUND_OPTIONS)."""
    if tp.active() and hasattr(torch._inductor.config, "deterministic"):  # newer torch: no timing among configs
        torch._inductor.config.deterministic = True


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _tree_tokens_arg(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tree nodes or 'auto', got {value!r}") from None


def batch_invariant_problem(device: str, dtype: str, compile: bool, checkpoint_path) -> Optional[str]:
    """Why --batch_invariant does not hold for this run, in one line, or None where it does. What
    was measured to hold (the target's rows of a verify equal one-token steps', bit for bit, on this
    project's 2-core AMX CPU, torch 2.13: tests/test_model.py, tests/test_quantize.py):
        compiled  bfloat16, float16, float32 (the C++ GEMM templates), int8/int4 files in bfloat16
        eager     bfloat16 (oneDNN; trees of at most model.eager_invariant_rows nodes, which the CPU
                  decides: 32 on the AMX Xeon, 1 on an AMD EPYC) and int8/int4 files in bfloat16
                  (torch's int8/int4 CPU kernels);
                  (eager float32 and float16 GEMMs gave every row of 8- and 30-row verifies apart)
    On CUDA the target runs on invariant_kernels.py's Triton kernels, in every dtype, eager or
    compiled, int8/int4 files included (their weights dequantized tile by tile inside the kernel;
    proven in Triton's interpreter, compiled ahead of time, and on an H100: SmolLM2 in bf16
    compiled, every greedy MT-bench answer equal; the quantized kernels not yet on a GPU); tensor
    parallelism has no invariant path there."""
    if tp.launched_by_torchrun():
        return "--batch_invariant is built for one process, not under torchrun"
    quantized = mode_from_path(checkpoint_path)[0]
    if device.startswith("cuda"):
        return None
    if device != "cpu":
        return f"--batch_invariant is built for a CPU or CUDA, not --device {device}"
    if quantized is not None and dtype != "bfloat16":
        return f"--batch_invariant with a quantized file ({Path(checkpoint_path).name}) is built for bfloat16, not {dtype}"
    if not compile and dtype != "bfloat16":
        return (f"--batch_invariant in {dtype} needs --compile (eager {dtype} GEMMs round a verify's rows apart "
                f"from a one-token step's: measured); eager, use --dtype bfloat16")
    return None


# --dtype auto of a compiled CPU run: bfloat16 (half float32's bytes a step) except on the CPUs
# named here, (vendor_id, cpu family) as /proc/cpuinfo gives them, where compiled float32 measured
# faster than bf16 for plain and speculative decoding alike (SmolLM2, benchmarks/README.md, "The
# new head compiled on the Zen 5"): AMD family 26 (Zen 5), plain steps 12.93 against 15.66 ms in
# one process, eagle3 rounds 17.55 against 27.00 ms, EAGLE-3 on MT-bench 89.7 against 71.7 tok/s,
# the demo 118.9 against 81.3 tok/s. Not a Zen 3 (family 25), whose float32 plain step costs a
# third more (20.6 against 15.2 ms); Zen 4 (also family 25) and AMX Xeons were not timed in float32.
FLOAT32_COMPILED_CPUS = {("AuthenticAMD", "26")}


def compiled_cpu_dtype(checkpoint_path) -> str:
    """--dtype auto for a compiled CPU run: float32 for an unquantized file on FLOAT32_COMPILED_CPUS,
    else bfloat16 (int8 and int4 files are built for bfloat16)."""
    info = cpu_info()
    fast_float32 = (info.get("vendor_id"), info.get("cpu family")) in FLOAT32_COMPILED_CPUS
    return "float32" if fast_float32 and mode_from_path(checkpoint_path)[0] is None else "bfloat16"


def batch_invariant_by_default(device: str, dtype: str, compile: bool, checkpoint_path) -> bool:
    """--batch_invariant's default: on where the mode was measured to cost at most 10 % of a plain
    step and of a round against plain decoding without it (issue 22), so that greedy speculative
    output equals plain decoding's in bfloat16 without asking, and in float32 bit for bit rather
    than up to float ties. Compiled on a CPU without AMX (AMD EPYC, Zen 5, SmolLM2, the 4-token
    default tree; scripts/invariant_cost.py, benchmarks/README.md): bf16 a step +5.4 % (15.64
    against 14.84 ms), a round +3.0 % (27.81 against 27.00 ms); float32 a step +5.3 % (12.25
    against 11.64 ms), a round +4.7 % (MT-bench plain decoding 8.9 % slower, whole answers; again
    with the turns in alternating order: bf16 +8.1 % and +3.0 %, float32 +2.0 % and -0.4 %); on a
    Zen 3 (no AVX-512, bf16) a step 16.7 against 15.2 ms, a round 35.1 against 33.5 ms; on a Zen 4
    (bf16, 30 turns alternating) a step -0.3 %, a round +7.7 % (+9.4 % and +11 % in three runs of
    profile_round.py before, one order). int8 files (bf16) where their layers compile to Inductor's
    C++ template, the code of plain decoding's step (quantize.INDUCTOR_INT8_ROWS_INVARIANT: AVX2 or
    AVX-512 without AMX; a Zen 5, three runs of turns in alternating order: a step -3.2, +3.1,
    -1.1 %, a round +7.1, +12.2, +6.4 %, MT-bench plain decoding 6.4 % slower, whole answers;
    through torch's int8 kernel, as the mode ran them before, +29 % and +19 %; a Zen 4, one run: a
    step +4.7 %, a round +7.5 %). Since the window attention's recent call runs in float32
    (2026-11-30; a Zen 4, three runs of 30 turns alternating each): float16 a step +3.2, +1.9,
    +4.0 %, a round +4.9, +4.6, +5.7 % (before: a round +10.5 to +13.3 %, median +12.1 %); int4
    files (bf16) where their layers compile to Inductor's int4 template
    (quantize.INDUCTOR_INT4_ROWS_INVARIANT: AVX-512 without AMX) a step +11.1, +6.3, +5.3 %, a
    round +11.3, +8.1, +6.7 %: medians +6.3 % and +8.1 % (before: a round median +11.3 %). Off: with
    AMX (bf16: a step cost 15 %, 17.8 against 15.5 ms; float32 not timed; int8 files there keep the
    kernel), on CUDA (an H100, SmolLM2 compiled in bf16: a step cost 67 %, 1.82 against 1.09 ms, a
    round ~20 %; an H200, split-K and attention chunks: a step 69 %), int4 files without the
    template (their kernel called directly: a Zen 4, one run, +11.1 % and +14.4 %; called back
    through Python on a Zen 5: +42 % and +20 %). Eager runs were not timed against the 10 %: off
    until they are."""
    quantized = mode_from_path(checkpoint_path)[0]
    return (device == "cpu" and compile and dtype in ("bfloat16", "float32", "float16")
            and (quantized is None
                 or quantized == "int8" and quantize.INDUCTOR_INT8_ROWS_INVARIANT
                 or quantized == "int4" and quantize.INDUCTOR_INT4_ROWS_INVARIANT)
            and not torch.cpu._is_amx_tile_supported()
            and batch_invariant_problem(device, dtype, compile, checkpoint_path) is None)


def set_batch_invariant(model: Transformer) -> Transformer:
    """--batch_invariant: the target's attention over a layout fixed by each query's position
    (model.invariant_attention; on CUDA invariant_kernels.window_attention), its int8 layers on one
    kernel for every row count (quantize.set_row_invariant), and on CUDA its linears and norms on
    invariant_kernels.py's kernels."""
    model.invariant_window = INVARIANT_WINDOW
    if model.max_seq_length > 0:  # a cache set up before: setup_caches grows it as the mode needs
        model.setup_caches(model.max_batch_size, model.max_seq_length)
    set_row_invariant(model)
    if model.tok_embeddings.weight.is_cuda:
        from invariant_kernels import use_invariant_kernels  # needs Triton, as CUDA runs do anyway
        use_invariant_kernels(model)
    return model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct/model.pth"))
    p.add_argument("--prompt", type=str, default=None, help="prompt text (default: 'Hello, my name is')")
    p.add_argument("--prompt_file", type=Path, default=None, help="read the prompt text from this file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--interactive", action="store_true", help="chat in the terminal, streaming the answers")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k most probable tokens")
    p.add_argument("--top_p", type=float, default=None, help="nucleus sampling: smallest set with this much mass")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step / speculative round (default: on for a CPU, off for CUDA). On CUDA: "
                        "CUDA graphs; on a CPU: frozen weights and Inductor's C++ GEMM templates, 2x eager's speed "
                        "in bfloat16, compiled once per machine (a minute or two per graph) and cached on disk")
    p.add_argument("--compile_prefill", action="store_true", help="also compile prefill (dynamic shapes)")
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on CUDA and compiled on a CPU (the fastest), but float32 compiled on the CPUs "
                        "where it measured faster (FLOAT32_COMPILED_CPUS: AMD Zen 5); float32 for eager CPU runs")
    p.add_argument("--output_json", type=Path, default=None, help="write prompt, outputs and speed here")
    p.add_argument("--compare", action="store_true",
                   help="answer the prompt twice, plain and with --speculate (streamed), and print both speeds, "
                        "the speedup, tau and whether the answers are identical")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculate", choices=["none", *SPECULATE], default="none",
                   help="eagle: EAGLE-1 head, static tree; eagle2: EAGLE-1/2 head, dynamic tree; eagle3: EAGLE-3 "
                        "head (fused layers, its own reduced-vocabulary LM head), dynamic tree; lookup: prompt lookup "
                        "alone (the continuation of the longest earlier match of the text's last words), no draft")
    g.add_argument("--draft_checkpoint_path", type=Path, default=None,
                   help="EAGLE draft folder (default: eagle/ beside the checkpoint; eagle3/ for --speculate eagle3)")
    g.add_argument("--draft_dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="eagle3: the draft's dtype (default: the target's). The output does not depend on it (the "
                        "target verifies every token); bfloat16 makes each draft level cheaper on a CPU")
    g.add_argument("--tree_top_k", type=int, default=None,
                   help="eagle2/eagle3: children per expanded node (default 10; compiled on a CPU 8 with AMX, 4 "
                        "without; with auto, chosen unless given)")
    g.add_argument("--tree_depth", type=int, default=None,
                   help="eagle2/eagle3: levels of draft guesses (default 6 for eagle2, 8 for eagle3, as in their "
                        "papers; 3 compiled on a CPU; with auto, chosen unless given); at most --tree_tokens - 1, "
                        "the deepest a tree of that many nodes reaches")
    g.add_argument("--tree_tokens", type=_tree_tokens_arg, default=None,
                   help="eagle2/eagle3: nodes verified per round, root included (default: compiled on a CPU 12 "
                        "with AMX, 4 without; auto for eager CPU runs; 60 on a GPU); auto: choose top_k, depth and tokens from what rounds "
                        "cost on this machine (compiled graphs on a CPU: a few minutes, once) and how "
                        "often the head's guesses are accepted, measured once and cached "
                        "(speculative.auto_shape), or decode without speculation if no tree pays")
    g.add_argument("--lookup", type=int, default=None,
                   help="prompt lookup's guesses as a chain of this many more nodes in every tree, verified in the "
                        "same forward pass (default 8 for eagle/eagle2/eagle3, 0 with the compiled CPU tree of a "
                        "CPU without AMX; 10 for --speculate lookup; 0: none)")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="switch between speculative rounds and plain steps as the answer goes, whichever is faster "
                        "by running estimates of their cost and of what rounds accept (default: on)")
    g.add_argument("--tree", type=Path, default=None,
                   help="eagle: JSON list of child-rank paths for the static tree (default: mc_sim_7b_63)")
    g.add_argument("--attention", choices=["auto", "sdpa", "triton"], default="auto",
                   help="tree attention: triton = the fused kernel of tree_attention.py (CUDA only), sdpa = SDPA "
                        "with dense masks; auto: triton on CUDA when triton is installed, else sdpa")
    p.add_argument("--batch_invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="compute every token's logits bit for bit the same in a one-token step and in a verify "
                        "of many (model.invariant_attention): greedy speculative output then equals plain "
                        "decoding's in bfloat16 and float16 too (CPU: bfloat16, or float16/float32 with --compile). "
                        "Default: on where it was measured to cost <= 10%% (compiled runs on a CPU without AMX: "
                        "bfloat16, float32 and float16, and int8/int4 files where Inductor's templates take "
                        "their layers), off elsewhere")
    p.add_argument("--tp_timeout", type=float, default=tp.DEFAULT_TIMEOUT_S,
                   help="tensor parallelism (under torchrun): seconds a rank waits for the others, to join and "
                        "at each collective, before it gives up with an error")
    args = p.parse_args(argv)

    if args.compile is None:  # the fastest on a CPU; CUDA compiles when asked, as in gpt-fast
        args.compile = args.device == "cpu" and not tp.launched_by_torchrun()
    errors = []
    if args.temperature < 0:
        errors.append(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        errors.append(f"--top_k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        errors.append(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        errors.append(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_samples < 1:
        errors.append(f"--num_samples must be >= 1, got {args.num_samples}")
    if args.interactive and tp.launched_by_torchrun():
        errors.append("--interactive reads the terminal in one process; under torchrun (tensor parallelism) pass "
                      "--prompt or --prompt_file")
    if args.compare and (args.speculate == "none" or args.interactive or args.num_samples != 1):
        errors.append("--compare puts plain decoding beside --speculate METHOD, for one prompt (not --interactive, "
                      "not --num_samples)")
    if args.tp_timeout <= 0:
        errors.append(f"--tp_timeout must be > 0 seconds, got {args.tp_timeout}")
    if args.prompt is not None and args.prompt_file is not None:
        errors.append("give --prompt or --prompt_file, not both")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        errors.append(f"--prompt_file not found: {args.prompt_file}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        errors.append(f"--device {args.device} requested but CUDA is not available")
    missing = missing_cpu_compile_settings() if args.compile and args.device == "cpu" else []
    if missing:
        errors.append(f"--compile on a CPU needs {', '.join(missing)}, which torch "
                      f"{torch.__version__} lacks: upgrade torch (2.13 has them) or run without --compile")
    if args.attention == "triton" and not args.device.startswith("cuda"):
        errors.append(f"--attention triton runs on CUDA, not on --device {args.device} (use --attention sdpa)")
    if args.tree is not None and args.speculate != "eagle":
        errors.append("--tree sets the static tree of --speculate eagle")
    if args.tree_tokens == "auto" and args.speculate == "eagle":
        errors.append("--tree_tokens auto sizes the dynamic trees of eagle2 and eagle3; eagle's static tree has a fixed size")
    if args.draft_dtype is not None and args.speculate != "eagle3":
        errors.append("--draft_dtype sets the dtype of an EAGLE-3 head (--speculate eagle3); EAGLE-1/2 heads draw "
                      "on the target's LM head, in the target's dtype")
    if args.tree is not None and not args.tree.is_file():
        errors.append(f"--tree file not found: {args.tree}")
    if args.lookup is not None and (args.lookup < 0 or (args.speculate == "lookup" and args.lookup < 1)):
        errors.append(f"--lookup must be >= 0 (>= 1 with --speculate lookup), got {args.lookup}")
    if args.speculate == "lookup" and (args.draft_checkpoint_path or args.tree_tokens or args.tree_top_k
                                       or args.tree_depth):
        errors.append("--speculate lookup has no draft and no tree: --lookup sets how many tokens it guesses")
    if args.speculate not in ("none", "lookup"):
        if args.draft_checkpoint_path is None:
            args.draft_checkpoint_path = args.checkpoint_path.parent / SPECULATE[args.speculate]["folder"]
        if not args.draft_checkpoint_path.exists():
            errors.append(f"--speculate {args.speculate} needs an EAGLE draft: {args.draft_checkpoint_path} not found "
                          f"(pass --draft_checkpoint_path, or train one with scripts/train_eagle.py)")
    if errors:
        p.error("\n  ".join(errors))
    if args.dtype == "auto":  # eager on a CPU oneDNN's bf16 gains nothing, but the eager mode holds in bf16 only
        if args.device.startswith("cuda"):
            args.dtype = "bfloat16"
        elif args.compile:
            args.dtype = compiled_cpu_dtype(args.checkpoint_path)
        else:
            args.dtype = "bfloat16" if args.batch_invariant else "float32"
    if args.batch_invariant is None:
        args.batch_invariant = batch_invariant_by_default(args.device, args.dtype, args.compile, args.checkpoint_path)
    if args.batch_invariant:
        problem = batch_invariant_problem(args.device, args.dtype, args.compile, args.checkpoint_path)
        if problem:
            p.error(problem)
    if args.tree_tokens is None and args.device == "cpu" and args.speculate in ("eagle2", "eagle3"):
        if args.compile:  # a measured shape; auto would compile a few graphs to time them (minutes, once)
            tree = cpu_compiled_tree()
            args.tree_tokens = tree["tree_tokens"]
            args.tree_top_k = args.tree_top_k or tree["tree_top_k"]
            args.tree_depth = args.tree_depth or tree["tree_depth"]
            args.lookup = tree["lookup"] if args.lookup is None else args.lookup
        else:  # eager, measuring takes seconds
            args.tree_tokens = "auto"
    if args.lookup is None:
        args.lookup = {"none": 0, "lookup": 10}.get(args.speculate, 8)
    if args.tree_tokens is None:
        args.tree_tokens = 60
    if args.tree_tokens != "auto":  # auto searches what is not given
        args.tree_top_k = 10 if args.tree_top_k is None else args.tree_top_k
        args.tree_depth = SPECULATE.get(args.speculate, SPECULATE["eagle2"])["depth"] if args.tree_depth is None \
            else args.tree_depth
    return args


# --speculate METHOD: the head it takes (its default folder beside the checkpoint) and the tree
# depth of its paper (EAGLE-2: depth 6 for 7B/13B targets; EAGLE-3: depth 8 for an 8B target).
SPECULATE = {
    "eagle": dict(folder="eagle", depth=5, arch=EagleDraft),  # the static tree sets its own depth
    "eagle2": dict(folder="eagle", depth=6, arch=EagleDraft),
    "eagle3": dict(folder="eagle3", depth=8, arch=Eagle3Draft),
    "lookup": dict(folder=None, depth=0, arch=None),  # no draft: prompt lookup's chain alone
}


# The tree (and prompt lookup's nodes in it) of a compiled CPU run without --tree_tokens, by whether
# the CPU has AMX tiles. What a verify of T tokens costs depends on the CPU's matrix units (compiled
# bf16, SmolLM2-135M, MT-bench; benchmarks/README.md has the runs):
# - with AMX (Intel Xeon, Sapphire Rapids on) a 12-token verify costs ~1.2-1.3 steps, and top-k 8,
#   depth 3, 12 tokens with 8 lookup nodes measured fastest (1.37x plain decoding);
# - without (AMD EPYC: AVX-512 with bf16 dot products) a verify of 4 tokens costs 1.2-1.5
#   steps and one of 8-12 tokens ~3: 12-token trees ran at 0.65x plain decoding (1.01x with 8
#   lookup nodes, adaptive decoding taking plain steps for 89 % of the forwards), 4-token trees of
#   top-k 4, depth 3 without lookup nodes at 1.00-1.19x (two runs).
# --tree_tokens auto times this machine's compiled graphs instead (minutes of compiling, once).
CPU_COMPILED_TREE = {"amx": dict(tree_top_k=8, tree_depth=3, tree_tokens=12, lookup=8),
                     "no_amx": dict(tree_top_k=4, tree_depth=3, tree_tokens=4, lookup=0)}


def cpu_compiled_tree() -> dict:
    """The default tree of a compiled CPU run on this CPU (CPU_COMPILED_TREE)."""
    return CPU_COMPILED_TREE["amx" if torch.cpu._is_amx_tile_supported() else "no_amx"]


def check_head(method: str, draft, path):
    """A clear error when the head on disk is not the kind the method runs."""
    if not isinstance(draft, SPECULATE[method]["arch"]):
        kind = "an EAGLE-3" if isinstance(draft, Eagle3Draft) else "an EAGLE-1/2"
        right = "eagle3" if isinstance(draft, Eagle3Draft) else "eagle2 (or eagle)"
        raise ValueError(f"{path} holds {kind} head: use --speculate {right}, or pass the right --draft_checkpoint_path")


# --tree_tokens auto probes the head's acceptance on these, always the same (so that its cached
# measurement serves every later prompt), none from an evaluation set.
PROBE_TEXTS = ["Explain how a bicycle stays upright.", "Write a short poem about the sea.",
               "Give me three tips for learning a new language.", "What is the difference between weather and climate?"]


def probe_prompts(tokenizer, chat: bool = True) -> list:
    """PROBE_TEXTS as token ids (in the chat template, with chat)."""
    if chat:
        return [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in PROBE_TEXTS]
    return [tokenizer.encode(text) for text in PROBE_TEXTS]


class Forwards(NamedTuple):
    """What the target's forwards after the prefill emitted for one speculative answer: per
    forward, its tokens (a round's accepted ones plus the bonus, or 1 for a plain step), and how
    many forwards were plain steps. --adaptive takes plain steps where rounds do not pay on this
    machine; counted as rounds of one token they would hide what the head accepts."""
    emitted: list
    plain_steps: int = 0

    def __add__(self, other: "Forwards") -> "Forwards":
        return Forwards(self.emitted + other.emitted, self.plain_steps + other.plain_steps)

    @property
    def rounds(self) -> int:
        return len(self.emitted) - self.plain_steps

    @property
    def tau(self) -> Optional[float]:
        """Tokens per speculative round, bonus included (each plain step emitted exactly 1); None
        where every forward was a plain step."""
        return (sum(self.emitted) - self.plain_steps) / self.rounds if self.rounds else None

    def describe(self) -> str:
        """'tau 2.31 over 20 rounds', plus the plain steps if there were any."""
        text = f"tau {self.tau:.2f} over {self.rounds} rounds" if self.rounds else "no speculative round"
        if self.plain_steps:
            text += (f" and {self.plain_steps} plain steps ({self.plain_steps / len(self.emitted):.0%} of the "
                     f"forwards: --adaptive found rounds slower than plain steps there; "
                     f"{sum(self.emitted) / len(self.emitted):.2f} tokens per forward overall)")
        return text


def make_decoder(args, model: Transformer, stop_ids, max_seq_length: int, probes=None):
    """A function prompt_ids, max_new_tokens, callback -> (new ids, Forwards or None)
    for the decoding method the command line asks for, compiled if asked. Caches are allocated
    here, once, for prompt + new tokens up to max_seq_length, so that no later call changes a
    compiled shape. probes: the prompts (lists of ids) --tree_tokens auto measures on; when it picks no
    tree, args.speculate becomes "none"."""
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if not args.compile:
        pack_linears(model)  # eager half precision on a CPU: weights in oneDNN's layout (a no-op elsewhere)
        if model.invariant_window is not None and args.speculate != "none" and eager_invariant_rows(model, most=2) < 2:
            # no tree fits (a root and one guess are 2 rows): say so before --tree_tokens auto measures shapes
            raise ValueError("--batch_invariant without --compile: this CPU's eager GEMMs round a verify's rows apart "
                             "from one-token steps for every tree (model.eager_invariant_rows: 1 row): compile "
                             "(--compile), or speculate without --batch_invariant")
    if args.speculate == "none":
        model.setup_caches(1, max_seq_length)
        if args.compile:
            compile_decoding(args.device, args.compile_prefill, model)

        def decode(prompt_ids, max_new_tokens, callback=None):
            prompt = torch.tensor([prompt_ids], device=args.device)
            # the step functions are passed explicitly: compile_decoding rebinds the module's names,
            # and generate()'s defaults still hold the uncompiled ones
            return generate(model, prompt, max_new_tokens, stop_ids=stop_ids, callback=callback,
                            prefill_fn=prefill, decode_fn=decode_one_token, **sampling)[0], None
        return decode

    from tree import mc_sim_7b_63, static_tree

    lookup, adaptive = getattr(args, "lookup", 0) or 0, getattr(args, "adaptive", False)
    if args.speculate == "lookup":
        return speculative_decoder(args, Speculator(model, None, lookup=lookup, stop_ids=stop_ids, **sampling),
                                   max_seq_length, adaptive)
    draft_dtype = getattr(torch, args.draft_dtype) if getattr(args, "draft_dtype", None) else model.norm.weight.dtype
    draft = load_draft(args.draft_checkpoint_path, model.config, args.device, draft_dtype)
    check_head(args.speculate, draft, args.draft_checkpoint_path)
    if not args.compile:
        pack_linears(draft)
    if args.tree_tokens == "auto":
        shape = auto_shape(
            model, draft, probes, stop_ids=stop_ids, cuda_graphs=args.compile and args.device.startswith("cuda"),
            compiled_cpu=args.compile and args.device == "cpu", lookup=lookup,
            top_ks=AUTO_TOP_K if args.tree_top_k is None else (args.tree_top_k,),
            depths=range(1, 9) if args.tree_depth is None else (args.tree_depth,),
            cache_key=dict(machine_key(args.device), model=file_key(args.checkpoint_path),
                           draft=file_key(args.draft_checkpoint_path), dtype=str(model.norm.weight.dtype),
                           draft_dtype=str(draft_dtype),
                           compiled=args.compile, packed=not args.compile), **sampling)
        args.tree_top_k, args.tree_depth, args.tree_tokens = (None, None, None) if shape is None else (
            shape["tree_top_k"], shape["tree_depth"], shape["tree_tokens"])
        if shape is None:
            args.speculate = "none"
            return make_decoder(args, model, stop_ids, max_seq_length)
    static = None
    if args.speculate == "eagle":
        static = static_tree(json.loads(args.tree.read_text()) if args.tree else mc_sim_7b_63)
    spec = Speculator(model, draft, static=static, tree_top_k=args.tree_top_k, tree_depth=args.tree_depth,
                      tree_tokens=args.tree_tokens, stop_ids=stop_ids, lookup=lookup, **sampling)
    return speculative_decoder(args, spec, max_seq_length, adaptive)


def speculative_decoder(args, spec: Speculator, max_seq_length: int, adaptive: bool):
    """make_decoder's decode function for a Speculator: caches for max_seq_length tokens plus the
    last round's overshoot, compiled if asked."""
    if spec.target.invariant_window is not None and not args.compile:
        # asked of this CPU's GEMMs (model.py), up to the tree's size: all that this run needs to know
        rows = eager_invariant_rows(spec.target, most=spec.n_nodes)
        if spec.n_nodes > rows:
            raise ValueError(f"--batch_invariant without --compile holds for trees of up to {rows} "
                             f"node{'s' if rows != 1 else ''} on this "
                             f"CPU (tree tokens + lookup), this one has {spec.n_nodes}: compile, or pass a smaller "
                             f"--tree_tokens / --lookup")
    spec.setup(1, max_seq_length + 2 * (spec.depth + 1))
    if args.compile:
        set_tensor_parallel_flags()
        compile_round(spec, args.compile_prefill)

    def decode(prompt_ids, max_new_tokens, callback=None):
        prompt = torch.tensor([prompt_ids], device=args.device)
        ids, per_round = speculative_generate(spec, prompt, max_new_tokens, callback=callback, adaptive=adaptive)
        return ids[0], Forwards(per_round[0], spec.plain_steps[0])
    return decode


def main(argv=None):
    args = parse_args(argv)
    from tokenizer import load_tokenizer

    try:  # under torchrun: this rank's part of the target, and its device (tp.py)
        shard, device = tp.start(args.device, args.tp_timeout, vars(args))
    except ValueError as e:
        sys.exit(f"error: {e}")
    torch.manual_seed(args.seed)  # every rank draws the same random stream
    args.device, dtype = device, getattr(torch, args.dtype)
    t0 = time.perf_counter()
    try:
        args.attention = set_attention_backend(args.attention, device)
        model = load_model(args.checkpoint_path, device, dtype, shard)
        if args.batch_invariant:
            set_batch_invariant(model)
        tokenizer = load_tokenizer(args.checkpoint_path.parent)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    device_sync(device)
    print(f"Loaded {args.checkpoint_path} in {time.perf_counter() - t0:.2f} s ({device}, {args.dtype})"
          + (f", tensor parallel over {shard.world_size} ranks: {tp.weight_bytes(model) / 1e9:.3f} GB of weights each"
             if shard else ""), file=sys.stderr)

    if args.interactive:
        context = min(model.config.block_size, 4096)
        return interactive(make_decoder(args, model, tokenizer.stop_ids, context, probe_prompts(tokenizer)),
                           context, tokenizer, args)

    text = args.prompt_file.read_text() if args.prompt_file else (args.prompt or "Hello, my name is")
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    else:
        prompt_ids = tokenizer.encode(text)
    needed = len(prompt_ids) + args.max_new_tokens
    if needed > model.config.block_size:
        sys.exit(f"error: the prompt has {len(prompt_ids)} tokens; with --max_new_tokens {args.max_new_tokens} "
                 f"that is {needed}, more than the model's context of {model.config.block_size} tokens")
    try:
        if args.compare:
            return compare(args, model, tokenizer, prompt_ids, needed)
        decode = make_decoder(args, model, tokenizer.stop_ids, needed, probe_prompts(tokenizer, args.chat))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")

    bytes_per_token = model_bytes_per_token(model)
    samples, forwards = [], Forwards([])
    # With --compile the first run compiles; it is a warm-up and not reported.
    for i in range(-1 if args.compile else 0, args.num_samples):
        device_sync(device)
        t = time.perf_counter()
        ids, rounds = decode(prompt_ids, args.max_new_tokens)
        device_sync(device)
        seconds = time.perf_counter() - t
        if i < 0:
            print(f"Compilation and warm-up: {seconds:.2f} s", file=sys.stderr)
            continue
        tok_s = len(ids) / seconds
        samples.append({"token_ids": ids, "text": tokenizer.decode(_strip_stop(ids, tokenizer.stop_ids)),
                        "new_tokens": len(ids), "tokens_per_s": tok_s})
        print(samples[-1]["text"], flush=True)
        line = f"\nSample {i}: {len(ids)} tokens in {seconds:.2f} s, {tok_s:.2f} tok/s"
        if rounds is not None:
            forwards += rounds
            samples[-1].update(rounds=rounds.rounds, mean_accepted=rounds.tau, plain_steps=rounds.plain_steps)
            line += f", {rounds.describe()}"
        else:
            line += f", {bytes_per_token * tok_s / 1e9:.2f} GB/s"
        print(line, file=sys.stderr)

    try:
        tp.check_same_on_all_ranks("tokens", [s["token_ids"] for s in samples])
    except ValueError as e:
        sys.exit(f"error: {e}")
    mean_tok_s = sum(s["tokens_per_s"] for s in samples) / len(samples)
    report = {"checkpoint": str(args.checkpoint_path), "prompt_ids": prompt_ids, "samples": samples,
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
              "dtype": args.dtype, "compiled": args.compile, "speculate": args.speculate, "attention": args.attention,
              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "tokens_per_s": mean_tok_s, "tensor_parallel": shard.world_size if shard else 1,
              "weight_bytes_per_rank": tp.weight_bytes(model)}
    print(f"Average tokens/s: {mean_tok_s:.2f}", file=sys.stderr)
    if forwards.emitted:
        # tau: tokens per speculative round (each round is one verify forward), bonus token included;
        # --adaptive's plain steps are counted apart
        histogram = {n: forwards.emitted.count(n) for n in range(1, max(forwards.emitted) + 1)}
        histogram[1] -= forwards.plain_steps  # rounds that accepted no guess
        report.update(mean_accepted=forwards.tau, rounds=forwards.rounds, plain_steps=forwards.plain_steps,
                      accepted_histogram=histogram)
        print(f"Speculative rounds: {forwards.describe()}", file=sys.stderr)
    else:
        report["bandwidth_gb_s"] = bytes_per_token * mean_tok_s / 1e9
        print(f"Bandwidth achieved: {report['bandwidth_gb_s']:.2f} GB/s "
              f"(model weights read per token: {bytes_per_token / 1e9:.3f} GB"
              f"{', per rank' if shard else ''})", file=sys.stderr)
    print(f"Memory used: {peak_memory_gb(device):.2f} GB", file=sys.stderr)
    if args.output_json and (shard is None or shard.rank == 0):
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=1))
    tp.finish()


def compare(args, model: Transformer, tokenizer, prompt_ids, max_seq_length: int) -> dict:
    """--compare: the prompt answered plainly, then speculatively (streamed), with the same dtype,
    device and compile setting, each timed as one whole call after its warm-up (with --compile);
    prints both speeds, their ratio, tau and whether the answers are identical (at temperature 0
    they must be, in float32: speculation is lossless). Returns the report (--output_json)."""
    plain = make_decoder(argparse.Namespace(**{**vars(args), "speculate": "none"}), model, tokenizer.stop_ids,
                         max_seq_length)
    speculative = make_decoder(args, model, tokenizer.stop_ids, max_seq_length, probe_prompts(tokenizer, args.chat))
    method = args.speculate  # "none" when --tree_tokens auto found no tree worth it
    runs, compile_s, forwards = {}, {}, {}
    for name, decode in (("plain", plain), ("speculative", speculative)):
        if args.compile:  # compilation (or loading it from the cache) and warm-up, timed apart
            t = time.perf_counter()
            decode(prompt_ids, args.max_new_tokens)
            compile_s[name] = time.perf_counter() - t
            print(f"{name}: compiled and warmed up in {compile_s[name]:.1f} s", file=sys.stderr)
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
                          mean_accepted=1.0)  # plain decoding: one token per forward
        if rounds is not None:
            runs[name].update(mean_accepted=rounds.tau, rounds=rounds.rounds, plain_steps=rounds.plain_steps)
        forwards[name] = rounds
    print("\n", file=sys.stderr)
    setting = f"{args.dtype}, {'compiled' if args.compile else 'eager'}"
    if args.batch_invariant:
        setting += ", batch-invariant"
    p, s = runs["plain"], runs["speculative"]
    lookup = getattr(args, "lookup", 0) or 0
    shape = {"none": "", "eagle": ", static tree", "lookup": f", {lookup} lookup tokens"}.get(
        method, f", {args.tree_tokens}-token trees")
    if lookup and method not in ("none", "lookup"):
        shape += f" + {lookup} lookup tokens"
    print(f"plain decoding ({setting}):".ljust(44) + f"{p['new_tokens']:4d} tokens in {p['seconds']:6.2f} s = "
          f"{p['tokens_per_s']:7.2f} tok/s", file=sys.stderr)
    print(f"{method} ({setting}{shape}):".ljust(44) + f"{s['new_tokens']:4d} tokens in {s['seconds']:6.2f} s = "
          f"{s['tokens_per_s']:7.2f} tok/s, "
          + (forwards["speculative"].describe() if forwards["speculative"] is not None else "tau 1.00"), file=sys.stderr)
    speedup = s["tokens_per_s"] / p["tokens_per_s"]
    identical = p["token_ids"] == s["token_ids"]
    if args.temperature == 0:
        verdict = "the two answers are identical" if identical else "the answers differ"
        if args.dtype != "float32" and not args.batch_invariant:  # say it whether or not this answer met a near-tie
            verdict += (" (in bfloat16/float16 they can differ where two tokens nearly tie: the batched verify "
                        "and the one-token step round differently; float32 or --batch_invariant give identical "
                        "answers)")
        elif not identical:
            verdict += ": this is a bug, please report it"
    else:
        verdict = "sampled: the answers are drawn from the same distribution, not expected to be equal"
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


class TextStreamer:
    """Prints text as tokens arrive. Byte-level BPE can split one character over several tokens,
    so re-decode everything and print only the new, complete part."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def put(self, token: int):
        if token in self.tokenizer.stop_ids:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)


if __name__ == "__main__":
    main()
