"""convert_hf_checkpoint.py: converted checkpoints give transformers' logits; GGUF files (written
here, with llama.cpp's q/k permutation, and the real SmolLM2 one) convert to the right RoPE layout;
bad input fails with a clear message; and back: a model.py model written into transformers gives
our logits (scripts/benchmark.py --peers)."""
import json
import math

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

from conftest import tiny_target
from convert_hf_checkpoint import (convert_gguf, convert_hf, hf_model_from_ours, hf_to_model_state_dict, main,
                                   model_args_from_hf, model_to_hf_state_dict)
from model import ModelArgs, Transformer
from quantize import quantize_model
from tokenizer import load_tokenizer

Q8_0, Q4_0, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32


def load_converted(model_path) -> Transformer:
    """model.pth into model.py, strictly: every tensor has a place and every place a tensor."""
    args = ModelArgs.from_checkpoint(model_path)
    with torch.device("meta"):
        model = Transformer(args)
    state_dict = torch.load(model_path, mmap=True, weights_only=True)
    if args.tie_embeddings:  # the file stores the shared matrix once, as tok_embeddings.weight
        assert "output.weight" not in state_dict
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    model.load_state_dict(state_dict, strict=True, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def hf_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def logits_pair(model_path, reference, seq_len=40):
    """Full-prefill logits of the converted model and of transformers' model on the same tokens
    (40 > the tiny Mistral's sliding window of 16)."""
    model = load_converted(model_path)
    ids = torch.randint(0, 512, (2, seq_len), generator=torch.Generator().manual_seed(0))
    model.setup_caches(2, seq_len)
    return model(ids, torch.arange(seq_len)), reference(ids).logits


# ---------------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, weights", [
    ("llama", "safetensors"), ("llama", "sharded-bin"),
    ("mistral", "sharded-safetensors"),
    ("qwen2", "safetensors"), ("qwen2", "sharded-bin"),
])
def test_converted_logits_equal_transformers(tiny_hf_checkpoint, arch, weights):
    folder = tiny_hf_checkpoint(arch, weights)
    ours, reference = logits_pair(convert_hf(folder), hf_model(folder))
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_model_config_records_each_feature(tiny_hf_checkpoint):
    def converted(arch):
        folder = tiny_hf_checkpoint(arch)
        convert_hf(folder)
        return json.loads((folder / "model_config.json").read_text())

    llama, mistral, qwen2 = converted("llama"), converted("mistral"), converted("qwen2")
    assert llama["model"]["rope_scaling"] == dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=64)
    assert (llama["model"]["rope_base"], llama["model"]["n_local_heads"], llama["model"]["block_size"]) == (500000.0, 2, 256)
    assert mistral["model"]["sliding_window"] == 16
    # Qwen2's config says sliding_window=4096 but use_sliding_window=false: no window.
    assert qwen2["model"]["sliding_window"] is None
    assert qwen2["model"]["qkv_bias"] and qwen2["model"]["tie_embeddings"]
    assert llama["tokenizer"]["chat_template"] == "llama-3" and llama["tokenizer"]["add_bos"]
    assert qwen2["tokenizer"] == {"file": "tokenizer.json", "chat_template": "chatml",
                                  "system_prompt": "You are a tiny test model.", "bos_id": None,
                                  "add_bos": False, "stop_ids": [0, 2]}
    assert llama["source"] == {"format": "hf", "architecture": "LlamaForCausalLM", "dtype": "float32"}


