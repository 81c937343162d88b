"""scripts/kernel_fit.py on the representative set: every launch configuration the host code
chooses (speculative rounds and verifies of LLaMA-2-7B, LLaMA-3-8B and SmolLM2-135M at TP 1-2, in
bfloat16 and float32, int8 layers at 2-128 rows, scripts/tune_kernels.py's sweeps), compiled ahead
of time for sm_80, sm_86 and sm_90 with Triton's CUDA backend and the ptxas it ships: no compile
error, shared memory within each GPU's per-block limit, and within the bound the host code chose
by. The full sweep is the script's (benchmarks/kernel_fit.md, .json.gz). Skips where Triton cannot compile
for NVIDIA GPUs; no GPU needed.

The compiles run in a fresh process: Triton's interpreter (tests/test_tree_attention.py and
tests/test_int8_matmul.py run kernels in it) patches triton.language's builtins for good when a
kernel calls a @triton.jit helper, and a real compile in the same process then fails.
"""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import kernel_fit  # noqa: E402

pytestmark = pytest.mark.skipif(bool(kernel_fit.unavailable()),
                                reason=f"no ahead-of-time CUDA compilation here: {kernel_fit.unavailable()}")


def fresh_python(code: str):
    """Run `code` in a new interpreter (the scripts folder importable); what it prints, as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT / "scripts", capture_output=True,
                          text=True, env={**__import__("os").environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def report():
    # two ptxas processes at once (one a core): the compiles are nearly all of the time, and the
    # report is the same as from one (checked: 171 classes, 66 s against 126 s on 2 cores).
    # The script's own cache (kernel_fit.DEFAULT_CACHE_DIR): results are keyed by the kernel
    # module's source, the compile code, Triton's version, the target and the class, the launches by the
    # host code's sources, so a run after an edit compiles what the edit changed and nothing
    # else (75 s a run on a 2-core Zen 3 without it), as Inductor's cache does for the compiled tests
    return fresh_python("""
        import json, kernel_fit
        report = kernel_fit.check(kernel_fit.QUICK_TARGETS, quick=True, log=lambda line: None,
                                  cache_dir=kernel_fit.DEFAULT_CACHE_DIR, jobs=2)
        print(json.dumps(report))
    """)


@pytest.mark.parametrize("target", kernel_fit.QUICK_TARGETS)
def test_every_launch_compiles_and_fits(report, target):
    rows = [r for r in report["classes"] if r["target"] == target]
    totals = report["targets"][target]
    assert sum(r["launches"] for r in rows) == totals["launches"] > 500  # every launch is in a class
    assert [f"{r['launch']}: {r['error']}" for r in rows if "error" in r] == []
    assert [(r["launch"], r["shared"]) for r in rows if r["shared"] > totals["limit"]] == []


def test_the_bound_the_host_code_chose_by_holds(report):
    """tree_attention.shared_bytes and int8_matmul.shared_bytes are upper bounds of what the
    compiler allocates: on a GPU with another limit the host code's choice fits as well."""
    checked = [r for r in report["classes"] if "error" not in r and r["bound"] is not None]
    assert len(checked) > 10
    assert [(r["target"], r["launch"], r["shared"], r["bound"]) for r in checked if r["shared"] > r["bound"]] == []


def test_the_set_holds_the_launches_that_did_not_fit(report):
    """The representative set has what the issue found over sm_86's limit, in their new form:
    int8 of 65-128 rows in bfloat16 and float32, the float32 tree kernel at head_dim 64 and 128,
    the 16-bit tree kernel at head_dim 128, tune_kernels' three stages."""
    launches = {r["launch"] for r in report["classes"] if r["target"] == "sm_86"}

    def has(*words):
        return any(all(w in launch for w in words) for launch in launches)

    assert has("int8_matmul bfloat16", "BLOCK_M 128") and has("int8_matmul float32", "BLOCK_M 64")
    assert has("tree_attention float32", "D 128") and has("tree_attention float32", "D 64")
    assert has("tree_attention bfloat16", "D 128", "BLOCK_M 64") and has("tree_attention bfloat16", "D 64", "BLOCK_M 128")
    assert has("merge bfloat16", "N_SPLITS 8")


