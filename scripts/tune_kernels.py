"""Sweep the launch constants of the project's Triton kernels on a GPU, and time the quantized paths
whose crossover is a constant of quantize.py. Nothing is changed: the tables say which values to
put in the code.

    python scripts/tune_kernels.py --out benchmarks/tune-H100 [--time_budget 60]

  tree_attention   the verify of a 7B (32 query and KV heads) and an 8B (32 query, 8 KV heads):
                   60 tree nodes, prefixes of 500 and 3000 in a 4156-slot cache; and a draft level
                   (10 nodes, region 50). Each constant is varied alone from the module's values;
                   the reference is SDPA over the dense mask.
  int8_matmul      10 and 60 rows times a 7B's wqkv [12288, 4096] and w2 [4096, 11008] weights;
                   against cuBLAS on the bf16 weight (what a bf16 model reads) and the int8 -> bf16
                   cast that quantize.py used for several rows before.
  int4             torch's int4 kernel against the dequantized weight with cuBLAS (compiled, as a
                   compiled run does), by rows: where quantize.CUDA_INT4_KERNEL_ROWS should sit.
  invariant_linear batch-invariant mode's linear (invariant_kernels.LINEAR_CONFIG, 16-bit): whole
                   launch settings, since one setting serves every row count (that is what makes
                   it invariant), each timed at 1 row (a step) and 60 (a verify) on SmolLM2's and
                   a 7B's layers against F.linear (cuBLAS), and checked: the last row of the
                   60-row result equals that row computed alone, bit for bit. On an H100 the mode
                   made SmolLM2's compiled step 67 % slower; this says how much the linear's
                   setting can win back.
  invariant_step   batch-invariant mode's whole one-token step: a random-weight SmolLM2-135M (bf16) at
                   position 600, eager, replayed as a CUDA graph, under each setting of
                   invariant_kernels' split-K (LINEAR_SPLIT_PROGRAMS, LINEAR_FOLD_SPLITS), fused
                   norms (FUSE_NORMS) and attention chunks (ATTENTION_CHUNK) against the plain step
                   (cuBLAS, SDPA) in the same process; then, if time is left, the compiled steps
                   (generate.compile_step, as vanilla's) of the plain target, the invariant one
                   with the module's constants and with split-K's sum folded in and the norms
                   fused, ~70 s of compiling each on an H200. Per-kernel sweeps time a launch alone; the step says
                   what the launches cost together (a 135M step is bound by launches, not bytes).
Times are triton.testing.do_bench medians (ms). Every configuration is checked against its
reference first. Each row also says what the kernel's launch_config made of the setting (it keeps
a launch within the device's shared memory, with fewer stages or smaller blocks where a setting
would not fit); a setting the device still cannot launch (OutOfResources) or that fails is
recorded as "does not fit" / "failed" and the sweep goes on. Writes OUT.json and OUT.md.
"""
import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import quantize  # noqa: E402

SWEEPS = {
    "tree_attention": {"BLOCK_N": [32, 64, 128], "MAX_BLOCK_ELEMENTS": [4096, 8192, 16384],
                       "ELEMENTS_PER_WARP": [512, 1024, 2048], "NUM_STAGES": [1, 2, 3],
                       "TARGET_PROGRAMS": [66, 132, 264], "MIN_SPLIT_SLOTS": [256, 512, 1024]},
    "int8_matmul": {"BLOCK_N": [16, 32, 64], "BLOCK_K": [64, 128, 256], "NUM_STAGES": [3, 4, 5], "NUM_WARPS": [4, 8]},
}
INT4_ROWS = [1, 16, 32, 60, 128, 512]
# (what, H, KV, D, tree nodes T, region R, prefix) in a cache of TREE_CACHE + R slots
TREE_CASES = [("7B verify", 32, 32, 128, 60, 60, 500), ("7B verify", 32, 32, 128, 60, 60, 3000),
              ("8B verify", 32, 8, 128, 60, 60, 500), ("8B verify", 32, 8, 128, 60, 60, 3000),
              ("7B draft level", 32, 32, 128, 10, 50, 1000)]