def test_dtype_auto_follows_the_config_and_can_be_overridden(tiny_hf_checkpoint):
    folder = tiny_hf_checkpoint("qwen2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    state_dict = torch.load(convert_hf(folder), weights_only=True)
    assert {t.dtype for t in state_dict.values()} == {torch.bfloat16}
    state_dict = torch.load(convert_hf(folder, dtype="float16", force=True), weights_only=True)
    assert {t.dtype for t in state_dict.values()} == {torch.float16}


def test_transformers4_style_rope_config(tiny_hf_checkpoint):
    """Configs written by transformers < 5 have rope_theta and rope_scaling (with "type" in old
    ones) instead of rope_parameters."""
    folder = tiny_hf_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (folder / "config.json").write_text(json.dumps(config))
    ours, reference = logits_pair(convert_hf(folder), hf_model(folder))
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# GGUF files written here from the tiny models
# ---------------------------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to LLaMA q/k rows: rotate-half -> interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_gguf(hf_folder, path, qtype=F32):
    """A GGUF file as llama.cpp's converter would write it for a tiny HF llama or qwen2 folder:
    metadata, the byte-level BPE vocabulary, and tensors (2-D ones as qtype, norms as F32)."""
    from safetensors.torch import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    arch = config["model_type"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])

    tokenizer = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre({"llama": "llama-bpe", "qwen2": "qwen2"}[arch])
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"][-1] if arch == "llama" else config["eos_token_id"])
    if arch == "llama":
        writer.add_bos_token_id(config["bos_token_id"])
        writer.add_add_bos_token(True)
    writer.add_chat_template((hf_folder / "chat_template.jinja").read_text())

    for name, w in load_file(hf_folder / "model.safetensors").items():
        w = w.numpy()
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            gguf_name = f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_cpp_permute(w, n_head if "attn_q" in gguf_name else n_kv)
        if w.ndim == 2 and qtype != F32:
            writer.add_tensor(gguf_name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_f32_logits_equal_transformers(tiny_hf_checkpoint, tmp_path, arch):
    """LLaMA q/k come out of GGUF interleaved and must be un-permuted; Qwen2's must not be."""
    folder = tiny_hf_checkpoint(arch, rope_scaling=None)  # llama.cpp keeps llama3 scaling as a table
    model_path = convert_gguf(write_gguf(folder, tmp_path / "tiny.gguf"), tmp_path / "converted")
    ours, reference = logits_pair(model_path, hf_model(folder))
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)

    config = json.loads((tmp_path / "converted/model_config.json").read_text())
    assert config["model"]["tie_embeddings"] == (arch == "qwen2")
    assert config["model"]["qkv_bias"] == (arch == "qwen2")
    assert config["source"]["format"] == "gguf" and config["source"]["tensor_types"]["F32"] > 0
    # The rebuilt tokenizer.json tokenizes like the original one.
    ours_tok, original = load_tokenizer(tmp_path / "converted"), load_tokenizer(folder)
    for text in ["The quick brown fox, 1234 times!", "  indented\nlines\n\n", "Zürich 🙂"]:
        assert ours_tok.encode(text) == original.encode(text)
    assert ours_tok.stop_ids == original.stop_ids


