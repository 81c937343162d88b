"""Tokenizers and chat templates for the models model.py runs.

`Tokenizer` wraps sentencepiece (tokenizer.model: LLaMA-2, Vicuna) or Hugging Face `tokenizers`
(tokenizer.json: LLaMA-3, SmolLM2, Qwen2, Mistral); `gguf_tokenizer` rebuilds a tokenizer.json
from a GGUF file's metadata. BOS, stop tokens and the chat template come from the "tokenizer" section
of model_config.json, or `guess_tokenizer_meta` works them out from the folder.

Chat templates return pieces: ints are token ids, strings are text encoded without BOS. Building ids
from pieces rather than one rendered string lets sentencepiece, which does not parse "<s>" in text,
give the same ids as Hugging Face's tokenizers.
"""
import json
import re
from itertools import groupby, zip_longest
from pathlib import Path
from typing import Optional, Union

import sentencepiece
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

CONFIG_FILE = "model_config.json"  # model.py's CONFIG_FILE; not imported, to keep this file torch-free

# Tokens that end a turn or a document in any supported vocabulary; stop ids add the declared EOS.
END_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>")


class Tokenizer:
    def __init__(self, path, bos_id: Optional[int] = None, add_bos: bool = False, stop_ids=(),
                 chat_template: Optional[str] = None, system_prompt: Optional[str] = None):
        """path: tokenizer.model or tokenizer.json; the rest is model_config.json's "tokenizer" section."""
        self.sp = self.hf = None
        if Path(path).suffix == ".model":
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
            self.vocab_size = self.sp.get_piece_size()
        else:
            self.hf = tokenizers.Tokenizer.from_file(str(path))
            self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.add_bos, self.stop_ids = bos_id, add_bos, list(stop_ids)
        self.chat_template, self.system_prompt = chat_template, system_prompt

    def encode(self, text: str, bos: Optional[bool] = None) -> list:
        """bos=None: add BOS if the model does by default (LLaMA-2 does, SmolLM2 does not)."""
        # Hugging Face's post-processor (which may add BOS) is skipped: BOS is ours to add, once.
        ids = self.sp.encode(text) if self.sp is not None else self.hf.encode(text, add_special_tokens=False).ids
        add = self.add_bos if bos is None else bos
        return [self.bos_id] + ids if add and self.bos_id is not None else ids

    def decode(self, ids) -> str:
        """Shows special tokens (sentencepiece's <s>, </s> excepted), but not a BOS encode added."""
        ids = list(ids)
        if self.add_bos and ids[:1] == [self.bos_id]:
            ids = ids[1:]
        return self.sp.decode(ids) if self.sp is not None else self.hf.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> Optional[int]:
        """The id of a token spelled exactly so in the vocabulary, else None."""
        if self.sp is not None:
            i = self.sp.piece_to_id(token)  # the unknown id for a token it lacks
            return i if self.sp.id_to_piece(i) == token else None
        return self.hf.token_to_id(token)

    def special_id(self, token: str) -> int:
        i = self.token_id(token)
        if i is None:
            raise ValueError(f"chat template {self.chat_template!r} needs the token {token!r}, "
                             f"which this vocabulary lacks: wrong template for this model?")
        return i

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> list:
        """[{"role": ..., "content": ...}, ...] -> token ids, ending with the assistant's header."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (see the \"tokenizer\" section of "
                             f"{CONFIG_FILE}); known templates: {', '.join(CHAT_TEMPLATES)}")
        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"unknown chat template {self.chat_template!r}; known: {', '.join(CHAT_TEMPLATES)}")
        if self.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            messages = [{"role": "system", "content": self.system_prompt}] + list(messages)
        pieces = CHAT_TEMPLATES[self.chat_template](self, messages, add_generation_prompt)
        ids = []
        for is_text, group in groupby(pieces, key=lambda piece: isinstance(piece, str)):
            # adjacent text is encoded together, as a rendered template would be
            ids += self.encode("".join(group), bos=False) if is_text else list(group)
        return ids


# Chat templates: (tokenizer, messages, add_generation_prompt) -> pieces (int = id, str = text).
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")


def _turns(messages):
    """(system or None, [(user, answer or None), ...]); roles must alternate, starting with the user."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    roles = [m["role"] for m in messages]
    if roles != ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2):
        raise ValueError(f"this chat template needs alternating user/assistant messages, got {roles}")
    contents = [m["content"] for m in messages]
    return system, list(zip_longest(contents[::2], contents[1::2]))


def llama2_template(tok, messages, add_generation_prompt):
    # Meta's reference: each turn is "<s>[INST] user [/INST] answer </s>"; system joins the first user turn.
    system, pairs = _turns(messages)
    bos, eos = tok.special_id("<s>"), tok.special_id("</s>")
    pieces = []
    for i, (user, answer) in enumerate(pairs):
        if i == 0 and system is not None:
            user = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}"
        pieces += [bos, f"[INST] {user.strip()} [/INST]"]
        if answer is not None:
            pieces += [f" {answer.strip()} ", eos]
    return pieces


