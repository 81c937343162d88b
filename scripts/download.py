"""Download a Hugging Face hub model (config, weights, tokenizer) for convert_hf_checkpoint.py.

    python scripts/download.py --repo_id meta-llama/Llama-2-7b-chat-hf [--hf_token TOKEN]

Needs network access to the hub and `pip install huggingface_hub`; gated repos (LLaMA, ...)
also need an access token (--hf_token or the HF_TOKEN environment variable) from an account
that has accepted the model's license. Re-running resumes and skips files already there.
"""
import argparse
import os
import sys
from pathlib import Path

# What the converter reads. Weights come as *.safetensors, or *.bin for older repos.
CONFIG_PATTERNS = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt"]
# Duplicate copies of the weights some repos carry in another layout (Meta's "original/",
# Mistral's "consolidated.safetensors"): never needed here, often as large as the model.
IGNORE_PATTERNS = ["original/*", "consolidated*", "*.pth", "*.onnx*", "*.gguf", "*.h5", "*.msgpack"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo_id", required=True, help="hub repo id, e.g. meta-llama/Llama-2-7b-chat-hf")
    parser.add_argument("--checkpoint_dir", type=Path, help="default: checkpoints/REPO_ID")
    parser.add_argument("--hf_token", help="access token for gated repos (default: $HF_TOKEN)")
    args = parser.parse_args()
    checkpoint_dir = args.checkpoint_dir or Path("checkpoints") / args.repo_id
    token = args.hf_token or os.environ.get("HF_TOKEN") or None
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError:
        sys.exit("error: huggingface_hub is not installed: pip install huggingface_hub")

    try:
        # Prefer safetensors; fall back to PyTorch *.bin files only when the repo has none.
        files = HfApi().list_repo_files(args.repo_id, token=token)
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
        snapshot_download(args.repo_id, local_dir=checkpoint_dir, allow_patterns=CONFIG_PATTERNS + weights,
                          ignore_patterns=IGNORE_PATTERNS, token=token)
    except Exception as e:  # the hub's error classes moved between versions: match by name
        print(f"error: downloading {args.repo_id} failed: {type(e).__name__}: {e}", file=sys.stderr)
        hint = "check the network connection and the repo id, then rerun (downloads resume)."
        if {"GatedRepoError", "RepositoryNotFoundError"} & {cls.__name__ for cls in type(e).__mro__}:
            hint = ("the repo is gated or private (or the id is misspelled). Accept the model's license on its hub "
                    "page, create an access token in your account settings, and pass it with --hf_token TOKEN or the "
                    "HF_TOKEN environment variable.")
        sys.exit(f"hint: {hint}")
    print(f"downloaded {args.repo_id} into {checkpoint_dir}/")


if __name__ == "__main__":
    main()