@pytest.mark.parametrize("qtype, loose", [(Q8_0, 0.1), (Q4_0, 0.6)])
def test_gguf_quantized(tiny_hf_checkpoint, tmp_path, qtype, loose):
    folder = tiny_hf_checkpoint("llama", rope_scaling=None)
    model_path = convert_gguf(write_gguf(folder, tmp_path / "tiny.gguf", qtype), tmp_path / "converted")
    reference = hf_model(folder)
    ours, float_logits = logits_pair(model_path, reference)
    # Loose: quantization noise, which this random tiny net amplifies (a wrong RoPE layout: ~1.1).
    assert (ours - float_logits).abs().mean() < loose * float_logits.abs().mean()

    # Exact: transformers with every matrix replaced by dequantize(quantize(w)) gives our logits.
    def roundtrip(w):
        return torch.from_numpy(dequantize(quantize(w.detach().numpy(), qtype), qtype))

    state_dict = torch.load(model_path, weights_only=True)
    down = reference.model.layers[1].mlp.down_proj.weight  # [64, 128]: orientation shows
    assert torch.equal(state_dict["layers.1.feed_forward.w2.weight"], roundtrip(down))
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() == 2:
                p.copy_(roundtrip(p))
    ours, quantized_reference = logits_pair(model_path, reference)
    torch.testing.assert_close(ours, quantized_reference, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct GGUF (Q4_1, llama architecture: q/k permuted)
# ---------------------------------------------------------------------------------------------
# Ordinary expository English written for this test (~150 words).
PARAGRAPH = (
    "Water covers about seventy percent of the surface of the Earth. Most of it is salt water in the "
    "oceans, and only a small part is fresh water that people can drink. The water cycle describes how "
    "water moves between the oceans, the air and the land. When the sun heats the surface of the ocean, "
    "some of the water evaporates and rises into the air as water vapor. As the vapor rises, it cools and "
    "forms clouds. When the droplets in the clouds become large enough, they fall back to the ground as "
    "rain or snow. Some of this water flows over the land into rivers and lakes, and some of it soaks into "
    "the ground, where it becomes groundwater. Plants take up water through their roots and release it "
    "into the air through their leaves. In the end, most of the water returns to the ocean, and the cycle "
    "begins again.")


@torch.no_grad()
def perplexity(model, ids) -> float:
    model.setup_caches(1, len(ids))
    logits = model(torch.tensor([ids]), torch.arange(len(ids)))[0]
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def test_smollm2_perplexity_needs_the_unpermuted_layout(smollm2_checkpoint):
    """Measured: 5.3 with the right layout, 41 with llama.cpp's interleaved one left in place.
    Both produce fluent-looking text; only the perplexity tells them apart."""
    model = load_converted(smollm2_checkpoint / "model.pth")
    ids = load_tokenizer(smollm2_checkpoint).encode(PARAGRAPH)
    assert 150 < len(ids) < 200
    assert perplexity(model, ids) < 8

    c = model.config
    q, kv = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
    for layer in model.layers:  # put the permutation back: what a converter that forgot it gives
        w = layer.attention.wqkv.weight.detach()
        w[:q] = torch.from_numpy(llama_cpp_permute(w[:q].numpy(), c.n_head))
        w[q:q + kv] = torch.from_numpy(llama_cpp_permute(w[q:q + kv].numpy(), c.n_local_heads))
    model.max_seq_length = -1  # fresh caches
    assert perplexity(model, ids) > 20


def test_smollm2_model_config(smollm2_checkpoint):
    config = json.loads((smollm2_checkpoint / "model_config.json").read_text())
    assert config["model"] == ModelArgs.from_name("SmolLM2-135M").to_dict()
    assert config["tokenizer"]["stop_ids"] == [0, 2] and config["tokenizer"]["chat_template"] == "chatml"
    assert config["source"]["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------
_TINY_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=256)


def test_missing_folder_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        convert_hf(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **_TINY_CONFIG}))
    with pytest.raises(FileNotFoundError, match="no weights"):
        convert_hf(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "unsupported rope scaling 'yarn'"),
])
def test_unsupported_configs(tiny_hf_checkpoint, change, message):
    folder = tiny_hf_checkpoint("llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        convert_hf(folder)
    assert not (folder / "model.pth").exists()


def test_unsupported_tensors(tiny_hf_checkpoint):
    # LLaMA's attention_bias also puts a bias on o_proj, which model.py does not have.
    folder = tiny_hf_checkpoint("llama", attention_bias=True)
    with pytest.raises(ValueError, match="no place for .*o_proj.bias"):
        convert_hf(folder)


def test_missing_tensor(tiny_hf_checkpoint):
    from safetensors.torch import load_file, save_file

    folder = tiny_hf_checkpoint("llama")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match="lacks the tensor model.layers.1.mlp.up_proj.weight"):
        convert_hf(folder)


@pytest.mark.parametrize("weights, file", [("safetensors", "model.safetensors"),
                                           ("sharded-bin", "pytorch_model-00002-of-00003.bin")])
def test_truncated_weights(tiny_hf_checkpoint, weights, file):
    folder = tiny_hf_checkpoint("qwen2", weights)
    data = (folder / file).read_bytes()
    (folder / file).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"cannot read .*{file}"):
        convert_hf(folder)


