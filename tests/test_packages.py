"""packages.py: the compiled CPU graphs as AOTInductor packages, keyed by everything they depend on.
One test builds real packages (tiny model, no autotuning); the others check the key and the file
handling around a build."""
import os
import shutil
import zipfile

import pytest
import torch
import torch.nn as nn

import generate as gen
import packages
from checkpoint import load_draft, load_model
from cpu import onednn_gemms
from quantize import WeightOnlyInt8Linear
from speculative import Speculator, speculative_generate
from trees import mc_sim_7b_63, static_tree

PROMPTS = ([1, 5, 9, 14, 3], [1, 7, 7, 2, 9, 30, 31, 40, 41, 5, 6, 8, 100, 101, 3])


def speculator(checkpoint, tree_tokens=6, dtype=torch.float32):
    model = load_model(checkpoint, "cpu", dtype)
    draft = load_draft(checkpoint.parent / "eagle", model.config, "cpu", dtype)
    return model, Speculator(model, draft, tree_top_k=3, tree_depth=3, tree_tokens=tree_tokens, stop_ids=[2])


@torch.no_grad()
def test_packaged_step_and_round_decode_as_eager_and_a_later_run_loads_them(tiny_checkpoint, tmp_path, monkeypatch):
    """A package's tokens equal eager plain decoding's (float32: speculation is lossless), prompts
    of two lengths share each package (the caches have one size), and new Packaged objects over
    the same folder, as in a later process, load the packages instead of building them."""
    checkpoint, _ = tiny_checkpoint
    folder = tmp_path / "compiled"
    model, spec = speculator(checkpoint)
    plain = []
    for ids in PROMPTS:
        model.setup_caches(1, 64)
        plain.append(gen.generate(model, torch.tensor([ids]), 20)[0])

    def decode_all(model, spec):
        step = packages.Packaged(packages.greedy_step, model, "step", folder)
        packages.package_round(spec, folder)
        spec.setup(1, 64)  # the target's caches too, for both prompts
        out = []
        for ids in PROMPTS:
            out.append(gen.generate(model, torch.tensor([ids]), 20, decode_fn=lambda m, t, p, *s: step(t, p))[0])
            out.append(speculative_generate(spec, torch.tensor([ids]), 20)[0][0])
        return out

    assert decode_all(model, spec) == [p for p in plain for _ in range(2)]
    built = sorted(p.name.split("-")[0] for p in folder.glob("*.so"))
    assert built == ["round", "step"]  # one each for both prompts; adaptive's plain step and flush never ran

    def no_build(self, *args):
        raise AssertionError(f"{self.name} was built again")
    monkeypatch.setattr(packages.Packaged, "build", no_build)
    model, spec = speculator(checkpoint)  # a later run: the same checkpoint loaded again
    assert decode_all(model, spec) == [p for p in plain for _ in range(2)]


@torch.no_grad()
def test_a_packaged_round_over_a_static_tree_decodes_as_plain_decoding(tiny_checkpoint, tmp_path):
    """EAGLE-1's static tree in a package: its tensors are constants the package keeps (tensors a
    graph captured from a plain attribute made Inductor's freezing fail to build it)."""
    checkpoint, _ = tiny_checkpoint
    model = load_model(checkpoint, "cpu", torch.float32)
    draft = load_draft(checkpoint.parent / "eagle", model.config, "cpu", torch.float32)
    spec = Speculator(model, draft, static=static_tree(mc_sim_7b_63), stop_ids=[2])
    ids = torch.tensor([PROMPTS[1]])
    model.setup_caches(1, 64)
    plain = gen.generate(model, ids, 20)[0]
    packages.package_round(spec, tmp_path)
    spec.setup(1, 64)
    assert speculative_generate(spec, ids, 20)[0][0] == plain
    assert [p.name.split("-")[0] for p in tmp_path.glob("*.so")] == ["round"]


def test_constants_are_a_static_trees_buffers_and_the_named_ones_not_any_buffer_of_such_a_name():
    """A package keeps as constants the buffers a graph only reads: every buffer of a StaticTree and
    the named ones (RoPE tables, stop ids, ...). A buffer of another module that happens to share a
    tree buffer's name is state, passed in at every call and left out of the key."""
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tree = static_tree([[0], [1], [0, 0]])
            self.register_buffer("depth", torch.zeros(3))  # state: a static tree's buffer name, another module
            self.register_buffer("rope_cos", torch.ones(2))

    holder = Holder()
    bound = packages.Bound(lambda module, x: x, holder)
    bound.state()
    assert bound.names == ["inner.depth"]
    key = packages.configuration_digest(holder)
    holder.depth.fill_(1)
    assert packages.configuration_digest(holder) == key
    holder.tree.ranks.fill_(0)
    assert packages.configuration_digest(holder) != key


@torch.no_grad()
def test_what_adaptive_decoding_carries_over_answers_never_keys_a_package(tiny_checkpoint):
    """The driver leaves its estimates and counts on the Speculator for the next answer (HOST_ATTRIBUTES);
    no graph reads them, so a package built before an answer is the one looked up after it."""
    _, spec = speculator(tiny_checkpoint[0])
    spec.setup(1, 64)
    key = packages.configuration_digest(spec)
    speculative_generate(spec, torch.tensor([PROMPTS[1]]), 20, adaptive=True)
    assert {"pace", "plain_steps", "plain_run"} <= set(vars(spec))
    assert packages.configuration_digest(spec) == key


