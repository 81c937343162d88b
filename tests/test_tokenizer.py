"""tokenizer.py: every backend round-trips text and agrees with its reference implementation
(transformers, sentencepiece, the GGUF file's own jinja chat template)."""
import json
import shutil

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from tokenizer import CHAT_TEMPLATES, VICUNA_SYSTEM, Tokenizer, chat_template_from_hf, gguf_tokenizer, load_tokenizer

TEXTS = [
    "Hello world!",
    " a leading space, and  two  inner ones",
    "  two leading spaces",
    "line one\nline two\n\n\tindented with a tab\n",
    "Digits: 0 7 42 1234567 3.14159 and 2024-05-17",
    "Unicode: naïve café, Zürich, 日本語, Ω≈ç√, emoji 🙂🚀",
    "def f(x):\n    return x ** 2  # squares\n",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2 + 2?"},
]


def sentencepiece_folder(model_path, tmp_path, name):
    """A gpt-fast style folder: tokenizer.model and nothing else; `name` is the folder's name."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(model_path, folder / "tokenizer.model")
    return folder


def gguf_metadata_from_sentencepiece(model_path) -> dict:
    """The tokenizer metadata llama.cpp's converter writes for a SentencePiece (LLaMA-2) model."""
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    n = sp.get_piece_size()

    def token_type(i):
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1

    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id()}


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json folders (the tiny checkpoints)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_hf_backend_matches_transformers(tiny_hf_checkpoint, arch):
    folder = tiny_hf_checkpoint(arch)
    tok, reference = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference(text)["input_ids"]  # BOS included where the model adds one
        assert tok.decode(ids) == text
        assert tok.encode(text, bos=False) == reference(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_chat_templates_match_transformers(tiny_hf_checkpoint, arch):
    """Ids built from pieces equal those of the model's own jinja template, rendered and encoded."""
    folder = tiny_hf_checkpoint(arch)
    tok, reference = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    with_system = arch != "mistral"  # Mistral's template has no system role
    conversations = [CONVERSATION if with_system else CONVERSATION[1:], CONVERSATION[1:2], CONVERSATION[1:3]]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            expected = reference(text, add_special_tokens=False)["input_ids"]
            assert tok.apply_chat_template(messages, add_generation_prompt) == expected, text


def test_metadata_guessed_from_hf_folders(tiny_hf_checkpoint):
    llama, mistral, qwen2 = (load_tokenizer(tiny_hf_checkpoint(arch)) for arch in ("llama", "mistral", "qwen2"))
    # LLaMA-3: BOS from the post-processor; both <|end_of_text|> (1) and <|eot_id|> (4) stop.
    assert (llama.chat_template, llama.bos_id, llama.add_bos, llama.stop_ids) == ("llama-3", 0, True, [1, 4])
    assert (mistral.chat_template, mistral.bos_id, mistral.add_bos, mistral.stop_ids) == ("mistral", 1, True, [2])
    assert (qwen2.chat_template, qwen2.system_prompt) == ("chatml", "You are a tiny test model.")
    assert (qwen2.bos_id, qwen2.add_bos, qwen2.stop_ids) == (None, False, [0, 2])
    assert qwen2.vocab_size == 512


# ---------------------------------------------------------------------------------------------
# sentencepiece tokenizer.model (LLaMA-2, Vicuna)
# ---------------------------------------------------------------------------------------------
def test_sentencepiece_backend(tiny_sentencepiece_model, tmp_path):
    tok = load_tokenizer(sentencepiece_folder(tiny_sentencepiece_model, tmp_path, "Llama-2-tiny-chat"))
    sp = spm.SentencePieceProcessor(model_file=str(tiny_sentencepiece_model))
    assert (tok.bos_id, tok.add_bos, tok.stop_ids, tok.chat_template) == (1, True, [2], "llama-2")
    for text in TEXTS:
        assert tok.encode(text) == [1] + sp.encode(text)
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, bos=False)) == text


def test_llama2_template_is_metas_reference(tiny_sentencepiece_model, tmp_path):
    tok = load_tokenizer(sentencepiece_folder(tiny_sentencepiece_model, tmp_path, "llama-2-tiny"))
    sp = spm.SentencePieceProcessor(model_file=str(tiny_sentencepiece_model))
    # llama/generation.py: each turn is encode("[INST] user [/INST] answer ", bos=True, eos=True).
    expected = ([1] + sp.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello! How can I help? ") + [2]
                + [1] + sp.encode("[INST] What is 2 + 2? [/INST]"))
    assert tok.apply_chat_template(CONVERSATION) == expected


def test_vicuna_template_is_fastchats(tiny_sentencepiece_model, tmp_path):
    tok = load_tokenizer(sentencepiece_folder(tiny_sentencepiece_model, tmp_path, "vicuna-tiny-v1.3"))
    sp = spm.SentencePieceProcessor(model_file=str(tiny_sentencepiece_model))
    assert tok.chat_template == "vicuna"
    # FastChat vicuna_v1.1: "SYSTEM USER: u ASSISTANT: a</s>USER: u ASSISTANT:"
    expected = ([1] + sp.encode(f"{VICUNA_SYSTEM} USER: Hi there ASSISTANT: Hello! How can I help?") + [2]
                + sp.encode("USER: What is 2 + 2? ASSISTANT:"))
    assert tok.apply_chat_template(CONVERSATION[1:]) == expected