def test_bad_gguf_files(tmp_path, tiny_hf_checkpoint):
    with pytest.raises(FileNotFoundError, match="no such file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "text.gguf").write_text("not a GGUF file at all")
    with pytest.raises(ValueError, match="cannot read .*text.gguf as GGUF"):
        convert_gguf(tmp_path / "text.gguf", tmp_path / "out")

    good = write_gguf(tiny_hf_checkpoint("qwen2"), tmp_path / "tiny.gguf")
    data = good.read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="cannot read .*truncated.gguf as GGUF"):
        convert_gguf(tmp_path / "truncated.gguf", tmp_path / "out")

    writer = gguf.GGUFWriter(tmp_path / "phi3.gguf", "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        convert_gguf(tmp_path / "phi3.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_without_force(tiny_hf_checkpoint, capsys):
    folder = tiny_hf_checkpoint("qwen2")
    (folder / "model.pth").write_text("the user's own file")
    with pytest.raises(SystemExit, match="error: refusing to overwrite .*model.pth.*--force"):
        main(["--checkpoint_dir", str(folder)])
    assert (folder / "model.pth").read_text() == "the user's own file"
    main(["--checkpoint_dir", str(folder), "--force"])
    assert "wrote" in capsys.readouterr().out
    load_converted(folder / "model.pth")


def test_cli_reports_errors_without_traceback(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: no such folder: .*nowhere$"):
        main(["--checkpoint_dir", str(tmp_path / "nowhere")])


# ---------------------------------------------------------------------------------------------
# Published EAGLE-1/2 heads (reference layout)
# ---------------------------------------------------------------------------------------------
def write_reference_eagle_head(draft, folder, safetensors: bool, embed=None):
    """The layout of EAGLE's repository: a LLaMA config.json with one layer; fc, layers.0.* with
    separate q/k/v, no input_layernorm, and optionally a copy of the target's embedding."""
    c = draft.config
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.dim,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_local_heads, "num_hidden_layers": 1, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_base, "max_position_embeddings": c.block_size, "vocab_size": c.vocab_size,
        "torch_dtype": "float32", "bias": draft.fc_bias}))
    sd = draft.state_dict()
    q, k, v = sd["layer.attention.wqkv.weight"].split([c.n_head * c.head_dim] + [c.n_local_heads * c.head_dim] * 2)
    tensors = {"fc.weight": sd["fc.weight"], "layers.0.self_attn.q_proj.weight": q,
               "layers.0.self_attn.k_proj.weight": k, "layers.0.self_attn.v_proj.weight": v,
               "layers.0.self_attn.o_proj.weight": sd["layer.attention.wo.weight"],
               "layers.0.mlp.gate_proj.weight": sd["layer.feed_forward.w1.weight"],
               "layers.0.mlp.up_proj.weight": sd["layer.feed_forward.w3.weight"],
               "layers.0.mlp.down_proj.weight": sd["layer.feed_forward.w2.weight"],
               "layers.0.post_attention_layernorm.weight": sd["layer.ffn_norm.weight"]}
    if draft.fc_bias:
        tensors["fc.bias"] = sd["fc.bias"]
    if embed is not None:
        tensors["embed_tokens.weight"] = embed
    tensors = {name: t.clone().contiguous() for name, t in tensors.items()}
    if safetensors:
        from safetensors.torch import save_file
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        torch.save(tensors, folder / "pytorch_model.bin")


@pytest.mark.parametrize("fc_bias, safetensors", [(True, False), (False, True)])
@torch.no_grad()
def test_published_eagle_head_converts_to_the_same_draft(tmp_path, fc_bias, safetensors):
    from conftest import random_draft, tiny_target
    from convert_hf_checkpoint import convert_eagle
    from checkpoint import load_draft

    target = tiny_target("tiny-llama")
    draft = random_draft(target, fc_bias=fc_bias, std=0.1)
    write_reference_eagle_head(draft, tmp_path / "head", safetensors, embed=target.tok_embeddings.weight)
    assert main(["--eagle_dir", str(tmp_path / "head")]) is None
    converted = load_draft(tmp_path / "head", target.config)
    assert converted.fc_bias == fc_bias
    for d in (draft, converted):
        d.setup_caches(1, 16)
    emb, feats = torch.randn(1, 7, 64), torch.randn(1, 7, 64)
    torch.testing.assert_close(converted(emb, feats, torch.arange(7)), draft(emb, feats, torch.arange(7)))
    with pytest.raises(FileExistsError, match="--force"):
        convert_eagle(tmp_path / "head")


def test_eagle_head_errors(tmp_path, capsys):
    from conftest import random_draft, tiny_target
    from convert_hf_checkpoint import convert_eagle
    from checkpoint import load_draft

    target = tiny_target("tiny-llama")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_eagle(tmp_path / "nothing")
    # a head made for a wider target: converts, but does not fit this target
    wide = tiny_target("tiny-llama", dim=128, n_head=4, head_dim=32)
    write_reference_eagle_head(random_draft(wide), tmp_path / "wide", safetensors=True)
    convert_eagle(tmp_path / "wide")
    with pytest.raises(ValueError, match="hidden size 128, the target has 64"):
        load_draft(tmp_path / "wide", target.config)
    # an EAGLE-1/2 layout with an fc over three layers' features is refused with a reason
    write_reference_eagle_head(random_draft(target), tmp_path / "three", safetensors=True)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "three" / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(64, 192)
    save_file(tensors, str(tmp_path / "three" / "model.safetensors"))
    with pytest.raises(ValueError, match="not an EAGLE-1/2 head: fc.weight should be"):
        convert_eagle(tmp_path / "three")
    # a missing tensor, and the command line reports it without a traceback
    tensors = load_file(str(tmp_path / "wide" / "model.safetensors"))
    del tensors["layers.0.mlp.up_proj.weight"]
    (tmp_path / "wide" / "draft.safetensors").unlink()
    save_file(tensors, str(tmp_path / "wide" / "model.safetensors"))
    with pytest.raises(SystemExit, match="lacks the tensor layers.0.mlp.up_proj.weight"):
        main(["--eagle_dir", str(tmp_path / "wide"), "--force"])