def test_the_check_catches_a_launch_over_the_limit():
    """The module's int8 constants as launched before (128 x 128 x 4 stages for 65-128 rows of
    bfloat16) compile to 110,592 bytes of shared memory: over sm_86's 101,376, within sm_80's."""
    got = fresh_python("""
        import json, torch, kernel_fit
        compiler = kernel_fit.Compiler()
        old = dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
        meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
        args = (meta(100, 4096), meta(4096, 4096, dtype=torch.int8), meta(4096), meta(100, 4096),
                100, 4096, 4096, 4096, 4096, 4096)
        launch = kernel_fit.Launch("int8_matmul", "_int8_matmul_kernel", args, old)
        print(json.dumps(dict(sm86=compiler.compile(launch, (8, 6))["shared"],
                              sm80=compiler.compile(launch, (8, 0))["shared"],
                              bound=kernel_fit.int8_matmul.shared_bytes(128, 32, 128, 4, 2))))
    """)
    limits = kernel_fit.tree_attention.SHARED_MEMORY_PER_BLOCK
    assert limits[8, 6] < got["sm86"] <= got["bound"]
    assert got["sm80"] <= limits[8, 0]


def test_compile_results_are_cached(tmp_path):
    """A compiled class's result is kept under cache_dir and read back, not compiled again; another
    target, fp64-typed float arguments or an edited kernel source is another entry; a compile
    error is not kept."""
    got = fresh_python(f"""
        import json, torch, kernel_fit
        compiler = kernel_fit.Compiler()
        meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")
        args = (meta(16, 256), meta(64, 256, dtype=torch.int8), meta(64), meta(16, 256), 16, 64, 256, 256, 256, 64)
        launch = kernel_fit.Launch("int8_matmul", "_int8_matmul_kernel", args,
                                   dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2))
        first = kernel_fit.cached_compile(compiler, launch, (8, 6), {str(tmp_path)!r})
        compiler.compile = None  # a second compile would fail
        second = kernel_fit.cached_compile(compiler, launch, (8, 6), {str(tmp_path)!r})
        try:
            kernel_fit.cached_compile(compiler, launch, (9, 0), {str(tmp_path)!r})
            other_target = "read from the cache"
        except TypeError:
            other_target = "compiled"
        try:
            kernel_fit.cached_compile(compiler, launch, (8, 6), {str(tmp_path)!r}, float_args="fp64")
            fp64 = "read from the cache"
        except TypeError:
            fp64 = "compiled"
        compiler.sources["int8_matmul"] += b"# an edit"
        try:
            kernel_fit.cached_compile(compiler, launch, (8, 6), {str(tmp_path)!r})
            edited = "read from the cache"
        except TypeError:
            edited = "compiled"
        compiler = kernel_fit.Compiler()  # BLOCK_K 48: tl.arange needs a power of two
        bad = kernel_fit.Launch("int8_matmul", "_int8_matmul_kernel", args,
                                dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=48, num_warps=4, num_stages=2))
        failed = kernel_fit.cached_compile(compiler, bad, (8, 6), {str(tmp_path)!r})
        print(json.dumps(dict(first=first, second=second, other_target=other_target, fp64=fp64, edited=edited,
                              failed=failed)))
    """)
    assert got["first"] == got["second"] and got["first"]["shared"] > 0 and "error" not in got["first"]
    assert got["other_target"] == got["fp64"] == got["edited"] == "compiled"
    assert "error" in got["failed"]
    assert len(list((tmp_path / "compiled").glob("*.json"))) == 1  # neither the other target nor the error


