"""Reading and writing weights: the one place every caller loads a target or a draft from.

    load_model(path, device, dtype)          model.pth, model_int8.pth, model_int4.gNN.pth
    load_draft(path, target_config, ...)     an EAGLE draft folder or one of its weight files
    save_draft(draft, folder)                draft_config.json + draft.safetensors

As in gpt-fast, the loader alone adapts a model to its file and device: quantized layers where the
file holds them, this rank's shard (tp.py), the device's attention kernel. A file that is missing,
cut short or not what its name says gives a one-line error naming it, never a traceback.
"""
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import quantize
import tp
from attention import use_attention
from draft import Eagle3Draft, EagleDraft, eagle3_layer_ids
from model import ModelArgs, Transformer

DRAFT_CONFIG = "draft_config.json"
DRAFT_WEIGHTS = "draft.safetensors"


def read_state_dict(path) -> dict:
    """The tensors of a .pth (memory-mapped) or .safetensors file, or a clear ValueError."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state_dict = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except (RuntimeError, SafetensorError, OSError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read {path}: the file is cut short or not a weights file "
                         f"({first}); convert or download it again") from None
    if not isinstance(state_dict, dict):
        raise ValueError(f"{path} holds a {type(state_dict).__name__}, not a state dict of tensors")
    return state_dict


def load_model(checkpoint_path, device, dtype, shard: Optional[tp.Shard] = None, attention: str = "auto") -> Transformer:
    """A float or quantized target file, its config from model_config.json beside it or the folder's
    name. dtype None keeps the file's dtype; shard: this rank's part only (every rank reads the file)."""
    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise FileNotFoundError(
            f"checkpoint not found: {checkpoint_path}\n"
            f"  prepare one with: bash scripts/prepare.sh SmolLM2-135M-Instruct   (or a Hugging Face repo id)")
    try:
        config = ModelArgs.from_checkpoint(checkpoint_path)
    except (TypeError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{checkpoint_path.parent / 'model_config.json'} is not a model config: {e}") from None
    with torch.device("meta"):
        model = Transformer(config)
    state_dict = read_state_dict(checkpoint_path)
    if shard is not None:  # slices of the memory-mapped file, and layers of this rank's shapes
        state_dict = tp.shard_state_dict(state_dict, config, shard)
        tp.shard_model(model, shard)
    quantize.prepare_for_loading(model, state_dict, checkpoint_path)  # int8/int4 layers, when the file has them
    tied = config.tie_embeddings and "output.weight" not in state_dict  # a quantized head is its own copy
    if tied and "tok_embeddings.weight" in state_dict:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    try:
        model.load_state_dict(state_dict, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{checkpoint_path} does not fit its config {config}:\n{e}") from None
    if tied:  # assign=True replaced the shared Parameter by two; share it again
        model.output.weight = model.tok_embeddings.weight
    model = quantize.pack_int4(model.to(device=device, dtype=dtype).eval())
    use_attention(model, attention)
    return model


# Drafts: a folder with draft_config.json (the layer's ModelArgs, "arch": "eagle" or "eagle3", ...)
# and draft.safetensors (or a quantized draft_int8 / draft_int4.gNN file).
def save_draft(draft, folder, dtype: Optional[torch.dtype] = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).contiguous()
             for k, v in draft.state_dict().items()}
    save_file(state, str(folder / DRAFT_WEIGHTS))
    # draft_config.json: enough to rebuild the module before loading its weights
    if isinstance(draft, Eagle3Draft):
        meta = {"arch": "eagle3", "model": draft.config.to_dict(), "draft_vocab_size": draft.draft_vocab_size,
                "layer_ids": None if draft.layer_ids is None else list(draft.layer_ids)}
    else:
        meta = {"arch": "eagle", "model": draft.config.to_dict(), "fc_bias": draft.fc_bias}
    (folder / DRAFT_CONFIG).write_text(json.dumps(meta, indent=1))
    return folder


def draft_files(path):
    """(folder, config file, weights file) of a draft folder or of one weights file in it."""
    path = Path(path)
    folder, weights = (path, path / DRAFT_WEIGHTS) if path.is_dir() else (path.parent, path)
    if not (folder / DRAFT_CONFIG).is_file() or not weights.is_file():
        raise FileNotFoundError(f"no EAGLE draft at {path}: expected {DRAFT_CONFIG} and {weights.name} in {folder}")
    return folder, folder / DRAFT_CONFIG, weights


def load_draft(path, target_config: Optional[ModelArgs] = None, device="cpu", dtype=torch.float32,
               attention: str = "auto", arch: Optional[str] = None):
    """An EagleDraft or Eagle3Draft from a draft folder or one (float or quantized) weights file in it,
    checked against the target's config (None: no check, as when quantizing a draft alone) and,
    where given, the arch the caller runs ("eagle": EAGLE-1/2, or "eagle3")."""
    folder, config_file, weights = draft_files(path)
    try:
        meta = json.loads(config_file.read_text())
        config = ModelArgs(**meta["model"])
    except (TypeError, KeyError, ValueError) as e:  # ValueError: not JSON, or a field ModelArgs refuses
        raise ValueError(f"{config_file} is not a draft config: {e}") from None
    found = meta.get("arch", "eagle")
    if arch is not None and found != arch and found in ("eagle", "eagle3"):  # an unknown arch is refused below
        raise ValueError(f"{path} holds {'an EAGLE-3' if found == 'eagle3' else 'an EAGLE-1/2'} head: use "
                         f"--speculate {'eagle3' if found == 'eagle3' else 'eagle2 (or eagle)'}, or pass the right head")
    arch = found
    if target_config is not None:
        check_draft_fits(folder, arch, config, meta, target_config)
    with torch.device("meta"):
        if arch == "eagle3":
            # A converted published head names no target: it fuses layers (2, L//2, L-3) of the one it runs with.
            layer_ids = meta.get("layer_ids") or (eagle3_layer_ids(target_config.n_layer) if target_config else None)
            draft = Eagle3Draft(config, meta["draft_vocab_size"], layer_ids)
        elif arch == "eagle":
            draft = EagleDraft(config, fc_bias=meta["fc_bias"])
        else:
            raise ValueError(f"{config_file}: unknown draft arch {arch!r} (eagle or eagle3)")
    state_dict = read_state_dict(weights)
    quantize.prepare_for_loading(draft, state_dict, weights)  # int8/int4 layers, when the file has them
    try:
        draft.load_state_dict(state_dict, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{weights} does not match {config_file}: {e}") from None
    draft = quantize.pack_int4(draft.to(device=device, dtype=dtype).eval())  # (.to leaves the long vocab map alone)
    use_attention(draft, attention)
    return draft


def check_draft_fits(folder, arch: str, config: ModelArgs, meta: dict, target: ModelArgs):
    """A clear error when a head was made for another target."""
    if config.dim != target.dim:
        raise ValueError(f"draft {folder} has hidden size {config.dim}, the target has {target.dim}")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"draft {folder} was made for a vocabulary of {config.vocab_size} tokens, "
                         f"the target has {target.vocab_size}")
    expected = list(eagle3_layer_ids(target.n_layer))
    if arch == "eagle3" and meta.get("layer_ids") not in (None, expected):
        raise ValueError(f"draft {folder} fuses target layers {meta['layer_ids']}, but a target of {target.n_layer} "
                         f"layers has {expected}: it was made for another model")
