"""Mixtral (model.MoEFeedForward): both ways of running the experts equal a plain per-token loop;
converted checkpoints (hub layout and transformers 5's fused one) give transformers' logits and
greedy tokens; EAGLE on a Mixtral target (dense draft) is lossless; the compiled decode step and
speculative round have no graph break; int8 expert weights (quantize.py)."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import checkpoint
import generate as gen
import speculative
from conftest import mirrored_pair, random_draft, tiny_target
from convert_hf_checkpoint import convert_hf
from model import FeedForward, ModelArgs, MoEFeedForward, Transformer
from quantize import WeightOnlyInt8Experts, dequantize_int8, quantize_model
from quantize_checkpoint import quantize_checkpoint
from test_convert import hf_model, logits_pair
from test_speculative import METHODS, prompts, vanilla


# ---------------------------------------------------------------------------------------------
# The MoE feed-forward on its own
# ---------------------------------------------------------------------------------------------
def per_token_loop(moe: MoEFeedForward, x):
    """Mixtral's rule written out token by token: softmax over all experts in float32, the two
    most probable experts, their probabilities renormalised, a weighted sum of their SwiGLUs."""
    out = []
    for token in x:
        probs = torch.softmax(F.linear(token, moe.gate.weight).float(), -1)
        chosen = probs.argsort(descending=True)[:2]
        mix = probs[chosen] / probs[chosen].sum()
        w1, w2, w3 = moe.w1.weight, moe.w2.weight, moe.w3.weight
        out.append(sum(m * F.linear(F.silu(F.linear(token, w1[e])) * F.linear(token, w3[e]), w2[e])
                       for m, e in zip(mix, chosen)))
    return torch.stack(out)


@pytest.mark.parametrize("n_tokens", [1, 2, 5, 60])
@torch.no_grad()
def test_gathered_and_dense_experts_equal_a_per_token_loop(n_tokens):
    moe = tiny_target("tiny-mixtral").layers[1].feed_forward
    x = torch.randn(n_tokens, moe.gate.in_features, generator=torch.Generator().manual_seed(n_tokens))
    expected = per_token_loop(moe, x)
    weights, experts = torch.softmax(moe.gate(x).float(), -1).topk(2, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    assert len(experts.unique()) > (1 if n_tokens == 1 else 2)  # tokens do not all pick the same experts
    torch.testing.assert_close(moe.gathered(x, experts, weights), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe.dense(x, experts, weights), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe(x[None]), expected[None], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_decode_gathers_experts_and_trees_run_them_densely(monkeypatch):
    """The static rule: gather while tokens * k < experts (4 experts, top-2: one token), else dense."""
    calls = []
    for way in ("gathered", "dense"):
        original = getattr(MoEFeedForward, way)
        monkeypatch.setattr(MoEFeedForward, way, lambda self, x, *a, _w=way, _f=original: calls.append((_w, x.size(0))) or _f(self, x, *a))
    model = tiny_target("tiny-mixtral")
    model.setup_caches(1, 32)
    model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), torch.arange(8))
    assert set(calls) == {("dense", 8)}
    calls.clear()
    model(torch.tensor([[9]]), torch.tensor([8]))
    assert set(calls) == {("gathered", 1)}


def test_bad_expert_counts_are_clear_errors():
    with pytest.raises(ValueError, match=r"num_activated_experts=3 must be in \[1, num_experts=2\]"):
        ModelArgs(num_experts=2, num_activated_experts=3)


# ---------------------------------------------------------------------------------------------
# Converted checkpoints against transformers' MixtralForCausalLM
# ---------------------------------------------------------------------------------------------
def rewrite_weights(folder, layout: str):
    """Replace the folder's weights by the same tensors with other names: "hub" (one w1/w2/w3 per
    expert under block_sparse_moe, as the published Mixtral repos have them) or "fused"
    (transformers 5's in-memory names: mlp.gate, mlp.experts.gate_up_proj and down_proj)."""
    fused = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    if layout == "fused":
        weights = fused
    else:
        weights = {}
        for name, t in fused.items():
            moe = name.split("mlp.")[0] + "block_sparse_moe."
            if name.endswith("mlp.experts.gate_up_proj"):
                for e, expert in enumerate(t):
                    weights[f"{moe}experts.{e}.w1.weight"], weights[f"{moe}experts.{e}.w3.weight"] = expert.chunk(2)
            elif name.endswith("mlp.experts.down_proj"):
                weights.update({f"{moe}experts.{e}.w2.weight": expert for e, expert in enumerate(t)})
            elif name.endswith("mlp.gate.weight"):
                weights[moe + "gate.weight"] = t
            else:
                weights[name] = t
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return weights


@pytest.mark.parametrize("layout", ["save_pretrained", "hub", "fused"])
def test_converted_logits_equal_transformers(tiny_hf_checkpoint, layout):
    folder = tiny_hf_checkpoint("mixtral")
    reference = hf_model(folder)
    if layout != "save_pretrained":
        names = rewrite_weights(folder, layout)
        assert ("model.layers.1.mlp.experts.gate_up_proj" in names) == (layout == "fused")
        assert ("model.layers.1.block_sparse_moe.experts.3.w2.weight" in names) == (layout == "hub")
    ours, expected = logits_pair(convert_hf(folder), reference)  # 2 x 40 tokens: the dense way
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    config = json.loads((folder / "model_config.json").read_text())["model"]
    assert (config["num_experts"], config["num_activated_experts"], config["rope_base"]) == (4, 2, 1e6)


@torch.no_grad()
def test_greedy_equals_transformers_generate(tiny_hf_checkpoint):
    """Prefill runs the experts densely, each decode step gathers them."""
    folder = tiny_hf_checkpoint("mixtral")
    model = checkpoint.load_model(convert_hf(folder), "cpu", torch.float32)
    reference = hf_model(folder)
    for seed in range(3):
        prompt = torch.randint(0, 512, (1, 5 + 4 * seed), generator=torch.Generator().manual_seed(seed))
        expected = reference.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, prompt.size(1):].tolist()
        assert gen.generate(model, prompt, 30)[0] == expected


