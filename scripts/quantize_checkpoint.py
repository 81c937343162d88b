"""Quantize a target or an EAGLE draft to weight-only int8 or int4 (quantize.py has the layers).

    python scripts/quantize_checkpoint.py --checkpoint_path checkpoints/NAME/model.pth --mode int8
    python scripts/quantize_checkpoint.py --checkpoint_path checkpoints/NAME/model.pth --mode int4 --groupsize 32
    python scripts/quantize_checkpoint.py --draft --checkpoint_path checkpoints/NAME/eagle --mode int8

write model_int8.pth / model_int4.g32.pth beside model.pth (gpt-fast naming), or draft_int8.safetensors /
draft_int4.g32.safetensors beside the draft; generate.py reads the mode from the file name:

    python generate.py --checkpoint_path checkpoints/NAME/model_int8.pth --speculate eagle2 \\
        --draft_checkpoint_path checkpoints/NAME/eagle/draft_int8.safetensors
"""
import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import quantize  # noqa: E402
from checkpoint import DRAFT_WEIGHTS, draft_files, load_draft, load_model  # noqa: E402


def quantize_checkpoint(path, mode: str, groupsize: int = 32, force: bool = False, draft: bool = False) -> Path:
    """model.pth -> model_int8.pth / model_int4.gNN.pth beside it; with draft, an EAGLE draft folder (or its
    draft.safetensors) -> draft_int8.safetensors / draft_int4.gNN.safetensors in the same folder. Returns the
    new path; refuses a quantized source, and an existing copy without force."""
    source = draft_files(path)[2] if draft else Path(path)
    if quantize.mode_from_path(source)[0] is not None:
        float_name = DRAFT_WEIGHTS if draft else "model.pth"
        raise ValueError(f"{source.name} is already quantized: quantize the float {float_name}")
    out = quantize.quantized_path(source, mode, groupsize)
    if out.exists() and not force:
        raise FileExistsError(f"refusing to overwrite {out}: pass --force to replace it")
    # a draft has no target at hand to check it against; dtype None: the float parts keep the file's dtype
    model = load_draft(source) if draft else load_model(source, "cpu", dtype=None)
    for line in quantize.quantize_model(model, mode, groupsize):
        print(line)
    if draft:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out))
    else:
        if model.config.tie_embeddings:
            print("  tied LM head: quantized as its own copy; tok_embeddings.weight stays in float")
        torch.save(model.state_dict(), out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; {source.name}: {source.stat().st_size / 1e6:.1f} MB)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct/model.pth"),
                   help="model.pth; with --draft, an EAGLE draft folder or its draft.safetensors")
    p.add_argument("--mode", choices=["int8", "int4"], required=True)
    p.add_argument("--groupsize", type=int, help="int4: input columns per scale/zero, one of "
                   f"{', '.join(map(str, quantize.GROUPSIZES))} (default 32)")
    p.add_argument("--draft", action="store_true", help="quantize an EAGLE draft instead of a target model")
    p.add_argument("--force", action="store_true", help="overwrite an existing quantized file")
    args = p.parse_args(argv)
    if args.groupsize is not None and args.mode != "int4":
        p.error("--groupsize applies to --mode int4 only")
    groupsize = 32 if args.groupsize is None else args.groupsize
    try:
        if args.mode == "int4":
            quantize.check_groupsize(groupsize)
        return quantize_checkpoint(args.checkpoint_path, args.mode, groupsize, args.force, args.draft)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
