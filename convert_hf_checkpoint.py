"""Convert a Hugging Face checkpoint folder or a GGUF file into what model.py loads.

    python convert_hf_checkpoint.py --checkpoint_dir DIR              # DIR written by save_pretrained
    python convert_hf_checkpoint.py --gguf FILE --checkpoint_dir DIR  # e.g. a llama.cpp Q4_1 file

writes DIR/model.pth and DIR/model_config.json (model, tokenizer, source); from GGUF, dequantized to
floats, also DIR/tokenizer.json. LLaMA, Mistral, Mixtral and Qwen2; --eagle_dir converts an EAGLE head.
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import gguf
import torch
from gguf.quants import dequantize
from safetensors.torch import load_file

from checkpoint import DRAFT_CONFIG, DRAFT_WEIGHTS, save_draft
from draft import Eagle3Draft, EagleDraft
from model import CONFIG_FILE, ModelArgs
from tokenizer import gguf_tokenizer, guess_tokenizer_meta

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM")
GGUF_ARCHITECTURES = ("llama", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_hf(checkpoint_dir, dtype: str = "auto", force: bool = False) -> Path:
    """Writes model.pth and model_config.json into a save_pretrained folder; "auto" keeps its dtype."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: expected a folder written by save_pretrained")
    config = json.loads((folder / "config.json").read_text())
    args = model_args_from_hf(config)
    torch_dtype = _torch_dtype(dtype, config.get("dtype") or config.get("torch_dtype"))
    _refuse_to_overwrite([folder / "model.pth", folder / CONFIG_FILE], force)

    try:
        tokenizer = guess_tokenizer_meta(folder)
    except FileNotFoundError as e:  # weights without a tokenizer still convert
        print(f"warning: {e}; model_config.json gets no tokenizer section", file=sys.stderr)
        tokenizer = None

    state_dict = hf_to_model_state_dict(load_hf_weights(folder), args)
    source = {"format": "hf", "architecture": config["architectures"][0]}
    return _write_checkpoint(folder, args, state_dict, torch_dtype, tokenizer, source)


def model_args_from_hf(config: dict) -> ModelArgs:
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} (model_type {config.get('model_type')!r}); "
                         f"supported: {', '.join(ARCHITECTURES)}")
    n_head = config["num_attention_heads"]
    # transformers < 5 writes rope_theta and rope_scaling; 5 writes both into rope_parameters.
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    rope_scaling = {k: rope[k] for k in keys} if rope_type == "llama3" else None
    return ModelArgs(
        block_size=config["max_position_embeddings"], vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"], n_head=n_head, dim=config["hidden_size"],
        intermediate_size=config["intermediate_size"], n_local_heads=config.get("num_key_value_heads") or n_head,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_head,
        rope_base=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0), rope_scaling=rope_scaling,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        # Qwen2 always has q/k/v biases. LLaMA's attention_bias also biases o_proj, which is refused.
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), sliding_window=_sliding_window(arch, config),
        num_experts=config["num_local_experts"] if arch == "MixtralForCausalLM" else 0,
        num_activated_experts=config.get("num_experts_per_tok", 2),
    )


def _sliding_window(arch: str, config: dict):
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return config.get("sliding_window")  # None from Mistral-7B-v0.2 on, and in Mixtral
    if arch == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
        # Qwen2's window applies from layer max_window_layers on; model.py has one for all layers.
        n_layer = config["num_hidden_layers"]
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", n_layer) else "full_attention"
            for i in range(n_layer)]
        if all(t == "sliding_attention" for t in layer_types):
            return config["sliding_window"]
        if any(t == "sliding_attention" for t in layer_types):
            raise ValueError("Qwen2 with sliding-window attention in some layers only is not supported")
    return None