def test_the_key_changes_with_the_weights_tree_dtype_torch_and_settings(tiny_checkpoint, tmp_path, monkeypatch):
    """A package must never be loaded for a graph it does not hold: every input of the graph is
    in its key, and the same setup loaded twice gets the same key (or every run would rebuild)."""
    checkpoint, _ = tiny_checkpoint

    def key(tree_tokens=6, dtype=torch.float32, change=None):
        model, spec = speculator(checkpoint, tree_tokens, dtype)
        spec.setup(1, 64)
        if change:
            change(spec)
        p = packages.Packaged(type(spec).round, spec, "round", tmp_path)
        return p.key_parts((), p.bound.state())

    base = key()
    assert key() == base

    def differ(**kwargs):
        return sorted(k for k, v in key(**kwargs).items() if v != base[k])
    assert differ(tree_tokens=5) == ["configuration", "inputs"]
    onednn = ["settings"] if onednn_gemms(torch.bfloat16) else []  # bf16 GEMMs through ATen's backend there
    assert differ(dtype=torch.bfloat16) == sorted(["inputs", "weights", *onednn])
    with torch.no_grad():
        assert differ(change=lambda s: s.draft.fc.weight[0, 0].add_(1)) == ["weights"]
    assert differ(change=lambda s: s.stop_ids.fill_(7)) == ["configuration"]  # a constant the package keeps
    monkeypatch.setenv("TORCHINDUCTOR_CPP_GEMM_CACHE_BLOCKING", "4,1,48")
    assert differ() == ["environment"]
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    monkeypatch.setitem(packages.compiling.CPU_INDUCTOR, "max_autotune",
                        not packages.compiling.CPU_INDUCTOR["max_autotune"])
    assert differ() == ["environment", "settings", "torch"]


def test_a_damaged_package_is_built_again_and_a_new_key_says_why(tmp_path, capsys, monkeypatch):
    """A file that does not load is replaced by a new build, with one line saying so; a key with
    no package says what differs from the package built last."""
    built = []

    def fake_build(self, path, args, state):
        built.append(path.name)
        path.write_bytes(b"built")
    monkeypatch.setattr(packages.Packaged, "build", fake_build)
    monkeypatch.setattr(packages, "load", lambda path: (_ for _ in ()).throw(RuntimeError("bad library\ndetails"))
                        if open(path, "rb").read() != b"built" else "loaded")
    parts = {"torch": "2", "weights": "a", "inputs": "x"}
    monkeypatch.setattr(packages.Packaged, "key_parts", lambda self, args, state: dict(parts))
    p = packages.Packaged(packages.greedy_step, torch.nn.Linear(2, 2), "step", tmp_path)

    assert p.load_or_build((), []) == "loaded" and len(built) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "building" in err and "(the first one)" in err
    (tmp_path / built[0]).write_bytes(b"truncated")
    assert p.load_or_build((), []) == "loaded" and built[1] == built[0]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not be loaded (RuntimeError: bad library); building it again" in err
    parts["weights"] = "b"
    assert p.load_or_build((), []) == "loaded" and len(built) == 3 and built[2] != built[0]
    assert "the last one was built for another weights" in capsys.readouterr().err
    assert not [f for f in os.listdir(tmp_path) if "partial" in f]


def double(module, x):
    return module(x) * 2


@pytest.mark.parametrize("failure", ["compile", "interrupt"])
def test_a_failed_or_interrupted_build_leaves_no_partial_files(tmp_path, monkeypatch, failure):
    """A build that raises (the compiler fails) or is interrupted (while the library is copied out
    of the package) removes its partial .pt2 and .so files, leaves no package or record, and the
    error reaches the caller."""
    def fake_compile(exported, package_path, inductor_configs):
        with zipfile.ZipFile(package_path, "w") as archive:
            archive.writestr("data/model.so", b"library")
        if failure == "compile":
            raise RuntimeError("the compiler failed")

    def interrupted_copy(src, dst, length):
        dst.write(b"half a library")
        raise KeyboardInterrupt
    monkeypatch.setattr("torch._inductor.aoti_compile_and_package", fake_compile)
    monkeypatch.setattr(shutil, "copyfileobj", interrupted_copy)
    folder = tmp_path / "compiled"
    step = packages.Packaged(double, torch.nn.Linear(2, 2), "step", folder)
    with pytest.raises(RuntimeError, match="the compiler failed") if failure == "compile" else \
            pytest.raises(KeyboardInterrupt):
        step(torch.ones(1, 2))
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_packages_are_used_for_greedy_unquantized_cpu_runs_only(tiny_checkpoint):
    checkpoint, _ = tiny_checkpoint
    model, spec = speculator(checkpoint)
    assert packages.usable("cpu", 0.0, model) and packages.usable("cpu", 0.0, spec)
    assert not packages.usable("cpu", 0.7, model) and not packages.usable("cuda", 0.0, model)
    assert "emulate_precision_casts" not in packages.settings(spec)
    model.invariant_window = 32  # what invariant.enable sets: a Speculator's graphs get the mode's settings
    assert packages.usable("cpu", 0.0, spec) and packages.settings(spec)["emulate_precision_casts"]
    model.layers[0].attention.wo = WeightOnlyInt8Linear(model.config.dim, model.config.dim)
    assert not packages.usable("cpu", 0.0, spec)