def test_gguf_sentencepiece_vocab_rebuilds_an_equivalent_bpe(tiny_sentencepiece_model, tmp_path):
    """GGUF "llama" vocabularies (pieces + scores) become a BPE with byte fallback whose merges
    come from the scores; it must tokenize exactly as sentencepiece does."""
    metadata = gguf_metadata_from_sentencepiece(tiny_sentencepiece_model)
    tokenizer_json, meta = gguf_tokenizer(metadata)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    assert meta == {"file": "tokenizer.json", "chat_template": "llama-2", "system_prompt": None,
                    "bos_id": 1, "add_bos": True, "stop_ids": [2]}
    tok = Tokenizer(tmp_path / "tokenizer.json", **{k: v for k, v in meta.items() if k != "file"})
    sp = spm.SentencePieceProcessor(model_file=str(tiny_sentencepiece_model))
    for text in TEXTS + ["Speculative decoding keeps the output distribution exactly the same."]:
        assert tok.encode(text) == [1] + sp.encode(text), text
        assert tok.decode(tok.encode(text)) == text


def test_gguf_unsupported_tokenizers():
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model.*'bert'"):
        gguf_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    gpt2 = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "tekken"}
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer.*'tekken'.*smollm"):
        gguf_tokenizer(gpt2)


# ---------------------------------------------------------------------------------------------
# Metadata, templates and errors
# ---------------------------------------------------------------------------------------------
def test_chat_template_from_hf():
    smollm = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
              "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
              "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
    assert chat_template_from_hf(smollm) == ("chatml", "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    qwen = "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    assert chat_template_from_hf({"chat_template": qwen}) == (
        "chatml", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    no_default = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    assert chat_template_from_hf(no_default) == ("chatml", None)
    assert chat_template_from_hf("{{ '<|start_header_id|>' + message['role'] }}") == ("llama-3", None)
    assert chat_template_from_hf("{{ bos_token + '[INST] <<SYS>>\\n' + system }}") == ("llama-2", None)
    assert chat_template_from_hf("{{ '[INST] ' + message['content'] + ' [/INST]' }}") == ("mistral", None)
    assert chat_template_from_hf("{{ 'USER: ' + content + ' ASSISTANT:' }}") == ("vicuna", None)
    assert chat_template_from_hf([{"name": "default", "template": qwen}])[0] == "chatml"
    assert chat_template_from_hf({"chat_template": None}) == (None, None)
    assert chat_template_from_hf("{{ message['content'] }}") == (None, None)


def test_template_errors(tiny_sentencepiece_model, tmp_path):
    folder = sentencepiece_folder(tiny_sentencepiece_model, tmp_path, "llama-2-tiny")
    tok = load_tokenizer(folder)
    with pytest.raises(ValueError, match="alternating user/assistant"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    tok.chat_template = "alpaca"
    with pytest.raises(ValueError, match="unknown chat template 'alpaca'; known: " + ", ".join(CHAT_TEMPLATES)):
        tok.apply_chat_template(CONVERSATION)
    tok.chat_template = "chatml"
    with pytest.raises(ValueError, match="needs the token '<\\|im_start\\|>'"):
        tok.apply_chat_template(CONVERSATION)


def test_model_config_wins_over_guessing(tiny_sentencepiece_model, tmp_path):
    folder = sentencepiece_folder(tiny_sentencepiece_model, tmp_path, "llama-2-tiny")
    meta = {"file": "tokenizer.model", "chat_template": "vicuna", "system_prompt": "Be nice.",
            "bos_id": 1, "add_bos": False, "stop_ids": [2, 5]}
    (folder / "model_config.json").write_text(json.dumps({"model": {}, "tokenizer": meta}))
    (folder / "model.pth").touch()
    tok = load_tokenizer(folder / "model.pth")  # the checkpoint's path works too
    assert (tok.chat_template, tok.system_prompt, tok.add_bos, tok.stop_ids) == ("vicuna", "Be nice.", False, [2, 5])
    assert tok.encode("hi")[0] != 1


def test_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct GGUF: tokenizer.json rebuilt from its metadata
# ---------------------------------------------------------------------------------------------
def test_smollm2_gguf_tokenizer(smollm2_checkpoint):
    tok = load_tokenizer(smollm2_checkpoint)
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert 2 in tok.stop_ids and (tok.bos_id, tok.add_bos) == (1, False)
    assert tok.vocab_size == 49152
    digits = tok.encode("1234567890")
    assert len(digits) == 10 and tok.decode(digits[3:4]) == "4"
    assert tok.encode("Hello world!") == [19556, 905, 17]  # as transformers' own GGUF tokenizer loader gives
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.decode(tok.encode(text)) == text


def test_smollm2_chat_template_matches_its_jinja(smollm2_gguf, smollm2_checkpoint):
    import gguf
    import jinja2

    field = gguf.GGUFReader(smollm2_gguf).fields["tokenizer.chat_template"]
    # Hugging Face renders chat templates with these options.
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(field.contents())
    tok = load_tokenizer(smollm2_checkpoint)
    for messages in [CONVERSATION, CONVERSATION[1:], CONVERSATION[1:3]]:
        for add_generation_prompt in (True, False):
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
            ids = tok.apply_chat_template(messages, add_generation_prompt)
            assert tok.decode(ids) == text
            assert ids == tok.encode(text)
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(tok.apply_chat_template(CONVERSATION[1:2]))
