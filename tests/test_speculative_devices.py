"""speculative.py on a device other than the CPU, checked without a GPU: every tensor the engine
holds lives on the model's device, a round neither mixes devices nor copies across them nor reads
a value back to the host, and it compiles into one graph.

Two stand-ins for a GPU. Setup runs on fake CUDA tensors (FakeTensorMode: a CUDA device, shapes,
no data). Prefill and rounds run on the meta device (shapes, no data) instead, because a CPU-only
torch cannot index a fake CUDA tensor (x[i] asks for a CUDA device guard: "PyTorch is not linked
with support for cuda devices"). Either way a tensor left on the CPU is caught where a GPU would
fail (torch.isin of a CUDA and a CPU tensor) or crawl (a copy from the host inside every round).
"""
import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import speculative
from compiling import compile_round
from conftest import tiny_target
from draft import Eagle3Draft, EagleDraft, draft_config_for, eagle3_layer_ids
from model import ModelArgs, Transformer
from trees import mc_sim_7b_63, static_tree

# The three ways to speculate: EAGLE-1's static tree, EAGLE-2's dynamic tree, EAGLE-3's draft
# (with the dynamic tree, as published; the static tree with it is a fourth combination).
CASES = {"eagle": ("eagle", "static"), "eagle2": ("eagle", "dynamic"), "eagle3": ("eagle3", "dynamic"),
         "eagle3-static": ("eagle3", "static")}


def build(case: str, target: Transformer, **sampling) -> speculative.Speculator:
    arch, tree = CASES[case]
    config = draft_config_for(target.config)
    with torch.device(target.norm.weight.device):
        draft = EagleDraft(config) if arch == "eagle" else Eagle3Draft(config, 256, eagle3_layer_ids(config.n_layer))
    # Speculator itself is made as a program makes it, outside any device context: whatever it
    # creates on the host must reach the device in setup().
    if tree == "static":
        return speculative.Speculator(target, draft, static=static_tree(mc_sim_7b_63), stop_ids=[1, 2], **sampling)
    return speculative.Speculator(target, draft, tree_top_k=4, tree_depth=3, tree_tokens=12, stop_ids=[1, 2],
                                  **sampling)


def meta_target() -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelArgs.from_name("tiny-llama"))


def held_tensors(spec: speculative.Speculator):
    """(name, tensor) for every tensor the Speculator holds: parameters and buffers of it, its
    target and its draft (a StaticTree's too), and tensors kept as plain attributes or inside tuples."""
    yield from spec.named_parameters()
    yield from spec.named_buffers()
    for module_name, module in spec.named_modules():
        for attr, value in vars(module).items():
            values = value if isinstance(value, tuple) else (value,)
            for i, v in enumerate(values):
                if isinstance(v, Tensor):
                    yield f"{module_name}.{attr}[{i}]", v


def assert_all_on(spec, device: str):
    away = {name: str(t.device) for name, t in held_tensors(spec) if t.device.type != device}
    assert not away, f"tensors not on {device}: {away}"


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_setup_puts_every_tensor_on_the_models_device_fake_cuda(case):
    spec = build(case, meta_target())
    with FakeTensorMode(allow_non_fake_inputs=True):  # the host tensors in spec may enter fake ops
        spec.target.to_empty(device="cuda")
        spec.draft.to_empty(device="cuda")
        spec.setup(1, 64)
    assert spec.target.norm.weight.device.type == "cuda"
    assert_all_on(spec, "cuda")


class DeviceDiscipline(TorchDispatchMode):
    """Fails any op that mixes tensors of two devices or copies between them (a CPU scalar, which
    torch allows anywhere, excepted), or reads a tensor's value on the host (.item(), int(t), ...)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, Tensor)]
        devices = {str(t.device) for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            raise AssertionError(f"{func} mixes devices {sorted(devices)}")
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError(f"{func}: a value read on the host (a host sync on a GPU)")
        return out


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_prefill_and_rounds_stay_on_the_device(case, temperature):
    spec = build(case, meta_target(), temperature=temperature, top_p=0.9 if temperature else None)
    spec.setup(1, 64)
    assert_all_on(spec, "meta")
    with DeviceDiscipline():
        spec.prefill(torch.zeros(1, 8, dtype=torch.long, device="meta"), 16)
        spec.round()
        spec.round()
    assert_all_on(spec, "meta")  # nothing a round created was left on the host either


class GraphRecorder:
    """A torch.compile backend that keeps the FX graphs dynamo hands it and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward


HOST_READS = {"item", "tolist", "cpu", "numpy"}