@pytest.mark.parametrize("layout, edit, message", [
    ("fused", 3, "model.layers.0.mlp.experts holds 4 experts, the config says 3"),
    ("hub", 5, "lacks the tensor model.layers.0.block_sparse_moe.experts.4.w1.weight"),
    ("hub", 3, "tensors model.py has no place for"),
])
def test_expert_count_mismatch_is_a_clear_error(tiny_hf_checkpoint, layout, edit, message):
    folder = tiny_hf_checkpoint("mixtral")
    rewrite_weights(folder, layout)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": edit}))
    with pytest.raises(ValueError, match=message):
        convert_hf(folder)


# ---------------------------------------------------------------------------------------------
# EAGLE on a Mixtral target
# ---------------------------------------------------------------------------------------------
def test_draft_for_mixtral_is_dense_with_the_targets_hidden_size():
    target = tiny_target("tiny-mixtral")
    draft = random_draft(target)
    assert draft.config.num_experts == 0 and draft.config.dim == target.config.dim
    assert type(draft.layer.feed_forward) is FeedForward


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_eagle_greedy_equals_vanilla_batched(method):
    """Verification routes the tree nodes of all rows at once and runs the experts densely;
    vanilla decoding, one row at a time, gathers them."""
    target = tiny_target("tiny-mixtral")
    spec = speculative.Speculator(target, random_draft(target), **METHODS[method])
    for seed in range(2):
        batch = torch.cat([p[:, :9] for p in prompts(4, 512, seed=seed, lengths=(9, 10))])
        ids, _ = speculative.speculative_generate(spec, batch, 40)
        assert ids == [vanilla(target, batch[b:b + 1], 40)[0] for b in range(4)]


def test_cli_speculate_on_a_converted_mixtral_equals_vanilla(tiny_hf_checkpoint, tmp_path):
    from checkpoint import save_draft

    folder = tiny_hf_checkpoint("mixtral")
    model_path = convert_hf(folder)
    save_draft(random_draft(checkpoint.load_model(model_path, "cpu", torch.float32)), folder / "eagle")
    outputs = {}
    for method in ("none", "eagle", "eagle2"):
        report = tmp_path / f"{method}.json"
        gen.main(["--checkpoint_path", str(model_path), "--prompt", "The quick brown fox", "--max_new_tokens", "24",
                  "--speculate", method, "--no-compile", "--output_json", str(report)])
        outputs[method] = json.loads(report.read_text())["token_ids"]
    assert outputs["eagle"] == outputs["none"] == outputs["eagle2"] and len(outputs["none"]) > 5