def load_hf_weights(folder: Path) -> dict:
    """All tensors of a save_pretrained folder: safetensors or .bin, whole or sharded."""
    for stem in ("model.safetensors", "pytorch_model.bin"):
        index = folder / f"{stem}.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / stem).is_file():
            files = [stem]
        else:
            continue
        weights = {}
        for path in (folder / name for name in files):
            if not path.is_file():
                raise FileNotFoundError(f"{index.name} lists {path.name}, which is not in {folder}")
            try:
                weights.update(load_file(path) if path.suffix == ".safetensors"
                               else torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:  # SafetensorError, a truncated zip, an unpickling error, ...
                raise ValueError(f"cannot read {path} (truncated or corrupt?): {e}") from e
        return weights
    raise FileNotFoundError(f"no weights in {folder}: expected model.safetensors, pytorch_model.bin "
                            f"or a sharded index of either")


# Hugging Face's per-layer names -> model.py's, both ways (q/k/v and Mixtral's experts: in the code).
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
HF_DENSE_MLP_NAMES = {  # dense models; Mixtral's feed-forward is _experts()
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
# EAGLE heads' layer: the same but for the input norm (EAGLE-1/2 has none, EAGLE-3 two norms of its own).
EAGLE_LAYER_NAMES = {hf: ours for hf, ours in {**HF_LAYER_NAMES, **HF_DENSE_MLP_NAMES}.items()
                     if hf != "input_layernorm.weight"}
EAGLE3_LAYER_NAMES = {**EAGLE_LAYER_NAMES, "input_layernorm.weight": "input_norm.weight",
                      "hidden_norm.weight": "hidden_norm.weight"}


def _taker(weights: dict, owner: str):
    """weights.pop, or a ValueError that names the missing tensor."""
    def take(name):
        if name not in weights:
            raise ValueError(f"{owner} lacks the tensor {name}")
        return weights.pop(name)
    return take


def _refuse_leftovers(names, message: str):
    """Tensors with no place are errors (a feature we lack), not dropped: a partly converted EAGLE head,
    for one, would still decode losslessly, only slowly, and nobody would notice."""
    names = sorted(names)
    if names:
        raise ValueError(f"{message}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")


def _decoder_layer(take, hf: str, ours: str, names: dict, qkv_bias: bool) -> dict:
    """One Hugging Face decoder layer's tensors (prefix hf) under model.py's names (prefix ours)."""
    out = {ours + "attention.wqkv.weight": torch.cat([take(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"])}
    if qkv_bias:
        out[ours + "attention.wqkv.bias"] = torch.cat([take(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"])
    out.update({ours + o: take(hf + h) for h, o in names.items()})
    return out


def hf_to_model_state_dict(weights: dict, args: ModelArgs) -> dict:
    """HF names -> model.py's (q/k/v into wqkv); empties `weights` so a large checkpoint is not held twice."""
    take = _taker(weights, "the checkpoint")
    names = HF_LAYER_NAMES if args.num_experts else {**HF_LAYER_NAMES, **HF_DENSE_MLP_NAMES}
    out = {"tok_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(args.n_layer):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out.update(_decoder_layer(take, hf, ours, names, args.qkv_bias))
        if args.num_experts:
            out.update(_experts(take, weights, hf, ours + "feed_forward.", args.num_experts))
    out["norm.weight"] = take("model.norm.weight")
    if args.tie_embeddings:
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy anyway
    else:
        out["output.weight"] = take("lm_head.weight")
    _refuse_leftovers([k for k in weights if not k.endswith("rotary_emb.inv_freq")],  # old RoPE buffers
                      "the checkpoint has tensors model.py has no place for (an unsupported feature?)")
    return out


def _experts(take, weights: dict, hf: str, ours: str, n_experts: int) -> dict:
    """One Mixtral layer's router and experts as [E, out, in]: per expert under block_sparse_moe, or
    fused as transformers 5 writes them (gate_up_proj [E, 2I, D], gate rows first; down_proj [E, D, I])."""
    if hf + "mlp.experts.gate_up_proj" in weights:
        gate_up, down = take(hf + "mlp.experts.gate_up_proj"), take(hf + "mlp.experts.down_proj")
        if gate_up.size(0) != n_experts or down.size(0) != n_experts:
            raise ValueError(f"{hf}mlp.experts holds {gate_up.size(0)} experts, the config says {n_experts}")
        w1, w3 = (w.contiguous() for w in gate_up.chunk(2, dim=1))
        return {ours + "gate.weight": take(hf + "mlp.gate.weight"),
                ours + "w1.weight": w1, ours + "w3.weight": w3, ours + "w2.weight": down}
    moe = hf + "block_sparse_moe."
    return {ours + "gate.weight": take(moe + "gate.weight"),
            **{f"{ours}{w}.weight": torch.stack([take(f"{moe}experts.{e}.{w}.weight") for e in range(n_experts)])
               for w in ("w1", "w3", "w2")}}


# Back to Hugging Face, for scripts/benchmark.py --peers; transformers is imported only when called.
def model_to_hf_state_dict(state_dict: dict, args: ModelArgs) -> dict:
    """The inverse of hf_to_model_state_dict (tensors shared); a tied LM head is the embedding."""
    if args.num_experts:  # transformers 4 and 5 lay Mixtral's experts out differently in memory
        raise ValueError("a mixture-of-experts model (Mixtral) cannot be written back to transformers here: "
                         "dense models only")
    weights = dict(state_dict)  # emptied as it goes, to find what has no place in a transformers model
    take = _taker(weights, "the state dict")
    q, kv = args.n_head * args.head_dim, args.n_local_heads * args.head_dim
    out = {"model.embed_tokens.weight": take("tok_embeddings.weight")}
    for i in range(args.n_layer):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias") if args.qkv_bias else ("weight",):
            for p, w in zip("qkv", take(f"{ours}attention.wqkv.{suffix}").split([q, kv, kv])):
                out[f"{hf}self_attn.{p}_proj.{suffix}"] = w
        out.update({hf + h: take(ours + o) for h, o in {**HF_LAYER_NAMES, **HF_DENSE_MLP_NAMES}.items()})
    out["model.norm.weight"] = take("norm.weight")
    if args.tie_embeddings:
        weights.pop("output.weight", None)
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if args.tie_embeddings else take("output.weight")
    _refuse_leftovers(weights, "tensors with no place in a transformers model (a quantized checkpoint? "
                               "convert a float model.pth instead)")
    return out


def _hf_config(args: ModelArgs):
    """Qwen2 if q/k/v have biases, Mistral if windowed, else LLaMA; token ids None (not LlamaConfig's)."""
    import transformers

    common = dict(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.n_layer, num_attention_heads=args.n_head, num_key_value_heads=args.n_local_heads,
        head_dim=args.head_dim, max_position_embeddings=args.block_size, rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_base, rope_scaling=dict(rope_type="llama3", **args.rope_scaling) if args.rope_scaling else None,
        tie_word_embeddings=args.tie_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if args.qkv_bias:  # Qwen2 always has q/k/v biases; its window, when on, is in every layer here
        window = dict(use_sliding_window=bool(args.sliding_window), sliding_window=args.sliding_window, max_window_layers=0)
        return transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], **common, **window)
    if args.sliding_window:
        return transformers.MistralConfig(architectures=["MistralForCausalLM"], sliding_window=args.sliding_window, **common)
    return transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **common)


def hf_model_from_ours(model, attn_implementation: str = "sdpa"):
    """A transformers copy of `model` on its device and dtype, in eval mode, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    state_dict = model_to_hf_state_dict(model.state_dict(), model.config)  # first: it refuses what cannot be copied
    weight, config = model.tok_embeddings.weight, _hf_config(model.config)
    with torch.device(weight.device):  # built where it will run: a 7B model is never made on the CPU first
        hf = AutoModelForCausalLM.from_config(config, dtype=weight.dtype, attn_implementation=attn_implementation)
    hf.load_state_dict(state_dict, strict=True)
    return hf.eval()


# GGUF tensor names (blk.N. stripped) -> Hugging Face's: GGUF goes through hf_to_model_state_dict too.
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def convert_gguf(gguf_file, checkpoint_dir, dtype: str = "auto", force: bool = False) -> Path:
    """model.pth, model_config.json and tokenizer.json in DIR from a GGUF file; "auto" is float32."""
    gguf_file, folder = Path(gguf_file), Path(checkpoint_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no such file: {gguf_file}")
    try:
        reader = gguf.GGUFReader(gguf_file)
    except Exception as e:  # bad magic, a truncated header or tensor data, ...
        raise ValueError(f"cannot read {gguf_file} as GGUF (truncated or corrupt?): {e}") from e
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    args = model_args_from_gguf(metadata, tensors)
    torch_dtype = _torch_dtype(dtype, "float32")
    _refuse_to_overwrite([folder / "model.pth", folder / CONFIG_FILE, folder / "tokenizer.json"], force)
    tokenizer_json, tokenizer_meta = gguf_tokenizer(metadata)  # fails early on an unsupported tokenizer

    permuted = metadata["general.architecture"] == "llama"  # llama.cpp permutes LLaMA q/k only
    weights = {}
    for name, t in tensors.items():
        w = _dequantize(t)
        if name.startswith("blk."):
            _, layer, kind, suffix = name.split(".")
            if permuted and kind in ("attn_q", "attn_k"):
                w = unpermute_rope(w, args.n_head if kind == "attn_q" else args.n_local_heads)
            weights[f"model.layers.{layer}.{GGUF_TO_HF.get(kind, kind)}.{suffix}"] = w
        else:
            weights[GGUF_TO_HF.get(name, name)] = w
    state_dict = hf_to_model_state_dict(weights, args)

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    source = {"format": "gguf", "file": gguf_file.name, "architecture": metadata["general.architecture"],
              "name": metadata.get("general.name"),
              "tensor_types": dict(Counter(t.tensor_type.name for t in tensors.values()))}
    return _write_checkpoint(folder, args, state_dict, torch_dtype, tokenizer_meta, source)


def model_args_from_gguf(metadata: dict, tensors: dict) -> ModelArgs:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

    def get(key, default=None):
        return metadata.get(f"{arch}.{key}", default)

    # llama.cpp stores LLaMA-3.1 RoPE scaling as per-frequency factors, not model.py's parameters.
    if "rope_freqs.weight" in tensors or get("rope.scaling.type", "none") != "none":
        raise ValueError("GGUF files with RoPE scaling are not supported: convert the Hugging Face checkpoint instead")
    if "token_embd.weight" not in tensors:
        raise ValueError("the GGUF file lacks the tensor token_embd.weight")
    if get("expert_count"):
        raise ValueError("GGUF mixture-of-experts files (Mixtral) are not supported: "
                         "convert the Hugging Face checkpoint instead")
    dim, n_head = get("embedding_length"), get("attention.head_count")
    return ModelArgs(
        block_size=get("context_length"),
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are [in, out]
        n_layer=get("block_count"), n_head=n_head, dim=dim, intermediate_size=get("feed_forward_length"),
        n_local_heads=get("attention.head_count_kv", n_head), head_dim=get("attention.key_length", dim // n_head),
        # Stored as float32: round 9.99999975e-06 back to the 1e-05 the model was trained with.
        rope_base=float(f"{get('rope.freq_base', 10000.0):.7g}"),
        norm_eps=float(f"{get('attention.layer_norm_rms_epsilon', 1e-5):.7g}"),
        qkv_bias="blk.0.attn_q.bias" in tensors, tie_embeddings="output.weight" not in tensors,
    )


def _dequantize(t) -> torch.Tensor:
    """One GGUF tensor as float32 [out, in]: GGUF lists dimensions innermost first."""
    try:
        w = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"{t.name}: cannot dequantize {t.tensor_type.name}: {e}") from e
    return torch.tensor(w.reshape(tuple(reversed(t.shape.tolist()))))  # a copy: t.data maps the file


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved LLaMA q/k rows, back to HF's rotate-half layout (not for Qwen2)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# Published heads: a one-layer LLaMA config.json and, maybe, a copy of the target's embedding.
# EAGLE-1/2 (EAGLE's repository): fc.weight [h, 2h] with fc.bias (not LLaMA-3's), layers.0 without
# input_layernorm. EAGLE-3: draft_vocab_size in the config; fc.weight [h, 3h]; midlayer.* (q/k/v read
# the normed embedding and feature side by side), norm and lm_head [draft_vocab, h]; d2t [draft_vocab]
# (target id = i + d2t[i]) and t2d [vocab] (bool).
def convert_eagle(eagle_dir, dtype: str = "auto", force: bool = False) -> Path:
    """Converts the EAGLE-1/2 or EAGLE-3 head in DIR for load_draft; the draft uses the target's embedding."""
    folder = Path(eagle_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: expected an EAGLE head (config.json + weights)")
    _refuse_to_overwrite([folder / DRAFT_WEIGHTS, folder / DRAFT_CONFIG], force)
    config = json.loads((folder / "config.json").read_text())
    weights = load_hf_weights(folder)
    weights.pop("embed_tokens.weight", None)
    eagle3 = any(k.startswith("midlayer.") for k in weights) or "draft_vocab_size" in config
    if not eagle3 and not any(k.startswith("layers.0.") for k in weights):
        raise ValueError(f"{folder} holds neither an EAGLE-1/2 head (layers.0.*) nor an EAGLE-3 head (midlayer.*): "
                         f"found {', '.join(sorted(weights)[:5]) or 'no tensors'}")
    kind, layer = ("EAGLE-3", "midlayer.") if eagle3 else ("EAGLE-1/2", "layers.0.")
    if config.get("target_hidden_size", config.get("hidden_size")) != config.get("hidden_size"):
        raise ValueError(f"{folder}: a head whose hidden size differs from its target's (target_hidden_size) is not "
                         f"supported: this project's drafts use the target's embedding")
    args = model_args_from_hf({**config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                               "attention_bias": f"{layer}self_attn.q_proj.bias" in weights})
    fc, fc_in = weights.get("fc.weight"), (3 if eagle3 else 2) * args.dim
    if fc is None or fc.shape != (args.dim, fc_in) or (eagle3 and "fc.bias" in weights):
        raise ValueError(f"{folder} is not an {kind} head: fc.weight should be [{args.dim}, {fc_in}]"
                         f"{' without a bias' if eagle3 else ''}, found {None if fc is None else tuple(fc.shape)}")

    take = _taker(weights, f"the {kind} head in {folder}")
    state = {name: take(name) for name in ("fc.weight", "fc.bias") if name in weights}
    state.update(_decoder_layer(take, layer, "layer.", EAGLE3_LAYER_NAMES if eagle3 else EAGLE_LAYER_NAMES,
                                args.qkv_bias))
    if eagle3:
        draft_vocab = int(config.get("draft_vocab_size", args.vocab_size))
        state["vocab"] = eagle3_vocab(weights.pop("d2t", None), weights.pop("t2d", None), draft_vocab, args.vocab_size)
        state.update({name: take(name) for name in ("norm.weight", "lm_head.weight")})
    with torch.device("meta"):  # EAGLE-3's config does not name the target layers it fuses: load_draft derives them
        draft = (Eagle3Draft(args, draft_vocab, layer_ids=None) if eagle3
                 else EagleDraft(args, fc_bias="fc.bias" in state))
    _refuse_leftovers(weights, f"the {kind} head in {folder} has tensors an {kind} draft has no place for")
    try:
        draft.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"the {kind} head in {folder} does not match its config.json: {e}") from None
    return save_draft(draft, folder, _torch_dtype(dtype, config.get("dtype") or config.get("torch_dtype")))


def eagle3_vocab(d2t, t2d, draft_vocab_size: int, vocab_size: int) -> torch.Tensor:
    """The draft tokens' target ids, ascending, from d2t checked against t2d; without both, all ids."""
    if d2t is None and t2d is None:
        if draft_vocab_size != vocab_size:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} < vocab_size {vocab_size} needs the d2t and t2d maps")
        return torch.arange(vocab_size)
    if d2t is None or t2d is None:
        raise ValueError("an EAGLE-3 head needs both d2t and t2d, or neither")
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise ValueError(f"d2t {tuple(d2t.shape)} and t2d {tuple(t2d.shape)} should be [{draft_vocab_size}] and "
                         f"[{vocab_size}] (draft_vocab_size, vocab_size)")
    vocab = torch.arange(draft_vocab_size) + d2t.long()
    if not torch.equal(vocab, t2d.bool().nonzero().flatten()):
        raise ValueError("d2t and t2d disagree: the target ids i + d2t[i] must be exactly t2d's set ones, ascending")
    return vocab


def _refuse_to_overwrite(paths, force: bool):
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)}: pass --force (force=True) to replace")


def _torch_dtype(dtype: str, auto):
    """The dtype to save in: dtype, or for "auto" the config's `auto` (None: tensors keep their own)."""
    name = auto if dtype == "auto" else dtype
    if name is not None and name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES.get(name)


def _write_checkpoint(folder: Path, args: ModelArgs, state_dict: dict, dtype, tokenizer, source: dict) -> Path:
    """model_config.json, then model.pth last and atomically: scripts take its presence to mean the
    conversion finished. Cast in place, one tensor at a time, so that a large checkpoint is not held twice."""
    if dtype is not None:
        for name, tensor in state_dict.items():
            state_dict[name] = tensor.to(dtype)
    source["dtype"] = str(next(iter(state_dict.values())).dtype).removeprefix("torch.")
    config = {"model": args.to_dict(), "tokenizer": tokenizer, "source": source}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    out, partial = folder / "model.pth", folder / "model.pth.partial"
    torch.save(state_dict, partial)
    partial.replace(out)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_dir", type=Path,
                        help="Hugging Face folder to convert in place, or where a GGUF file's conversion goes")
    parser.add_argument("--gguf", type=Path, help="convert this GGUF file")
    parser.add_argument("--eagle_dir", type=Path,
                        help="convert this folder's EAGLE-1/2 or EAGLE-3 head in place, for --draft_checkpoint_path")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto: the config's dtype for Hugging Face folders, float32 for GGUF")
    parser.add_argument("--force", action="store_true", help="overwrite existing output files")
    args = parser.parse_args(argv)
    if (args.eagle_dir is None) == (args.checkpoint_dir is None):
        parser.error("give --checkpoint_dir (with --gguf for a GGUF file), or --eagle_dir for an EAGLE head")
    try:
        if args.eagle_dir is not None:
            out = convert_eagle(args.eagle_dir, args.dtype, args.force)
            print(f"wrote {out / 'draft.safetensors'} and {out / 'draft_config.json'}")
            return
        if args.gguf is not None:
            out = convert_gguf(args.gguf, args.checkpoint_dir, args.dtype, args.force)
        else:
            out = convert_hf(args.checkpoint_dir, args.dtype, args.force)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out} and {out.parent / CONFIG_FILE}")


if __name__ == "__main__":
    main()