# ---------------------------------------------------------------------------------------------
# Published EAGLE-3 heads: the reference's key names and shapes, and its forward, written here
# from the published description (independently of draft.py)
# ---------------------------------------------------------------------------------------------
def eagle3_reference_maps(vocab: torch.Tensor, vocab_size: int):
    """The inverse of eagle3_vocab: the reference's (d2t offsets, t2d mask) for a draft vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    return vocab - torch.arange(len(vocab)), t2d


def write_reference_eagle3_head(draft, folder, embed=None, maps=True):
    """Write an Eagle3Draft in the reference layout: config.json with draft_vocab_size, separate
    q/k/v, midlayer.* names, d2t offsets and the t2d mask (maps=False: neither, as for a head
    over the whole vocabulary)."""
    folder.mkdir(parents=True, exist_ok=True)
    c = draft.config
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": c.dim, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_local_heads, "num_hidden_layers": 1,
        "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_base, "max_position_embeddings": c.block_size,
        "vocab_size": c.vocab_size, "draft_vocab_size": draft.draft_vocab_size, "torch_dtype": "float32",
        "hidden_act": "silu"}))
    sd = draft.state_dict()
    q, k, v = sd["layer.attention.wqkv.weight"].split([c.n_head * c.head_dim] + [c.n_local_heads * c.head_dim] * 2)
    tensors = {"fc.weight": sd["fc.weight"], "midlayer.self_attn.q_proj.weight": q,
               "midlayer.self_attn.k_proj.weight": k, "midlayer.self_attn.v_proj.weight": v,
               "midlayer.self_attn.o_proj.weight": sd["layer.attention.wo.weight"],
               "midlayer.mlp.gate_proj.weight": sd["layer.feed_forward.w1.weight"],
               "midlayer.mlp.up_proj.weight": sd["layer.feed_forward.w3.weight"],
               "midlayer.mlp.down_proj.weight": sd["layer.feed_forward.w2.weight"],
               "midlayer.input_layernorm.weight": sd["layer.input_norm.weight"],
               "midlayer.hidden_norm.weight": sd["layer.hidden_norm.weight"],
               "midlayer.post_attention_layernorm.weight": sd["layer.ffn_norm.weight"],
               "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    if maps:
        tensors["d2t"], tensors["t2d"] = eagle3_reference_maps(draft.vocab, c.vocab_size)
    if embed is not None:
        tensors["embed_tokens.weight"] = embed
    from safetensors.torch import save_file
    save_file({name: t.clone().contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))


def published_eagle3_forward(folder, embeds, fused):
    """The EAGLE-3 draft over one sequence, causal, by the published description, from the
    reference files alone: fc over the three layers' features; q/k/v over [input_layernorm(embed);
    hidden_norm(feature)]; the residual from the feature; post_attention_layernorm and the SwiGLU
    MLP; the head's own norm and lm_head. Returns (log-probabilities over the draft vocabulary,
    the target id of each draft token: i + d2t[i])."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    n, h = embeds.shape
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D, eps = h // H, cfg["rms_norm_eps"]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # x [heads, n, D], rotate-half, positions 0..n-1
        inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, D, 2).float() / D)
        angles = torch.outer(torch.arange(n).float(), inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin

    g = fused @ w["fc.weight"].T
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), rms(g, w["midlayer.hidden_norm.weight"])], -1)
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, H, D).transpose(0, 1))
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV, D).transpose(0, 1))
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV, D).transpose(0, 1)
    k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
    scores = (q @ k.transpose(1, 2)) / D ** 0.5 + torch.full((n, n), float("-inf")).triu(1)
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, h) @ w["midlayer.self_attn.o_proj.weight"].T
    h1 = g + att
    z = rms(h1, w["midlayer.post_attention_layernorm.weight"])
    out = h1 + (torch.nn.functional.silu(z @ w["midlayer.mlp.gate_proj.weight"].T)
                * (z @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    d2t = w.get("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
    return logits.log_softmax(-1), torch.arange(cfg["draft_vocab_size"]) + d2t


@pytest.mark.parametrize("reduced", [True, False], ids=["reduced-vocab", "full-vocab"])
@torch.no_grad()
def test_published_eagle3_head_converts_and_matches_the_published_forward(tmp_path, reduced):
    from checkpoint import load_draft
    from conftest import random_eagle3_draft, tiny_target
    from draft import Eagle3Draft

    target = tiny_target("tiny-llama", n_layer=8)  # layers (2, 4, 5) fused
    draft = random_eagle3_draft(target, draft_vocab_size=200 if reduced else 512, std=0.1)
    write_reference_eagle3_head(draft, tmp_path / "head", embed=target.tok_embeddings.weight, maps=reduced)
    assert main(["--eagle_dir", str(tmp_path / "head")]) is None
    converted = load_draft(tmp_path / "head", target.config)
    assert isinstance(converted, Eagle3Draft) and converted.layer_ids == (2, 4, 5)
    assert converted.draft_vocab_size == draft.draft_vocab_size and "embed" not in " ".join(converted.state_dict())
    tokens = torch.randint(0, 512, (1, 9))
    target.setup_caches(1, 16)
    _, _, layer_inputs = target(tokens, torch.arange(9), layer_ids=converted.layer_ids)
    fused = torch.cat(layer_inputs, -1)[0]
    embeds = target.tok_embeddings(tokens)[0]
    expected_logp, expected_ids = published_eagle3_forward(tmp_path / "head", embeds, fused)
    converted.setup_caches(1, 16)
    logp = converted.log_probs(converted(embeds[None], fused[None], torch.arange(9)))[0]
    torch.testing.assert_close(logp, expected_logp, atol=1e-4, rtol=1e-4)
    assert torch.equal(converted.target_ids(torch.arange(converted.draft_vocab_size)), expected_ids)


def test_eagle3_vocabulary_maps_round_trip():
    from convert_hf_checkpoint import eagle3_vocab

    vocab = torch.tensor([0, 3, 4, 9, 15])
    d2t, t2d = eagle3_reference_maps(vocab, 16)
    assert d2t.tolist() == [0, 2, 2, 6, 11] and t2d.nonzero().flatten().tolist() == vocab.tolist()
    assert torch.equal(eagle3_vocab(d2t, t2d, 5, 16), vocab)
    assert torch.equal(eagle3_vocab(None, None, 16, 16), torch.arange(16))
    bad = t2d.clone()
    bad[5] = True
    with pytest.raises(ValueError, match="disagree"):
        eagle3_vocab(d2t, bad, 5, 16)
    with pytest.raises(ValueError, match="both d2t and t2d"):
        eagle3_vocab(d2t, None, 5, 16)
    with pytest.raises(ValueError, match="needs the d2t and t2d maps"):
        eagle3_vocab(None, None, 5, 16)


def test_eagle3_head_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    from checkpoint import load_draft, save_draft
    from conftest import random_eagle3_draft, tiny_target
    from convert_hf_checkpoint import convert_eagle

    target = tiny_target("tiny-llama", n_layer=8)
    write_reference_eagle3_head(random_eagle3_draft(target), tmp_path / "head")
    # a missing tensor, a tensor with no place, an fc with a bias
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    for change, message in [(lambda t: t.pop("midlayer.hidden_norm.weight"), "lacks the tensor midlayer.hidden_norm"),
                            (lambda t: t.update(extra=torch.zeros(1)), "no place for: extra"),
                            (lambda t: t.update({"fc.bias": torch.zeros(64)}), "without a bias")]:
        broken = dict(tensors)
        change(broken)
        save_file(broken, str(tmp_path / "head" / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            convert_eagle(tmp_path / "head", force=True)
    # heads that convert but were made for another target: wider, another vocabulary, other layers
    wide = tiny_target("tiny-llama", dim=128, n_head=4, head_dim=32, n_layer=8)
    write_reference_eagle3_head(random_eagle3_draft(wide), tmp_path / "wide")
    convert_eagle(tmp_path / "wide")
    with pytest.raises(ValueError, match="hidden size 128, the target has 64"):
        load_draft(tmp_path / "wide", target.config)
    other_vocab = tiny_target("tiny-llama", vocab_size=1024, n_layer=8)
    write_reference_eagle3_head(random_eagle3_draft(other_vocab), tmp_path / "vocab")
    convert_eagle(tmp_path / "vocab")
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens, the target has 512"):
        load_draft(tmp_path / "vocab", target.config)
    shallow = tiny_target("tiny-llama", n_layer=4)  # a head of ours records its target's fused layers
    save_draft(random_eagle3_draft(shallow), tmp_path / "ours")
    with pytest.raises(ValueError, match=r"fuses target layers \[2, 2, 1\].*made for another model"):
        load_draft(tmp_path / "ours", target.config)


# ---------------------------------------------------------------------------------------------
# Back to transformers (scripts/benchmark.py --peers)
# ---------------------------------------------------------------------------------------------
def random_ours(name: str, **overrides) -> Transformer:
    """A model.py tiny config with O(1) random weights, biases and norms, so that a wrong name,
    a wrong q/k/v split or a lost bias shows in the logits."""
    model = tiny_target(name, **overrides)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if n.endswith("norm.weight") else p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("name, overrides, architecture", [
    ("tiny-llama-3.1", {}, "LlamaForCausalLM"),  # GQA, llama3 RoPE scaling
    ("tiny-qwen2", {}, "Qwen2ForCausalLM"),  # q/k/v biases, tied embeddings
    ("tiny-llama", dict(sliding_window=16), "MistralForCausalLM"),
    ("tiny-qwen2", dict(sliding_window=16), "Qwen2ForCausalLM"),  # Qwen2's window, in every layer
])
@torch.no_grad()
def test_hf_model_from_ours_gives_our_logits(name, overrides, architecture):
    model = random_ours(name, **overrides)
    hf = hf_model_from_ours(model)
    assert type(hf).__name__ == architecture and hf.dtype == torch.float32
    # the inverse of each half of the converter: config and weights come back unchanged
    assert model_args_from_hf(hf.config.to_dict()) == model.config
    ours = model.state_dict()
    back = hf_to_model_state_dict(model_to_hf_state_dict(ours, model.config), model.config)
    if model.config.tie_embeddings:  # the shared matrix is stored once, as model.pth stores it
        del ours["output.weight"]
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))  # 40 > the window of 16
    model.setup_caches(2, 40)
    # Float32, the same operations: measured equal to the last bit on a CPU; 1e-5 leaves room
    # for another kernel's summation order.
    torch.testing.assert_close(hf(ids).logits, model(ids, torch.arange(40)), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_hf_model_from_ours_smollm2(smollm2_checkpoint):
    """The real model (LLaMA architecture, tied embeddings, 30 layers), from model.pth."""
    model = load_converted(smollm2_checkpoint / "model.pth")
    hf = hf_model_from_ours(model)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings
    ids = load_tokenizer(smollm2_checkpoint).encode(PARAGRAPH)
    model.setup_caches(1, len(ids))
    ours, theirs = model(torch.tensor([ids]), torch.arange(len(ids))), hf(torch.tensor([ids])).logits
    # Float32 through 30 layers, summed in another order (one wqkv matmul here, three there):
    # measured 4e-5 apart on logits of magnitude ~30.
    torch.testing.assert_close(theirs, ours, atol=2e-4, rtol=1e-5)
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_hf_model_from_ours_errors():
    with pytest.raises(ValueError, match="mixture-of-experts model .* dense models only"):
        hf_model_from_ours(tiny_target("tiny-mixtral"))
    model = tiny_target("tiny-llama")
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match=r"no place in a transformers model \(a quantized checkpoint\?.*scales"):
        hf_model_from_ours(model)
    state_dict = tiny_target("tiny-llama").state_dict()
    del state_dict["layers.1.feed_forward.w3.weight"]
    with pytest.raises(ValueError, match="lacks the tensor layers.1.feed_forward.w3.weight"):
        model_to_hf_state_dict(state_dict, ModelArgs.from_name("tiny-llama"))