TREE_CACHE = 4096
INT8_ROWS = [10, 60]
INT8_SHAPES = [(12288, 4096, "wqkv"), (4096, 11008, "w2")]  # (N, K, name): a 7B's layers
# invariant_kernels.LINEAR_CONFIG's 16-bit entry: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages),
# timed after the module's own setting; smaller BLOCK_N / BLOCK_M give a one-row launch on narrow
# layers more programs (576 columns in BLOCK_N 64: 9 programs for 132 SMs), longer BLOCK_K fewer
# serial steps
INVARIANT_LINEAR_SETTINGS = [(16, 64, 64, 4, 3), (16, 32, 64, 4, 3), (16, 16, 64, 2, 3), (16, 32, 128, 4, 3),
                             (16, 16, 128, 4, 4), (16, 16, 256, 4, 3), (16, 32, 256, 4, 3), (16, 16, 256, 2, 2),
                             (16, 64, 128, 4, 3), (32, 32, 64, 4, 3), (64, 64, 64, 4, 3), (32, 64, 128, 4, 3)]
INVARIANT_ROWS = [1, 60]
# invariant_step: settings of invariant_kernels' constants, each against the plain step
INVARIANT_STEP_SETTINGS = [
    dict(LINEAR_SPLIT_PROGRAMS=0, ATTENTION_CHUNK=0), {},  # one pass (the old kernels), the module's defaults
    dict(LINEAR_FOLD_SPLITS=True),  # split-K's sum folded into its first launch: one launch a linear, not two
    dict(FUSE_NORMS=True), dict(LINEAR_FOLD_SPLITS=True, FUSE_NORMS=True),  # a block's norms inside its linears
    dict(LINEAR_SPLIT_PROGRAMS=0, ATTENTION_CHUNK=64), dict(LINEAR_SPLIT_PROGRAMS=0, ATTENTION_CHUNK=256),
    dict(LINEAR_SPLIT_PROGRAMS=66, ATTENTION_CHUNK=0), dict(LINEAR_SPLIT_PROGRAMS=264, ATTENTION_CHUNK=0),
    dict(LINEAR_SPLIT_PROGRAMS=132, ATTENTION_CHUNK=64), dict(LINEAR_SPLIT_PROGRAMS=264),
    dict(LINEAR_CONFIG_16=(16, 64, 64, 4, 3)), dict(LINEAR_CONFIG_16=(16, 32, 64, 4, 3)),  # LINEAR_CONFIG[2]
]
STEP_MODEL, STEP_POSITION, STEP_CACHE, STEP_REPS, STEP_DEVICE = "SmolLM2-135M", 600, 2048, 300, "cuda"
INVARIANT_SHAPES = [(576, 576, "SmolLM2 wq, wo"), (1536, 576, "SmolLM2 w1, w3"), (576, 1536, "SmolLM2 w2"),
                    (49152, 576, "SmolLM2 output"), (4096, 4096, "7B wo"), (11008, 4096, "7B w1")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "tune-kernels")
    p.add_argument("--time_budget", type=float, default=float("inf"), help="seconds; later measurements are left out")
    p.add_argument("--dry_run", action="store_true", help="print the sweep and exit (no GPU needed)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("the kernels are tuned on a CUDA device; none is available (--dry_run prints the sweep)")
    return args


def variations(module, sweep: dict):
    """The module's own values first, then each constant varied alone."""
    yield {}
    for name, values in sweep.items():
        yield from ({name: value} for value in values if value != getattr(module, name))


@contextmanager
def constants(module, setting: dict):
    """The module's launch constants set as in setting, and restored after."""
    saved = {k: getattr(module, k) for k in setting}
    for k, v in setting.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def tree_attention_rows(deadline):
    import tree_attention as ta

    rows, g = [], torch.Generator(device="cuda").manual_seed(0)
    for what, H, KV, D, T, R, prefix in TREE_CASES:
        S = TREE_CACHE + R
        q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        prefix_len = torch.tensor([prefix], device="cuda")
        visible = torch.rand(1, T, R, device="cuda", generator=g) < 0.3
        expected = ta.reference(q, k, v, prefix_len, visible).float()
        sdpa_ms = ms(lambda: ta.reference(q, k, v, prefix_len, visible))
        for setting in variations(ta, SWEEPS["tree_attention"]):
            if time.perf_counter() > deadline:
                return rows, True
            with constants(ta, setting):
                launch = ta.launch_config(q.dtype, (H // KV) * T, D, ta.shared_memory_limit(q.device))
                row = dict(case=f"{what}, H {H}, KV {KV}, prefix {prefix}", setting=setting or "defaults",
                           launch=launch_text(launch), sdpa_ms=sdpa_ms)
                try:
                    error = (ta.tree_attention(q, k, v, prefix_len, visible).float() - expected).abs().max().item()
                    rows.append(dict(row, ms=ms(lambda: ta.tree_attention(q, k, v, prefix_len, visible)),
                                     max_error=error))
                except Exception as e:  # noqa: BLE001 - one setting that cannot launch is a row, not the end
                    rows.append(dict(row, ms=does_not_fit(e)))
    return rows, False


def launch_text(launch: dict) -> str:
    """What launch_config chose for a setting: launch_config keeps within the device's shared memory,
    taking fewer stages or smaller blocks than a setting asks for where it would not fit."""
    return " ".join(f"{k}={v}" for k, v in launch.items())


def does_not_fit(e: Exception) -> str:
    """The row's entry for a setting the device cannot launch (Triton's OutOfResources: shared
    memory, registers) or that fails to compile: recorded, and the sweep goes on."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    kind = "does not fit" if type(e).__name__ == "OutOfResources" else "failed"
    return f"{kind}: {type(e).__name__}: {first}"[:200]


def int8_rows(deadline):
    import int8_matmul as im

    rows = []
    for M in INT8_ROWS:
        for N, K, name in INT8_SHAPES:
            w = torch.randn(N, K, device="cuda")
            q, scales = quantize.quantize_int8(w)
            scales = scales.bfloat16()
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w_bf16 = quantize.dequantize_int8(q, scales).bfloat16()
            expected = im.reference(x, q, scales)
            cublas_ms = ms(lambda: F.linear(x, w_bf16))
            cast_ms = ms(lambda: F.linear(x, q.to(x.dtype)) * scales)
            for setting in variations(im, SWEEPS["int8_matmul"]):
                if time.perf_counter() > deadline:
                    return rows, True
                with constants(im, setting):
                    row = dict(case=f"{M} rows x {name} [{N}, {K}]", setting=setting or "defaults",
                               launch=launch_text(im.launch_config(M, x.dtype, im.shared_memory_limit(x.device))),
                               bf16_cublas_ms=cublas_ms, cast_ms=cast_ms)
                    try:
                        y = im.int8_matmul(x, q, scales).float()
                        rows.append(dict(row, ms=ms(lambda: im.int8_matmul(x, q, scales)),
                                         relative_error=((y - expected).abs().max() / expected.abs().max()).item()))
                    except Exception as e:  # noqa: BLE001 - as in tree_attention_rows
                        rows.append(dict(row, ms=does_not_fit(e)))
    return rows, False


def int4_rows(deadline):
    rows = []
    for N, K, name in ((12288, 4096, "wqkv"), (4096, 11008, "w2")):
        layer = quantize.WeightOnlyInt4Linear.from_linear(torch.nn.Linear(K, N, bias=False), 32).to("cuda", torch.bfloat16)
        layer.pack()
        dequantized = torch.compile(lambda x: F.linear(x, quantize.dequantize_int4(
            quantize.unpack_nibbles(layer.nibbles), layer.scales_and_zeros, 32).to(x.dtype)), dynamic=True)
        for M in INT4_ROWS:
            if time.perf_counter() > deadline:
                return rows, True
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            kernel_ms = ms(lambda: layer._matmul(x, layer.weight, 32, layer.scales_and_zeros))
            cublas_ms = ms(lambda: dequantized(x))
            rows.append(dict(case=f"{M} rows x {name} [{N}, {K}]", rows=M, int4_kernel_ms=kernel_ms,
                             dequantize_cublas_ms=cublas_ms))
    return rows, False


def invariant_linear_rows(deadline):
    import invariant_kernels as ik

    rows, g = [], torch.Generator(device="cuda").manual_seed(0)
    default = ik.LINEAR_CONFIG[2]
    settings = [default] + [s for s in INVARIANT_LINEAR_SETTINGS if s != default]
    for N, K, name in INVARIANT_SHAPES:
        w = torch.randn(N, K, device="cuda", generator=g).div_(K ** 0.5).bfloat16()
        xs = torch.randn(max(INVARIANT_ROWS), K, device="cuda", generator=g).bfloat16()
        for M in INVARIANT_ROWS:
            x = xs[:M]
            expected = F.linear(x.float(), w.float())
            cublas_ms = ms(lambda: F.linear(x, w))
            for setting in settings:
                if time.perf_counter() > deadline:
                    return rows, True
                with constants(ik, {"LINEAR_CONFIG": {**ik.LINEAR_CONFIG, 2: setting}}):
                    row = dict(case=f"{M} rows x {name} [{N}, {K}]",
                               setting="defaults" if setting == default else launch_text(ik.linear_config(x.dtype)),
                               config=list(setting), cublas_ms=cublas_ms)  # config: LINEAR_CONFIG's tuple
                    try:
                        y = ik.invariant_linear(x, w)
                        rows.append(dict(row, ms=ms(lambda: ik.invariant_linear(x, w)),
                                         max_error=(y.float() - expected).abs().max().item(),
                                         last_row_alone_equal=bool(torch.equal(y[-1:], ik.invariant_linear(x[-1:], w)))))
                    except Exception as e:  # noqa: BLE001 - as in tree_attention_rows
                        rows.append(dict(row, ms=does_not_fit(e)))
    return rows, False


def step_models():
    """The plain and the batch-invariant random-weight targets (same weights), their caches filled to
    STEP_POSITION, and the one-token step's inputs."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark
    import generate as gen
    from model import ModelArgs

    config = ModelArgs.from_name(STEP_MODEL)
    models = {}
    for invariant in (False, True):
        torch.manual_seed(0)
        model = benchmark.random_model(config, STEP_DEVICE, torch.bfloat16)
        model.setup_caches(1, STEP_CACHE)
        if invariant:
            gen.set_batch_invariant(model)
        models[invariant] = model
    prompt = torch.randint(0, config.vocab_size, (1, STEP_POSITION), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(STEP_DEVICE)
    with torch.no_grad():
        for model in models.values():
            model(prompt, torch.arange(STEP_POSITION, device=STEP_DEVICE))
    return models, prompt[:, -1].clone(), torch.tensor([STEP_POSITION], device=STEP_DEVICE)


def step_ms(fn) -> float:
    """ms a call of fn: the best of three runs of STEP_REPS back-to-back calls (benchmark's
    seconds_per_call), the first after 30 calls to warm up."""
    import benchmark

    return 1e3 * min(benchmark.seconds_per_call(fn, STEP_REPS, STEP_DEVICE, warmup=30 if i == 0 else 0)
                     for i in range(3))


def invariant_step_rows(deadline):
    import generate as gen
    import invariant_kernels as ik
    import speculative

    models, token, pos = step_models()
    with torch.no_grad():
        def replayed(model):
            return speculative.cuda_graph(lambda: model(token[:, None], pos))

        plain = step_ms(replayed(models[False]))
        rows = [dict(case=f"eager step, CUDA graph, position {STEP_POSITION}", setting="plain (cuBLAS, SDPA)",
                     ms=plain, against_plain=1.0)]
        for setting in INVARIANT_STEP_SETTINGS:
            if time.perf_counter() > deadline:
                return rows, True
            setting = dict(setting)
            if "LINEAR_CONFIG_16" in setting:
                setting["LINEAR_CONFIG"] = {**ik.LINEAR_CONFIG, 2: setting.pop("LINEAR_CONFIG_16")}
            with constants(ik, setting):
                name = ", ".join(f"{k}={v[2] if k == 'LINEAR_CONFIG' else v}" for k, v in setting.items()) or "defaults"
                try:
                    t = step_ms(replayed(models[True]))
                    rows.append(dict(rows[0], setting=f"invariant: {name}", ms=t, against_plain=t / plain))
                except Exception as e:  # noqa: BLE001 - as in tree_attention_rows
                    rows.append(dict(rows[0], setting=f"invariant: {name}", ms=does_not_fit(e)))
        # compiled as vanilla's step is: Inductor's fusions beside the kernels, which are opaque ops
        compiled = {}
        fewer_launches = dict(LINEAR_FOLD_SPLITS=True, FUSE_NORMS=True)
        for name, invariant, setting in (("plain", False, {}), ("invariant: defaults", True, {}),
                                         ("invariant: LINEAR_FOLD_SPLITS=True, FUSE_NORMS=True", True, fewer_launches)):
            if time.perf_counter() > deadline:
                return rows, True
            model = models[invariant]
            with constants(ik, setting):
                step = gen.compile_step(gen.decode_one_token, STEP_DEVICE, model)
                compiled[name] = step_ms(lambda: step(model, token, pos, 0.0, None, None))
            torch._dynamo.reset()
            rows.append(dict(case=f"compiled step (generate.compile_step), position {STEP_POSITION}",
                             setting=name, ms=compiled[name], against_plain=compiled[name] / compiled["plain"]))
    return rows, False


def markdown(report: dict) -> str:
    lines = [f"# Kernel sweeps, {report['hardware']}", "", f"- date: {report['date']}, torch {report['torch']}, "
             f"triton {report['triton']}", f"- command: `{report['command']}`", ""]
    for section, rows in report["sections"].items():
        if not rows:
            continue
        keys = [k for k in rows[0] if k != "case"]
        keys += [k for r in rows for k in r if k not in keys and k != "case"]  # a row that did not fit has fewer
        lines += [f"## {section}", "", "| case | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for r in rows:
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
            lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
        lines.append("")
    if report["left_out"]:
        lines.append("Left out by --time_budget: " + ", ".join(report["left_out"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        print(f"dry run: invariant_step settings {INVARIANT_STEP_SETTINGS}; "
              f"invariant_linear settings {INVARIANT_LINEAR_SETTINGS} at rows {INVARIANT_ROWS}; "
              f"{', '.join(f'{k} {v}' for k, v in SWEEPS.items())}; int4 at rows {INT4_ROWS}; out {args.out}",
              file=sys.stderr)
        return None
    import triton

    deadline = time.perf_counter() + args.time_budget
    report = dict(hardware=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  command="python scripts/tune_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  sections={}, left_out=[])
    for section, measure in (("invariant_step", invariant_step_rows), ("invariant_linear", invariant_linear_rows),
                             ("tree_attention", tree_attention_rows),
                             ("int8_matmul", int8_rows), ("int4", int4_rows)):
        report["sections"][section], stopped = measure(deadline)
        if stopped:
            report["left_out"].append(section)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(str(args.out) + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(str(args.out) + ".md").write_text(markdown(report))
    print(f"wrote {args.out}.json, .md", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