def test_a_stopped_sweep_resumes_from_its_gather_cache(tmp_path):
    """The launches gathered per model group are saved under cache_dir, per shared-memory limit; a
    second gather reads them back and counts the same launches as one without a cache (the
    representative set). Gathered for two limits in one pass, each limit's launches equal a gather
    for that limit alone, and they differ where the host code must choose smaller blocks."""
    sm86, sm90 = kernel_fit.tree_attention.SHARED_MEMORY_PER_BLOCK[8, 6], \
        kernel_fit.tree_attention.SHARED_MEMORY_PER_BLOCK[9, 0]
    uncached = kernel_fit.gather([(8, 6)], quick=True)
    first = kernel_fit.gather([(8, 6)], quick=True, cache_dir=tmp_path)
    files = sorted(tmp_path.rglob("*.json"))
    assert len(files) >= 6 and not list(tmp_path.rglob("*.tmp"))  # tree and int8 groups of 3 models
    second = kernel_fit.gather([(8, 6)], quick=True, cache_dir=tmp_path)
    assert first == second == uncached and list(uncached) == [sm86] and sum(uncached[sm86].values()) > 500
    both = kernel_fit.gather([(8, 6), (9, 0)], quick=True)
    assert both[sm86] == uncached[sm86] and both[sm90] == kernel_fit.gather([(9, 0)], quick=True)[sm90]
    assert both[sm86] != both[sm90]
    uncached = uncached[sm86]
    # a launch survives JSON: the compiler sees the same tensor dtypes and integers
    record = next(r for r in uncached if r[1] == "_tree_attention_kernel")
    assert kernel_fit.frozen(kernel_fit.thawed(json.loads(json.dumps(record)))) == record


def test_kernels_compile_with_float_arguments_typed_as_torch_compile_types_them():
    """Inside a torch.compile'd graph Inductor passes a user Triton kernel's Python float arguments
    as fp64 on CUDA. On an H200 the tree-attention kernel then failed to compile in a compiled
    round (its scale, fp64, made the float32 accumulator fp64 inside the loop). Every kernel with a
    float argument (tree attention's and window attention's scale, the norm's eps) compiles for
    sm_90 with it typed fp64, in each dtype, within the fp32-typed launch's shared memory and
    without spills (the kernels cast it to float32 first, so eager and compiled launches compute
    the same: the GPU test of the compiled round checks that)."""
    rows = fresh_python("""
        import json, torch, kernel_fit, tree_attention, invariant_kernels as ik
        compiler = kernel_fit.Compiler()
        compiler.add_module("invariant_kernels")
        meta = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device="meta")
        launches = []
        with kernel_fit.recording((232448,)) as recorded:
            for dtype in (torch.bfloat16, torch.float32):
                for D, T, S in ((64, 16, 300), (128, 60, 4096)):
                    tree_attention.tree_attention(meta(1, 8, T, D, dtype=dtype), meta(1, 4, S, D, dtype=dtype),
                                                  meta(1, 4, S, D, dtype=dtype), meta(1, dtype=torch.long),
                                                  meta(1, T, T, dtype=torch.bool))
        launches += [l for l in recorded[232448] if l.kernel == "_tree_attention_kernel"]
        # batch-invariant mode's launches that take a float (the norm's eps, attention's scale)
        launches += [l for l in kernel_fit.invariant_launches(ik)
                     if l.kernel in ("_rms_norm_kernel", "_window_attention_kernel", "_window_chunk_kernel")]
        cache = kernel_fit.DEFAULT_CACHE_DIR
        rows = [dict(launch=kernel_fit.describe(l), fp32=kernel_fit.cached_compile(compiler, l, (9, 0), cache),
                     fp64=kernel_fit.cached_compile(compiler, l, (9, 0), cache, float_args="fp64")) for l in launches]
        print(json.dumps(rows))
    """)
    assert len(rows) == 4 + 3 + 6 + 2
    assert [(r["launch"], r["fp64"]["error"]) for r in rows if "error" in r["fp64"]] == []
    for r in rows:
        assert "error" not in r["fp32"], r
        assert r["fp64"]["shared"] == r["fp32"]["shared"] and r["fp64"]["spill_stores"] == 0, r