def mistral_template(tok, messages, add_generation_prompt):
    # Mistral-Instruct: <s>[INST] user [/INST]answer</s>[INST] ... (no system role: prepended).
    system, pairs = _turns(messages)
    pieces = [tok.special_id("<s>")]
    for i, (user, answer) in enumerate(pairs):
        if i == 0 and system is not None:
            user = f"{system}\n\n{user}"
        pieces.append(f"[INST] {user} [/INST]")
        if answer is not None:
            pieces += [answer, tok.special_id("</s>")]
    return pieces


def vicuna_template(tok, messages, add_generation_prompt):
    # FastChat's vicuna_v1.1: "SYSTEM USER: u ASSISTANT: a</s>USER: u2 ASSISTANT:".
    system, pairs = _turns(messages)
    pieces = [tok.special_id("<s>"), (VICUNA_SYSTEM if system is None else system) + " "]
    for user, answer in pairs:
        pieces.append(f"USER: {user} ")
        if answer is not None:
            pieces += [f"ASSISTANT: {answer}", tok.special_id("</s>")]
        elif add_generation_prompt:
            pieces.append("ASSISTANT:")
    return pieces


def llama3_template(tok, messages, add_generation_prompt):
    start, end, eot = (tok.special_id(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    pieces = [tok.special_id("<|begin_of_text|>")]
    for m in messages:
        pieces += [start, m["role"], end, "\n\n" + m["content"].strip(), eot]
    if add_generation_prompt:
        pieces += [start, "assistant", end, "\n\n"]
    return pieces


def chatml_template(tok, messages, add_generation_prompt):
    start, end = tok.special_id("<|im_start|>"), tok.special_id("<|im_end|>")
    pieces = []
    for m in messages:
        pieces += [start, f"{m['role']}\n{m['content']}", end, "\n"]
    if add_generation_prompt:
        pieces += [start, "assistant\n"]
    return pieces


CHAT_TEMPLATES = {"llama-2": llama2_template, "mistral": mistral_template, "vicuna": vicuna_template,
                  "llama-3": llama3_template, "chatml": chatml_template}


# What a jinja chat template holds, by the name of ours it is; the first that matches wins.
JINJA_MARKERS = {"chatml": ("<|im_start|>",), "llama-3": ("<|start_header_id|>",), "llama-2": ("<<SYS>>",),
                 "mistral": ("[INST]",), "vicuna": ("USER:", "ASSISTANT:")}


def chat_template_from_hf(template: Union[dict, str, None]):
    """(name, default system prompt), each or None, from a jinja template or tokenizer_config.json."""
    if isinstance(template, dict):
        template = template.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        return None, None
    name = next((name for name, markers in JINJA_MARKERS.items() if all(m in template for m in markers)), None)
    # ChatML's literal default system message (SmolLM2, Qwen2.5); its newline may be a jinja escape.
    m = re.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}+]+?)<\|im_end\|>", template)
    return name, m.group(1).replace("\\n", "\n") if m else None


def load_tokenizer(checkpoint_dir) -> Tokenizer:
    """The tokenizer of a converted checkpoint folder (or of the folder of a given model.pth)."""
    folder = Path(checkpoint_dir)
    folder = folder.parent if folder.is_file() else folder
    config_file = folder / CONFIG_FILE
    meta = dict(_read_json(config_file).get("tokenizer") or guess_tokenizer_meta(folder))
    path = folder / meta.pop("file")
    if not path.is_file():
        raise FileNotFoundError(f"{config_file} names {path.name}, which is not in {folder}")
    return Tokenizer(path, **meta)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _template_from_vocab(token_id, model_name: str) -> Optional[str]:
    """The chat template when no jinja template names it: from the special tokens, else the name."""
    if token_id("<|im_end|>") is not None:
        return "chatml"
    if token_id("<|eot_id|>") is not None:
        return "llama-3"
    if "vicuna" in model_name.lower():
        return "vicuna"
    return "llama-2" if token_id("</s>") is not None else None


def _tokenizer_meta(file: str, token_id, jinja, model_name: str, bos_id, add_bos, stop_ids) -> dict:
    """model_config.json's "tokenizer" section. token_id(token): its id, or None where the vocabulary lacks it."""
    chat_template, system_prompt = chat_template_from_hf(jinja)
    chat_template = chat_template or _template_from_vocab(token_id, model_name)
    stop_ids = {token_id(t) for t in END_TOKENS} | set(stop_ids)
    return {"file": file, "chat_template": chat_template, "system_prompt": system_prompt,
            "bos_id": bos_id, "add_bos": bool(add_bos) and bos_id is not None,
            "stop_ids": sorted(stop_ids - {None})}