@pytest.mark.parametrize("case", ["eagle", "eagle2", "eagle3"])
@torch.no_grad()
def test_compiled_round_is_one_graph_without_host_syncs_or_copies(case):
    """compile_round's fullgraph=True fails on any graph break (an .item() without
    capture_scalar_outputs is one); the graph must hold no host read and no move between devices."""
    torch._dynamo.reset()
    spec = build(case, tiny_target("tiny-llama"))
    spec.setup(1, 64)
    spec.prefill(torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0)), 16)
    recorder = GraphRecorder()
    compile_round(spec, backend=recorder)
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        spec.round()
        spec.round()  # the same graph again, no recompilation
    assert len(recorder.graphs) == 1
    for node in recorder.graphs[0].graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        assert name not in HOST_READS and "_local_scalar_dense" not in name, node.format_node()
        if name in ("to", "cuda"):
            moves = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (torch.device, str))]
            assert not moves, f"a device move inside the round: {node.format_node()}"
    torch._dynamo.reset()


class MutationRecorder:
    """A torch.compile backend through AOTAutograd that keeps, per graph, what CUDA-graph trees
    decide by: the inputs the graph mutates, the ones that are static (parameters and buffers:
    fixed addresses a CUDA graph may bake in), and the functional forward graph. Runs it as is."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def forward(fx, inputs):
            meta = torch._guards.TracingContext.try_get().fw_metadata
            self.graphs.append(dict(
                inputs=len(meta.input_info), static=set(meta.static_input_indices or ()), fx=fx,
                mutated={i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata}))
            return make_boxed_func(fx.forward)

        return aot_autograd(fw_compiler=forward)(gm, example_inputs)


def storage_sized(fx: torch.fx.GraphModule, numel: int) -> list:
    """The nodes of fx that hold a tensor of the whole KV storage's size (every layer's cache: the
    synthetic base AOTAutograd makes of overlapping inputs, or a copy of it)."""
    return [node.format_node() for node in fx.graph.nodes
            if isinstance(node.meta.get("val"), Tensor) and node.meta["val"].numel() == numel]


def compiled_graphs_of_a_round(monkeypatch=None) -> tuple:
    """(graphs, storage numel): the round, plain step and flush of an adaptive EAGLE-2 Speculator
    and generate.py's decode step, compiled on the tiny model through MutationRecorder."""
    import generate

    torch._dynamo.reset()
    target = tiny_target("tiny-llama")
    spec = build("eagle2", target)
    spec.setup(1, 64)
    spec.prefill(torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0)), 16)
    recorder = MutationRecorder()
    compile_round(spec, backend=recorder)
    spec.round()
    spec.plain_step()
    spec.flush()
    step = torch.compile(generate.decode_one_token, backend=recorder, fullgraph=True)
    step(target, torch.zeros(1, dtype=torch.long), torch.tensor([20]), 0.0, None, None)
    torch._dynamo.reset()
    return recorder.graphs, target.kv_storage.numel()


@torch.no_grad()
def test_every_mutated_input_of_a_compiled_graph_is_static():
    """CUDA-graph trees skip a graph that mutates an input without a fixed address ("mutated
    inputs"), and a graph that mutates both kv_storage and the per-layer cache views overlapping it
    gets them merged by AOTAutograd into one synthetic base: the static marks are lost and the
    whole storage is copied every call. Round, plain step, flush and decode step: every mutated
    input static (the caches, the Speculator's state buffers), nothing storage-sized inside."""
    graphs, numel = compiled_graphs_of_a_round()
    assert len(graphs) == 4  # round, plain_step, flush, decode step: one graph each
    for g in graphs:
        assert g["mutated"], "each of these graphs updates caches or state in place"
        assert g["mutated"] <= g["static"], f"mutated inputs that are not static: {sorted(g['mutated'] - g['static'])}"
        assert storage_sized(g["fx"], numel) == []


@torch.no_grad()
def test_the_mutation_check_catches_a_round_that_writes_kv_storage(monkeypatch):
    """The check above fails on the round as it was: accepted K/V copied through kv_storage
    inside the compiled graph (the eager path of model.copy_slots)."""
    def copy_through_storage(model, src, dst):
        rows = torch.arange(src.size(0), device=src.device)[:, None]
        model.kv_storage[:, :, rows, :, dst] = model.kv_storage[:, :, rows, :, src]

    monkeypatch.setattr(speculative, "copy_slots", copy_through_storage)
    graphs, numel = compiled_graphs_of_a_round()
    round_graph = graphs[0]
    assert not round_graph["mutated"] <= round_graph["static"] or storage_sized(round_graph["fx"], numel)