def mirrored_mixtral_pair(seed: int = 0, noise: float = 0.1):
    """conftest.mirrored_pair with the target's feed-forward turned into 4 experts, each the
    draft's MLP plus noise, under a decisive random router: routing changes the target's output,
    but little, so the draft's long guesses still get accepted."""
    dense, draft = mirrored_pair(seed)
    torch.manual_seed(seed)
    target = Transformer(ModelArgs(**{**dense.config.to_dict(), "num_experts": 4})).eval()
    state = dense.state_dict()
    for w in ("w1", "w2", "w3"):
        weight = state.pop(f"layers.0.feed_forward.{w}.weight")
        state[f"layers.0.feed_forward.{w}.weight"] = weight + noise * weight.std() * torch.randn(4, *weight.shape)
    state["layers.0.feed_forward.gate.weight"] = torch.randn(4, target.config.dim)
    target.load_state_dict(state)
    return target, draft


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_eagle_greedy_equals_vanilla_with_long_acceptances_compiled(method):
    """Deep accepted paths through a routed target, with the round compiled as one graph:
    fullgraph=True makes any graph break (a host sync, a data-dependent shape) an error. The
    eager backend checks tracing only: inductor code generation is tested on the decode step."""
    target, draft = mirrored_mixtral_pair()
    spec = speculative.Speculator(target, draft, **METHODS[method])
    spec.setup(1, 128)
    round_fn = torch.compile(spec.round, backend="eager", fullgraph=True)
    taus = []
    for prompt in prompts(6, 512, seed=1, lengths=(3, 40)):
        ids, per_round = speculative.speculative_generate(spec, prompt, 60, round_fn=round_fn)
        assert ids == vanilla(target, prompt, 60)
        taus.append(sum(per_round[0]) / len(per_round[0]))
    assert sum(taus) / len(taus) > 2.5


@torch.no_grad()
def test_compiled_decode_step_has_no_graph_break():
    target = tiny_target("tiny-mixtral")
    prompt = prompts(1, 512, seed=2)[0]
    compiled = torch.compile(gen.decode_one_token, fullgraph=True)
    assert gen.generate(target, prompt, 24, decode_fn=compiled) == gen.generate(target, prompt, 24)


def test_bytes_per_token_count_only_the_routed_experts():
    target = tiny_target("tiny-mixtral")
    c = target.config
    experts = c.n_layer * 3 * c.num_experts * c.intermediate_size * c.dim
    others = sum(p.numel() for p in target.parameters()) - experts - c.vocab_size * c.dim  # minus the embedding
    assert gen.model_bytes_per_token(target) == 4 * (others + experts * 2 // 4)


# ---------------------------------------------------------------------------------------------
# int8 expert weights
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def test_int8_experts_compute_with_their_dequantized_weights():
    """One scale per expert and output channel; prefill (dense) and decode steps (gathered) give
    the logits of a float model that holds the dequantized weights."""
    model = tiny_target("tiny-mixtral")
    quantize_model(model, "int8")
    reference = tiny_target("tiny-mixtral")
    for name, m in model.named_modules():
        if isinstance(m, WeightOnlyInt8Experts):
            assert m.weight.dtype == torch.int8 and m.scales.shape == m.weight.shape[:2]  # [E, out]
        if hasattr(m, "scales"):  # experts and linear layers alike
            reference.get_submodule(name).weight.copy_(dequantize_int8(m.weight, m.scales))
    assert isinstance(model.layers[1].feed_forward.w2, WeightOnlyInt8Experts)
    tokens = prompts(1, 512, seed=3, lengths=(20, 21))[0]
    for m in (model, reference):
        m.setup_caches(1, 32)
    for ids, pos in [(tokens[:, :12], torch.arange(12))] + [(tokens[:, t:t + 1], torch.tensor([t])) for t in range(12, 20)]:
        torch.testing.assert_close(model(ids, pos), reference(ids, pos), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_int8_checkpoint_loads_and_eagle2_is_lossless_on_it(tiny_hf_checkpoint):
    folder = tiny_hf_checkpoint("mixtral")
    path = quantize_checkpoint(convert_hf(folder), "int8")
    model = checkpoint.load_model(path, "cpu", torch.float32)
    assert isinstance(model.layers[0].feed_forward.w1, WeightOnlyInt8Experts)
    in_memory = checkpoint.load_model(folder / "model.pth", "cpu", torch.float32)
    quantize_model(in_memory, "int8")
    tokens = prompts(1, 512, seed=4)[0]
    model.setup_caches(1, 32)
    in_memory.setup_caches(1, 32)
    pos = torch.arange(tokens.size(1))
    torch.testing.assert_close(model(tokens, pos), in_memory(tokens, pos), atol=0, rtol=0)
    spec = speculative.Speculator(model, random_draft(model), **METHODS["eagle2"])
    for prompt in prompts(4, 512, seed=5):
        assert speculative.speculative_generate(spec, prompt, 30)[0] == vanilla(model, prompt, 30)