def guess_tokenizer_meta(folder) -> dict:
    """model_config.json's "tokenizer" section for a folder; Hugging Face's tokenizer_config.json,
    chat_template.jinja and generation_config.json win where they say something."""
    folder = Path(folder)
    path = next((folder / name for name in ("tokenizer.model", "tokenizer.json") if (folder / name).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no tokenizer in {folder}: expected tokenizer.model (sentencepiece) "
                                f"or tokenizer.json (Hugging Face tokenizers)")
    tok = Tokenizer(path)
    hf_config = _read_json(folder / "tokenizer_config.json")

    def token_id(token):  # tokenizer_config.json spells a token as a string or {"content": ...}
        token = token.get("content") if isinstance(token, dict) else token
        return tok.token_id(token) if token else None

    jinja = hf_config.get("chat_template")
    if not jinja and (folder / "chat_template.jinja").is_file():  # where transformers 5 saves it
        jinja = (folder / "chat_template.jinja").read_text()

    if tok.sp is not None:  # sentencepiece LLaMAs always start with <s>
        adds_bos, default_bos = True, (tok.sp.bos_id() if tok.sp.bos_id() >= 0 else None)
    else:  # a tokenizer.json adds BOS in its post-processor, if at all: see whether it does
        with_post = tok.hf.encode("a").ids
        adds_bos = len(with_post) > len(tok.hf.encode("a", add_special_tokens=False).ids)
        default_bos = with_post[0] if adds_bos else None
    bos_id, add_bos = token_id(hf_config.get("bos_token")), hf_config.get("add_bos_token")
    bos_id = default_bos if bos_id is None else bos_id
    add_bos = adds_bos if add_bos is None else add_bos

    eos = _read_json(folder / "generation_config.json").get("eos_token_id")  # an id or a list
    stop_ids = [token_id(hf_config.get("eos_token"))] + (eos if isinstance(eos, list) else [eos])
    return _tokenizer_meta(path.name, tok.token_id, jinja, folder.resolve().name, bos_id, add_bos, stop_ids)


# GGUF: rebuild a tokenizer.json from the vocabulary in the file's metadata. llama.cpp's token types:
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes (what splits text into words before BPE), by tokenizer.ggml.pre.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")  # single digits
GGUF_PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "starcoder", "llama-bpe", "qwen2")


def _byte_level_pipeline(tokenizer, pre: str):
    """Normalizer and pre-tokenizer of a GPT-2 style byte-level BPE, as the model's own tokenizer.json."""
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                         f"supported: {', '.join(GGUF_PRE_TOKENIZERS)}")
    regex = {"llama-bpe": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}.get(pre)  # in place of GPT-2's
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)]
    if pre in ("smollm", "starcoder"):  # GPT-2's regex, digits one by one
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    elif regex is not None:
        steps.insert(0, pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()


def _merges_from_scores(tokens, scores, types):
    """BPE merges for a SentencePiece vocabulary, as Hugging Face's slow->fast conversion derives them:
    every split of a piece into two vocabulary pieces, higher scores first (scores are -merge order)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    merges = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def gguf_tokenizer(metadata: dict):
    """(tokenizer.json text, model_config.json's "tokenizer" section for it) equivalent to a GGUF file's
    metadata (keys like "tokenizer.ggml.tokens")."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        pre = metadata.get("tokenizer.ggml.pre", "default")
        tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre == "llama-bpe"))
        _byte_level_pipeline(tokenizer, pre)
        tokenizer.decoder = decoders.ByteLevel()
    elif kind == "llama":
        # SentencePiece BPE with byte fallback: spaces are "▁", unknown characters become <0xNN>.
        merges = _merges_from_scores(tokens, metadata["tokenizer.ggml.scores"], types)
        unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
        tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        normalize = [normalizers.Replace(" ", "▁")]
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if metadata.get("tokenizer.ggml.add_space_prefix", True):  # "hi" is encoded as "▁hi"
            normalize.insert(0, normalizers.Prepend("▁"))
            decode.append(decoders.Strip(" ", 1, 0))
        tokenizer.normalizer = normalizers.Sequence(normalize)
        tokenizer.decoder = decoders.Sequence(decode)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r}; supported: gpt2, llama")
    # Control tokens ("<|im_start|>", "<s>") match whole in text, like the model's own tokenizer.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)}
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    stop_ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    meta = _tokenizer_meta("tokenizer.json", special.get, metadata.get("tokenizer.chat_template"),
                           metadata.get("general.name") or "", metadata.get("tokenizer.ggml.bos_token_id"),
                           add_bos, stop_ids)
    return tokenizer.to_str(), meta


class TextStreamer:
    """Prints text as tokens arrive. Byte-level BPE can split one character over several tokens,
    so re-decode everything and print only the new, complete part."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def put(self, token: int):
        if token in self.tokenizer.stop_ids:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)
