"""defaults.py's table, as generate.py's command line applies it: the tree, lookup nodes, dtype and
batch-invariant mode a run gets where it says nothing."""
import pytest
import torch

import defaults
import generate as gen


@pytest.mark.parametrize("amx", [True, False])
def test_compiled_cpu_default_tree_follows_the_cpus_matrix_units(monkeypatch, tmp_path, amx):
    """Compiled on a CPU without --tree: top-k 8, depth 3, 12 tokens and 8 lookup nodes with AMX;
    4 tokens of top-k 4 and no lookup nodes without (where verifying 8-12 rows costs several
    steps). eagle's static tree takes 8 lookup nodes everywhere; eager runs measure (auto). What
    the user passes is kept."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    base = ["--device", "cpu", "--compile", "--speculate", "eagle3", "--draft_checkpoint_path", str(tmp_path)]
    args = gen.parse_args(base)
    expected = dict(tree_top_k=8, tree_depth=3, tree_tokens=12, lookup=8) if amx else \
        dict(tree_top_k=4, tree_depth=3, tree_tokens=4, lookup=0)
    assert {k: getattr(args, k) for k in expected} == expected
    mine = gen.parse_args(base + ["--tree", "2,3,5", "--lookup", "3"])
    assert (mine.tree_top_k, mine.tree_depth, mine.tree_tokens, mine.lookup) == (2, 3, 5, 3)
    eager = gen.parse_args(base[:2] + ["--no-compile"] + base[3:])
    assert (eager.tree_tokens, eager.lookup) == ("auto", 8)
    static = gen.parse_args(base[:4] + ["eagle"] + base[5:])
    assert (static.tree_tokens, static.tree_file, static.lookup) == (None, None, 8)
    assert gen.parse_args(["--device", "cpu", "--speculate", "lookup"]).lookup == defaults.LOOKUP_ALONE


def test_the_defaults_table_has_one_row_for_each_kind_of_run(monkeypatch):
    """Every (device, compiled, AMX) a run can be finds exactly one row, named after its results."""
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        for device in ("cpu", "cuda"):
            for compiled in (True, False):
                rows = [r for r in defaults.TABLE if r.device == device and r.compiled in (None, compiled)
                        and r.amx in (None, amx and device == "cpu")]
                assert len(rows) == 1 and rows[0] == defaults.row(device, compiled) and rows[0].why
    assert defaults.tree(defaults.row("cuda", False), "eagle3") == (10, defaults.EAGLE3_DEPTH, 60)
    assert {r.dtype for r in defaults.TABLE if r.device == "cpu" and r.compiled} == {"bfloat16"}  # every CPU alike


@pytest.mark.parametrize("amx", [True, False])
def test_batch_invariant_default_is_on_where_it_was_measured_cheap(monkeypatch, tmp_path, amx):
    """--batch_invariant defaults to on for compiled bf16, float32 and float16 runs of an unquantized
    file on a CPU without AMX, and of an int8 or int4 file where its layers compile to Inductor's
    template (quantize.INDUCTOR_INT8_ROWS_INVARIANT, INDUCTOR_INT4_ROWS_INVARIANT); off with AMX,
    eager, for quantized files on torch's kernel and outside bf16; --batch_invariant /
    --no-batch_invariant always win (benchmarks/RESULTS.md, "Batch-invariant cost")."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(defaults, "INDUCTOR_INT8_ROWS_INVARIANT", not amx)
    monkeypatch.setattr(defaults, "INDUCTOR_INT4_ROWS_INVARIANT", not amx)
    compiled = ["--device", "cpu", "--compile", "--speculate", "eagle3", "--draft_checkpoint_path", str(tmp_path)]
    assert gen.parse_args(compiled).batch_invariant is (not amx)
    assert gen.parse_args(compiled + ["--dtype", "bfloat16"]).batch_invariant is (not amx)
    assert gen.parse_args(compiled + ["--no-batch_invariant"]).batch_invariant is False
    assert gen.parse_args(compiled + ["--batch_invariant"]).batch_invariant is True
    assert gen.parse_args(compiled + ["--dtype", "float32"]).batch_invariant is (not amx)
    assert gen.parse_args(compiled + ["--dtype", "float16"]).batch_invariant is (not amx)
    assert gen.parse_args(["--device", "cpu", "--no-compile", "--dtype", "bfloat16"]).batch_invariant is False
    assert gen.parse_args(["--device", "cpu", "--no-compile"]).batch_invariant is False
    int8 = ["--checkpoint_path", str(tmp_path / "model_int8.pth")]
    assert gen.parse_args(compiled + int8).batch_invariant is (not amx)
    int4 = ["--checkpoint_path", str(tmp_path / "model_int4.g32.pth")]
    assert gen.parse_args(compiled + int4).batch_invariant is (not amx)
    assert gen.parse_args(compiled + int4 + ["--dtype", "float16"]).batch_invariant is False  # built for bf16
    monkeypatch.setattr(defaults, "INDUCTOR_INT8_ROWS_INVARIANT", False)  # say, a CPU without AVX2
    monkeypatch.setattr(defaults, "INDUCTOR_INT4_ROWS_INVARIANT", False)  # ... or without AVX-512
    assert gen.parse_args(compiled + int8).batch_invariant is False
    assert gen.parse_args(compiled + int4).batch_invariant is False


@pytest.mark.parametrize("amx", [True, False])
def test_auto_dtype_is_the_tables(monkeypatch, tmp_path, amx):
    """--dtype auto: bfloat16 compiled on every CPU (the same bits on two CPUs alike in what they
    report), float32 eager (bf16 in the eager batch-invariant mode, which holds in bf16 only);
    an explicit --dtype always wins."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    compiled = ["--device", "cpu", "--compile", "--speculate", "eagle3", "--draft_checkpoint_path", str(tmp_path)]
    assert gen.parse_args(compiled).dtype == "bfloat16"
    assert gen.parse_args(compiled + ["--batch_invariant"]).dtype == "bfloat16"
    assert gen.parse_args(compiled + ["--dtype", "float32"]).dtype == "float32"
    assert gen.parse_args(["--device", "cpu", "--no-compile"]).dtype == "float32"
    assert gen.parse_args(["--device", "cpu", "--no-compile", "--batch_invariant"]).dtype == "bfloat16"
