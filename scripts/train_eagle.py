"""Train an EAGLE draft head for a target on data the target writes itself (docs/training.md).

    python scripts/train_eagle.py --arch eagle3 --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth \
        --preset smollm2-cpu --out_dir heads/my-eagle3 --data_dir data/SmolLM2-135M-Instruct --n_shards 16

Stages, each cached under --work_dir and resumed: data (Magpie: the target writes user messages, then
answers them), features (the target's teacher-forced forward, in --cache_dir), training (--resume: bit
for bit). A head reaches --out_dir only when its held-out accuracy beats the head there (--force) and
the one it starts from (--init_from). Every Preset field is a flag too (e.g. --unroll 3).
"""
import argparse
import copy
import json
import math
import os
import platform
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attention import use_attention  # noqa: E402
from checkpoint import load_draft, load_model, save_draft  # noqa: E402
from cpu import pack_linears  # noqa: E402
from draft import Eagle3Draft, EagleDraft, draft_config_for, eagle3_layer_ids  # noqa: E402
from model import KVCache, apply_rope  # noqa: E402
from sampling import cut_at_stop, sample_from  # noqa: E402
from speculative import Speculator, speculative_generate  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Preset:
    val_fraction: float = 0.05   # held out for validation
    prompt_max_tokens: int = 96
    prompt_temperature: float = 1.0
    prompt_top_k: int = 100      # user messages are sampled among the 100 most probable tokens
    answer_max_tokens: int = 320
    sampled_fraction: float = 0.25  # answers sampled at temperature 1 (the rest greedy)
    gen_batch: int = 128         # conversations per data shard, generated at once
    epochs: int = 6
    batch_tokens: int = 4096     # padded tokens per training batch
    lr: float = 1e-3
    warmup_steps: int = 200
    weight_decay: float = 0.0
    grad_clip: float = 0.5       # clip by value, as EAGLE does
    noise: float = 0.1           # uniform noise U(-noise, noise) on input features
    ce_weight: float = 0.1
    ce_topk: int = 64            # the target distribution's most probable tokens kept for the CE
    ce_fraction: float = 0.25    # share of positions that get the CE term in training (validation: all)
    unroll: int = 2              # training-time test depth (1 = plain EAGLE-1/2 training)
    unroll_decay: float = 0.8    # loss weight of unrolled step k: decay ** (k - 1)
    save_every: int = 50         # optimizer steps between saved training states
    eval_every: int = 0          # optimizer steps between validations (0: after each epoch only)
    n_shards: int = 40           # data shards of gen_batch conversations to write before training
    multi_turn_fraction: float = 0.4  # conversations with a follow-up turn
    keep_top: int = 64           # EAGLE-3: the target's most probable next tokens kept per position
    draft_vocab_size: int = 8192  # EAGLE-3: the draft's reduced vocabulary, the most frequent answer tokens
    tau_depth: int = 6           # tree depth of the tau measured at validation
    tau_max_tokens: int = 96     # tokens decoded per tau prompt


PRESETS = {"eagle": {
    "smollm2-cpu": Preset(),  # SmolLM2-135M on a CPU
    "gpu": Preset(n_shards=160, answer_max_tokens=768, gen_batch=256, epochs=10, batch_tokens=32768,
                  lr=3e-4, warmup_steps=500, unroll=3),
    "tiny": Preset(n_shards=3, prompt_max_tokens=12, answer_max_tokens=16, gen_batch=8, epochs=2,  # for tests
                   batch_tokens=256, lr=3e-3, warmup_steps=2, val_fraction=0.25),
}}
PRESETS["eagle3"] = {
    # SmolLM2-135M on a CPU, over several sessions: the shards are kept in git (data/), the state resumes
    "smollm2-cpu": Preset(prompt_max_tokens=128, answer_max_tokens=256, sampled_fraction=0.15, val_fraction=0.03,
                          epochs=4, unroll=5, lr=1e-3, warmup_steps=100, draft_vocab_size=8192, save_every=25,
                          eval_every=250, tau_max_tokens=128),
    "gpu": replace(PRESETS["eagle"]["gpu"], unroll=7, tau_depth=8, sampled_fraction=0.15, val_fraction=0.02),
    "tiny": replace(PRESETS["eagle"]["tiny"], unroll=3, keep_top=8, draft_vocab_size=256, tau_depth=4, save_every=2),
}


def replace_atomically(path: Path, save):
    """save(tmp) then rename: a run killed while writing leaves the previous file (or none), never half of one."""
    tmp = path.with_name("tmp." + path.name)
    save(tmp)
    os.replace(tmp, path)


# ---- The target, batched: rows right-padded, each row's positions and cache slots continuing from its
# own length (a pad slot is overwritten by the row's next token before the row attends to it).
def sample_rows(logits, temperature, top_k):
    """Next token of each row of logits [B, V]; temperature [B] (0: greedy) or one float. Only sampled
    rows pay for a softmax (over their top_k logits)."""
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(logits.size(0))
    tokens = logits.argmax(-1)
    hot = (temperature > 0).nonzero().flatten()
    if hot.numel():
        x = logits[hot].float() / temperature[hot, None]
        if top_k is not None and top_k < x.size(-1):
            values, ids = x.topk(top_k, dim=-1)
            tokens[hot] = ids.gather(-1, sample_from(torch.softmax(values, -1))[:, None])[:, 0]
        else:
            tokens[hot] = sample_from(torch.softmax(x, -1))
    return tokens


def keep_cache_rows(model, rows: torch.Tensor):
    """Shrink the target's KV cache to the batch rows `rows` (finished rows stop costing a step)."""
    model.kv_storage = model.kv_storage[:, :, rows]
    model.max_batch_size = len(rows)
    for layer, storage in zip(model.layers, model.kv_storage):
        layer.attention.kv_cache = KVCache(storage)


def setup_rows(model, batch: int, length: int):
    model.setup_caches(batch, length)
    if model.max_batch_size > batch:  # a bigger cache from an earlier call: use its first rows
        keep_cache_rows(model, torch.arange(batch, device=model.norm.weight.device))


@torch.no_grad()
def generate_batch(model, prompts, max_new_tokens, temperature, top_k, stop_ids, chunk=16):
    """Per prompt (a list of ids): prompt + answer ids, cut after the first stop token; temperature: one or
    one per row (0: greedy). Finished rows leave the batch once they are a quarter of it."""
    device = model.norm.weight.device
    B, lengths = len(prompts), torch.tensor([len(p) for p in prompts], device=device)
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(B).clone()
    L = int(lengths.max())
    setup_rows(model, B, L + max_new_tokens + 1)
    padded = torch.tensor([p + [0] * (L - len(p)) for p in prompts], device=device)
    last = torch.zeros(B, model.config.vocab_size, device=device)
    live = torch.arange(B, device=device)  # which prompt each batch row answers
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        logits = model(padded[:, c0:c1], torch.arange(c0, c1, device=device), kv_len=c1)
        inside = (lengths - 1 >= c0) & (lengths - 1 < c1)  # rows whose last prompt token is in this chunk
        last = torch.where(inside[:, None], logits[live, (lengths - 1 - c0).clamp(0, c1 - c0 - 1)], last)
    token = sample_rows(last, temps, top_k)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    answers = torch.full((B, max_new_tokens), -1, dtype=torch.long)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    pos = lengths.clone()
    for step in range(max_new_tokens):
        answers[live.cpu(), step] = token.cpu()
        done |= torch.isin(token, stop)
        if step == max_new_tokens - 1:
            break
        if step % 8 == 7 and int(done.sum()) * 4 >= len(done):
            if bool(done.all()):
                break
            keep = (~done).nonzero().flatten()
            keep_cache_rows(model, keep)
            live, token, pos, temps, done = live[keep], token[keep], pos[keep], temps[keep], done[keep]
        logits = model(token[:, None], pos[:, None], kv_len=L + step + 1)  # a finished row's extras are cut below
        token = sample_rows(logits[:, -1], temps, top_k)
        pos += 1
    return [list(prompt) + cut_at_stop([t for t in row if t >= 0], stop_ids)
            for prompt, row in zip(prompts, answers.tolist())]


@torch.no_grad()
def target_features(model, seqs, layer_ids=None, keep_top=0, max_tokens=8192):
    """Teacher-forced, per sequence: "features" float16 [n, F], the final hidden state (EAGLE-1/2) or the
    residual streams entering layer_ids (EAGLE-3); with keep_top, the target's top next tokens "top_ids"
    and "top_probs" [n, keep_top]."""
    device = model.norm.weight.device
    out = [None] * len(seqs)
    output = model.output
    if not keep_top:  # no logits needed: skip the LM head, a large part of the forward
        model.output = torch.nn.Identity()
    try:
        for group in make_batches_by_length([len(s) for s in seqs], max_tokens, False, None):
            n = max(len(seqs[i]) for i in group)
            setup_rows(model, len(group), n)
            ids = torch.tensor([list(seqs[i]) + [0] * (n - len(seqs[i])) for i in group], device=device)
            logits, final, layer_inputs = model(ids, torch.arange(n, device=device), return_features=True,
                                                layer_ids=layer_ids or (), kv_len=n)
            feats = final if layer_ids is None else torch.cat(layer_inputs, dim=-1)
            feats = feats.float().clamp(-65504, 65504)  # float16 storage: a rare outlier clamped, not inf
            for b, i in enumerate(group):
                m = len(seqs[i])
                row = {"features": feats[b, :m].half().cpu()}
                if keep_top:
                    top = torch.softmax(logits[b, :m].float(), dim=-1).topk(keep_top, dim=-1)
                    row.update(top_ids=top.indices.cpu(), top_probs=top.values.half().cpu())
                out[i] = row
    finally:
        model.output = output
    return out


# ---- Conversation shards, the data of every head: one or two turns, as token ids. A user
# message is Magpie-sampled after the opening words of a kind of request ("open": none); a follow-up
# after words that ask to rewrite, continue or critique the first answer.
OPENERS = {
    "writing": ["Write a short story about", "Write a poem about", "Write a blog post about", "Draft an email to",
                "Write a product description for", "Write a speech for", "Compose a letter to",
                "Write a persuasive essay on", "Write a short script in which", "Give me a catchy slogan for",
                "Write a cover letter for", "Write a haiku about", "Write the opening paragraph of a novel about"],
    "roleplay": ["Pretend you are", "Imagine you are a", "Act as a", "You are a pirate captain.", "Play the role of",
                 "Let's role-play:", "Respond as if you were", "You are a medieval knight", "Take on the persona of",
                 "Stay in character as"],
    "reasoning": ["If all", "A man has", "Which of the following is true:", "Solve this riddle:", "Three friends",
                  "Explain the logic behind", "What comes next in the sequence", "Is it possible that",
                  "Suppose that", "Here is a puzzle:"],
    "math": ["Solve for x:", "What is the derivative of", "Calculate", "A train travels", "Prove that",
             "How many ways can", "What is the probability that", "Find the area of", "Simplify the expression",
             "If a rectangle has", "What is 15% of"],
    "coding": ["Write a Python function that", "How do I", "Write a JavaScript function to",
               "Explain what this code does:", "Fix the bug in this code:", "Write a SQL query that", "Implement a",
               "What is the difference between a list and", "Write a C++ program that", "How can I reverse",
               "Write a bash script that"],
    "extraction": ["Extract the names of", "From the following text, list", "Summarize the following paragraph:",
                   "Identify the main points in", "Pull out all the dates mentioned in",
                   "Read the review below and tell me", "Convert the following information into a table:",
                   "Given this product description, extract", "List the key facts from",
                   "Classify the following sentences"],
    "stem": ["Explain how", "What is the role of", "Why does", "Describe the process of", "How does a",
             "What are the main differences between", "What causes", "Explain the concept of", "How do vaccines",
             "What happens when"],
    "humanities": ["What were the main causes of", "Discuss the significance of", "Compare the philosophies of",
                   "Who was", "Explain the impact of", "What is the meaning of", "Analyze the themes of",
                   "How did the Renaissance", "What role did religion play in", "Describe the culture of"],
    "everyday": ["What should I", "Can you recommend", "How can I improve my", "Give me tips for",
                 "What is a good way to", "I need help planning", "How do I make", "What are some healthy",
                 "Help me decide between", "Suggest a weekend plan for"],
    "open": [""],
}
FOLLOW_UPS = {
    "rewrite": ["Rewrite your answer", "Can you make it shorter", "Please rewrite that in", "Now rewrite it for",
                "Make your answer more", "Summarize your answer in", "Turn that into a", "Rephrase it so that"],
    "continue": ["Can you continue", "Tell me more about", "Give me another example of", "Can you expand on",
                 "What happens next", "Now add", "Go on and explain", "Can you give more details on"],
    "critique": ["What are the weaknesses of your", "Is there anything wrong with", "Can you double-check your",
                 "Review your answer and", "Are you sure that", "What would a critic say about",
                 "How could your answer be improved", "Point out any mistakes in"],
}
CATEGORIES = list(OPENERS)


def keep_prompt(text: str, seen: set) -> bool:
    """Self-written prompts: a real sentence, not degenerate, not seen before."""
    words = text.split()
    key = " ".join(words).lower()[:80]
    looping = len(words) > 8 and len(set(words)) / len(words) < 0.5  # a repetition loop
    noise = sum(c.isalpha() for c in text) < 0.5 * len(text)  # mostly digits, symbols or code noise
    if len(words) < 3 or len(text) > 600 or "<|" in text or key in seen or looping or noise:
        return False
    seen.add(key)
    return True


def next_user_prefix(tokenizer, messages):
    """The ids of `messages` followed by the template's opening of the next user message."""
    a, b = (tokenizer.apply_chat_template(messages + [{"role": "user", "content": c}], False) for c in "AB")
    n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return a[:n]


def assistant_header(tokenizer):
    """The ids the template puts before every assistant answer."""
    m = [{"role": "user", "content": "A"}]
    a, b = tokenizer.apply_chat_template(m, False), tokenizer.apply_chat_template(m, True)
    return b[len(a):]


def assistant_mask(ids, header, stop_ids):
    """Per token: whether it belongs to an assistant answer (after a header, up to its stop token included)."""
    mask, i, h = [False] * len(ids), 0, len(header)
    while i + h <= len(ids):
        if ids[i:i + h] != header:
            i += 1
            continue
        stop = next((j for j in range(i + h, len(ids)) if ids[j] in stop_ids), len(ids))
        mask[i + h:stop + 1] = [True] * len(ids[i + h:stop + 1])
        i = stop + 1
    return mask


def seeded_messages(model, tokenizer, prefixes, openers, preset: Preset, stop_ids):
    """The user messages the target writes after each prefix and its opening words (None: cut off)."""
    seeds = [tokenizer.encode(o, bos=False) if o else [] for o in openers]
    rows = generate_batch(model, [p + s for p, s in zip(prefixes, seeds)], preset.prompt_max_tokens,
                          preset.prompt_temperature, preset.prompt_top_k, stop_ids)
    messages = [row[len(p):] for p, row in zip(prefixes, rows)]
    return [tokenizer.decode(m[:-1]).strip() if m and m[-1] in stop_ids else None for m in messages]


def make_conversation_shard(model, tokenizer, preset: Preset, index: int, seed: int):
    """Up to gen_batch conversations: "ids", "assistant" (bools), "split", "temperature", "category", "turns"."""
    rng = random.Random(seed * 1_000_003 + index)
    torch.manual_seed(seed * 1_000_003 + index)
    stop_ids = set(tokenizer.stop_ids)
    n_try = preset.gen_batch + preset.gen_batch // 4  # some messages fail the filter
    categories = [rng.choice(CATEGORIES) for _ in range(n_try)]
    openers = [rng.choice(OPENERS[c]) for c in categories]
    first = seeded_messages(model, tokenizer, [next_user_prefix(tokenizer, [])] * n_try, openers, preset, stop_ids)
    seen, convs = set(), []
    for text, category in zip(first, categories):
        if text and keep_prompt(text, seen) and len(convs) < preset.gen_batch:
            convs.append({"messages": [{"role": "user", "content": text}], "category": category,
                          "temperature": 1.0 if rng.random() < preset.sampled_fraction else 0.0,
                          "turns": 2 if rng.random() < preset.multi_turn_fraction else 1,
                          "split": "val" if rng.random() < preset.val_fraction else "train"})
    header = assistant_header(tokenizer)

    def answer(group):  # the target's answers to the conversations' last user messages
        prompts = [tokenizer.apply_chat_template(c["messages"]) for c in group]
        seqs = generate_batch(model, prompts, preset.answer_max_tokens, [c["temperature"] for c in group], None,
                              stop_ids)
        for c, p, s in zip(group, prompts, seqs):
            c["ids"], c["answer"] = s, s[len(p):]

    answer(convs)
    # Follow-ups also after an answer cut off at answer_max_tokens, as MT-bench's second turns follow
    # first answers cut at its token budget.
    two = [c for c in convs if c["turns"] == 2 and c["answer"]]
    if two:
        for c in two:
            cut = c["answer"][:-1] if c["answer"][-1] in stop_ids else c["answer"]
            c["messages"].append({"role": "assistant", "content": tokenizer.decode(cut)})
        kinds = [rng.choice(sorted(FOLLOW_UPS)) for _ in two]
        follow = seeded_messages(model, tokenizer, [next_user_prefix(tokenizer, c["messages"]) for c in two],
                                 [rng.choice(FOLLOW_UPS[k]) for k in kinds], preset, stop_ids)
        seen, again = set(), []
        for c, text in zip(two, follow):
            if text and keep_prompt(text, seen):
                c["messages"].append({"role": "user", "content": text})
                again.append(c)
            else:  # no usable follow-up: the first turn alone
                c["turns"] = 1
        if again:
            answer(again)
    return [{"ids": c["ids"], "assistant": assistant_mask(c["ids"], header, stop_ids), "split": c["split"],
             "temperature": c["temperature"], "category": c["category"], "turns": c["turns"]} for c in convs]


def save_conversations(path: Path, convs, meta: dict):
    """One compressed .npz: ids (uint16) back to back, offsets, the assistant mask bit-packed, and the
    conversations' fields."""
    ids = np.concatenate([np.asarray(c["ids"], dtype=np.int64) for c in convs]) if convs else np.zeros(0, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2 ** 16):
        raise ValueError("token ids must fit in uint16 (a vocabulary of at most 65,536)")
    mask = np.concatenate([np.asarray(c["assistant"], dtype=bool) for c in convs]) if convs else np.zeros(0, bool)
    replace_atomically(path, lambda tmp: np.savez_compressed(
        tmp, ids=ids.astype(np.uint16), offsets=np.cumsum([0] + [len(c["ids"]) for c in convs]).astype(np.int64),
        assistant=np.packbits(mask), val=np.array([c["split"] == "val" for c in convs], dtype=bool),
        temperature=np.array([c["temperature"] for c in convs], dtype=np.float32),
        category=np.array([CATEGORIES.index(c["category"]) for c in convs], dtype=np.uint8),
        turns=np.array([c["turns"] for c in convs], dtype=np.uint8),
        categories=np.array(CATEGORIES), meta=np.array(json.dumps(meta))))


def load_conversation_arrays(path: Path) -> dict:
    """A shard's arrays, the assistant mask unpacked and categories as names."""
    with np.load(path, allow_pickle=False) as z:
        s = {k: z[k] for k in z.files}
    s["assistant"] = np.unpackbits(s["assistant"], count=len(s["ids"])).astype(bool)
    s["category"] = np.asarray(s["categories"])[s["category"]] if len(s["category"]) else np.array([], dtype=str)
    return s


def load_conversation_shard(path: Path):
    """The conversations of a shard, as make_conversation_shard returned them."""
    s = load_conversation_arrays(path)
    return [{"ids": s["ids"][a:b].astype(np.int64).tolist(), "assistant": s["assistant"][a:b].tolist(),
             "split": "val" if s["val"][i] else "train", "temperature": float(s["temperature"][i]),
             "category": str(s["category"][i]), "turns": int(s["turns"][i])}
            for i, (a, b) in enumerate(pairwise(s["offsets"]))]


def shard_names(first: int, end: int):
    return [f"conv_{n:05d}.npz" for n in range(first, end)]


def make_conversations(model, tokenizer, preset: Preset, data_dir: Path, seed: int, n_shards: int):
    """The shards up to n_shards that are not there yet (a later session continues an earlier one's)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    meta = {"seed": seed, "gen_batch": preset.gen_batch, "answer_max_tokens": preset.answer_max_tokens,
            "prompt_max_tokens": preset.prompt_max_tokens, "sampled_fraction": preset.sampled_fraction,
            "multi_turn_fraction": preset.multi_turn_fraction, "val_fraction": preset.val_fraction,
            "dtype": str(model.tok_embeddings.weight.dtype).replace("torch.", "")}  # the target's, as it generated
    todo = [(n, name) for n, name in enumerate(shard_names(0, n_shards)) if not (data_dir / name).is_file()]
    for n, name in tqdm(todo, desc="conversation shards", unit="shard"):
        t0 = time.time()
        convs = make_conversation_shard(model, tokenizer, preset, n, seed)
        minutes = (time.time() - t0) / 60
        save_conversations(data_dir / name, convs, {**meta, "shard": n, "minutes": minutes})
        print(f"shard {n}: {len(convs)} conversations ({sum(c['turns'] == 2 for c in convs)} two-turn), "
              f"{sum(len(c['ids']) for c in convs)} tokens in {minutes:.1f} min", file=sys.stderr, flush=True)


def conversation_features(model, shard: Path, s: dict, cache_dir: Path, layer_ids, keep_top: int):
    """(features [T, F] float16, top_ids [T, K] uint16, top_probs [T, K] float16) of the tokens of a shard
    (s: its arrays), cached as .npy files (memory-mapped when read), recomputed when missing or made from
    other ids. layer_ids None: the final hidden state (EAGLE-1/2, files named apart, so both share a cache_dir)."""
    stamp = {"tokens": int(len(s["ids"])), "crc32": zlib.crc32(s["ids"].tobytes()),
             "layer_ids": None if layer_ids is None else list(layer_ids), "keep_top": keep_top}
    stem = shard.stem if layer_ids is not None else f"{shard.stem}.final"
    parts = {part: cache_dir / f"{stem}.{part}.npy" for part in ("features", "top_ids", "top_probs")}
    stamp_file = cache_dir / f"{stem}.json"
    if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        cache_dir.mkdir(parents=True, exist_ok=True)
        seqs = [s["ids"][a:b].astype(np.int64).tolist() for a, b in pairwise(s["offsets"])]
        rows = target_features(model, seqs, layer_ids, keep_top)
        width = model.config.dim * (1 if layer_ids is None else len(layer_ids))
        for (part, name), dtype in zip(parts.items(), (np.float16, np.uint16, np.float16)):
            array = (torch.cat([r[part] for r in rows]).numpy() if rows and part in rows[0] else
                     np.zeros((sum(map(len, seqs)), width if part == "features" else keep_top)))
            replace_atomically(name, lambda tmp: np.save(tmp, array.astype(dtype)))
        stamp_file.write_text(json.dumps(stamp))
    return tuple(np.load(name, mmap_mode="r") for name in parts.values())


def load_conversations(model, data_dir: Path, cache_dir: Path, layer_ids, keep_top: int, shards):
    """Training records {"ids", "learn", "features", "top_ids", "top_probs", "turns", "prompt"} of the shards'
    conversations, split into train and val. learn[p]: the token after p is an assistant token; prompt: the
    ids up to the last answer (where tau starts)."""
    data = {"train": [], "val": []}
    for name in tqdm(shards, desc="features", unit="shard"):
        s = load_conversation_arrays(data_dir / name)
        feats, top_ids, top_probs = conversation_features(model, data_dir / name, s, cache_dir, layer_ids, keep_top)
        for i, (a, b) in enumerate(pairwise(s["offsets"])):
            answer = s["assistant"][a:b]
            if not answer[1:].any():
                continue
            starts = np.flatnonzero(answer[1:] & ~answer[:-1]) + 1
            data["val" if s["val"][i] else "train"].append(
                {"ids": s["ids"][a:b], "learn": np.concatenate([answer[1:], [False]]), "features": feats[a:b],
                 "top_ids": top_ids[a:b], "top_probs": top_probs[a:b], "turns": int(s["turns"][i]),
                 "prompt": s["ids"][a:a + starts[-1]]})
    return data


# ---- EAGLE-3's reduced vocabulary
def choose_vocab(counts: torch.Tensor, size: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent tokens (ties: lower id), ascending; keep's tokens (a head's, widened) first."""
    kept = set() if keep is None else set(keep.tolist())
    order = sorted(range(counts.numel()), key=lambda t: (t not in kept, -int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def vocab_coverage(records, vocab: torch.Tensor, vocab_size: int) -> float:
    """The share of the target's argmax tokens at learned positions that vocab holds (the others cannot be drafted)."""
    inside = (index_of_vocab(vocab, vocab_size) >= 0).numpy()
    top1 = [np.asarray(r["top_ids"][:, 0], dtype=np.int64)[np.asarray(r["learn"], dtype=bool)] for r in records]
    return sum(int(inside[t].sum()) for t in top1) / max(1, sum(t.size for t in top1))


def index_of_vocab(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """target token id -> its row in the draft vocabulary, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab.cpu()] = torch.arange(len(vocab))
    return index


def widen_vocab(draft: Eagle3Draft, vocab: torch.Tensor, head_weight: torch.Tensor) -> Eagle3Draft:
    """A copy of a trained draft over `vocab` (ascending, holding the draft's own tokens): trained LM-head
    rows kept, a new token's row the target's (head_weight [vocab, dim])."""
    old = draft.vocab.cpu()
    vocab = vocab.cpu()
    at = torch.searchsorted(vocab, old)
    if not (at < vocab.numel()).all() or not torch.equal(vocab[at.clamp(max=vocab.numel() - 1)], old):
        raise ValueError(f"a widened vocabulary must hold the draft's own {old.numel()} tokens")
    weight = draft.lm_head.weight
    rows = head_weight.detach().cpu()[vocab].to(weight.dtype)
    rows[at] = weight.detach().cpu()
    wide = copy.deepcopy(draft)
    wide.draft_vocab_size = vocab.numel()
    wide.lm_head = torch.nn.Linear(weight.size(1), vocab.numel(), bias=False, device=weight.device, dtype=weight.dtype)
    wide.lm_head.weight = torch.nn.Parameter(rows.to(weight.device))
    wide.vocab = vocab.to(draft.vocab.device)  # (a registered buffer: saved with the head)
    return wide


# ---- Training
def make_batches_by_length(lengths, batch_tokens: int, shuffle: bool, rng: random.Random, groups=None):
    """Batches of indices into lengths, length-sorted, of at most batch_tokens padded tokens. With groups
    (a key per item, e.g. its turns) a batch holds one group: long two-turn conversations do not make
    a batch of short one-turn ones wait."""
    groups = groups or [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (groups[i], lengths[i]))
    batches = []
    for i in order:
        if not batches or lengths[i] * (len(batches[-1]) + 1) > batch_tokens or groups[i] != groups[batches[-1][-1]]:
            batches.append([])
        batches[-1].append(i)
    if shuffle:
        rng.shuffle(batches)
    return batches


def make_batches(records, batch_tokens: int, shuffle: bool, rng: random.Random):
    """make_batches_by_length over records, one-turn and two-turn conversations apart."""
    return make_batches_by_length([len(r["ids"]) for r in records], batch_tokens, shuffle, rng,
                                  [r["turns"] for r in records])


def pad_rows(records, key: str, dtype) -> torch.Tensor:
    """records[i][key] ([n_i, ...], numpy or memory-mapped) zero-padded into one tensor [B, max n_i, ...]."""
    return pad_sequence([torch.from_numpy(np.asarray(r[key], dtype=dtype)) for r in records], batch_first=True)


def collate(records, device):
    """ids [B, n], features [B, n, F] and learn [B, n] (positions whose next token is an answer token)."""
    return tuple(pad_rows(records, key, dtype).to(device)
                 for key, dtype in (("ids", np.int64), ("features", np.float32), ("learn", bool)))


class GrowingKV(torch.nn.Module):
    """The draft's KV cache in EAGLE-1/2 training: each unrolled step's keys and values appended, no
    in-place writes, so autograd sees every step."""
    k = v = None

    def update(self, cache_pos, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def unrolled_mask(n: int, step: int, device) -> torch.Tensor:
    """Which keys the queries of unrolled step `step` (1-based) see, as in a tree. Step k > 1 entries
    (f^_t, x_{t+1}) use the feature step k - 1 predicted at t - 1 (a depth-(k-1) node): the entry at t
    sees the true entries up to t - k + 1, its chain of guesses (one per earlier step, at t - k + j),
    then itself. Keys are all steps' entries, step-major."""
    t = torch.arange(n, device=device)
    blocks = [t[None, :] <= t[:, None] - step + 1]  # true prefix
    blocks += [t[None, :] == t[:, None] - step + j for j in range(2, step + 1)]  # the guess of step j on this chain
    return torch.cat(blocks, dim=1)


def draft_losses(draft, embed, head, ids, feats, learn, preset: Preset, noise: bool):
    """EAGLE-1/2, per unrolled step: (weighted loss, SmoothL1, CE, top-1 accuracy). The CE target is the
    target's distribution over its ce_topk most probable tokens, and CE = logsumexp(z) - sum_i p_i z_i
    needs no [tokens, vocab] products."""
    B, n = ids.shape
    m = n - 1  # draft positions t = 0 .. n-2: input (f_t, x_{t+1}), target f_{t+1}
    x_next = embed(ids[:, 1:])
    target = feats[:, 1:]
    learn = learn[:, :m]
    # The CE runs on a random share of the learned positions in training: through the LM head it costs
    # far more than the rest, and the SmoothL1 term, on every position, carries most of the signal.
    ce_rows = torch.rand(int(learn.sum()), device=ids.device) < (preset.ce_fraction if noise else 1.0)
    with torch.no_grad():  # the target's next-token distribution there
        top_logits, top_tokens = head(target[learn][ce_rows]).topk(preset.ce_topk, dim=-1)
        top_p = torch.softmax(top_logits.float(), dim=-1)
    inputs = feats[:, :m]
    if noise:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * preset.noise
    draft.layer.attention.kv_cache = GrowingKV()
    positions = torch.arange(m, device=ids.device)
    results, pred = [], None
    for step in range(1, preset.unroll + 1):
        if step > 1:  # step k at t reads what step k-1 predicted at t-1
            inputs = torch.cat([pred[:, :1], pred[:, :-1]], dim=1)
        pred = draft(x_next, inputs, positions, positions, unrolled_mask(m, step, ids.device).expand(B, m, -1))
        sel = learn & (positions >= step - 1)  # positions where this step's chain exists
        l1 = F.smooth_l1_loss(pred[sel].float(), target[sel].float())
        in_ce = sel[learn] & ce_rows  # this step's CE positions, among the learned ones
        z = head(pred[learn][in_ce])
        rows = in_ce[ce_rows]  # the same positions among the CE ones
        ce = (torch.logsumexp(z.float(), -1) - (top_p[rows] * z.gather(1, top_tokens[rows]).float()).sum(-1)).mean()
        acc = (z.argmax(-1) == top_tokens[rows, 0]).float().mean()
        weight = preset.unroll_decay ** (step - 1)
        results.append((weight * (l1 + preset.ce_weight * ce), l1.detach(), ce.detach(), acc.detach()))
    draft.layer.attention.kv_cache = None
    return results


# EAGLE-3's training-time test: step 0 reads the target's fused features; step k feeds the draft's outputs of
# step k - 1 back, as a depth-k tree node does: at index t it holds (o^{k-1}_t, tok_{t+k+1}) at RoPE position
# t + k and sees the true entries up to t plus its own chain (steps 1 .. k at index t). Its loss: the soft
# cross-entropy against the target's distribution at t + k + 1 over the draft vocabulary, weighted unroll_decay ** k.
def collate3(items, device, draft_index: torch.Tensor):
    """ids [B, n]; features [B, n, F]; the target's top tokens as draft-vocab indices [B, n, K] (-1:
    outside it) with probabilities renormalised over the draft vocabulary; learn [B, n]: answer
    positions whose target argmax the draft can say; answer [B, n]: all answer positions."""
    ids, feats, answer = collate(items, "cpu")
    real = torch.arange(ids.size(1)) < torch.tensor([len(r["ids"]) for r in items])[:, None]  # not padding
    top_idx = torch.where(real[..., None], draft_index[pad_rows(items, "top_ids", np.int64)], -1)
    top_p = pad_rows(items, "top_probs", np.float32) * (top_idx >= 0)
    learn = answer & (top_idx[..., 0] >= 0)
    top_p = top_p / top_p.sum(-1, keepdim=True).clamp(min=1e-12)
    return tuple(x.to(device) for x in (ids, feats, top_idx, top_p, learn, answer))


def _shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """Index t of the result holds x[:, t + k] (fill past the end)."""
    pad = x.new_full((x.size(0), k, *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


def eagle3_unroll(draft, embed, ids, feats, unroll: int):
    """The draft's outputs o^k [B, n, dim] of steps k = 0 .. unroll - 1, each step in one pass (attention
    written out: causal over the true entries, plus the step's own chain at the same index)."""
    B, n = ids.shape
    layer, attn = draft.layer, draft.layer.attention
    H, KV, D = attn.n_head, attn.n_local_heads, attn.head_dim
    G = H // KV
    t = torch.arange(n, device=ids.device)
    causal = t[None, :] <= t[:, None]  # step-0 keys visible from index t
    h = draft.fc(feats.to(draft.fc.weight.dtype))
    keys, values, outputs = [], [], []
    for k in range(unroll):
        tokens = _shift(ids, k + 1)  # tok_{t+k+1}
        x = torch.cat([layer.input_norm(embed(tokens)), layer.hidden_norm(h)], dim=-1)
        q, kk, v = (y.view(B, n, -1, D).transpose(1, 2) for y in attn.wqkv(x).split([H * D, KV * D, KV * D], -1))
        cos, sin = draft.rope_cos[t + k][None], draft.rope_sin[t + k][None]
        q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        keys.append(kk)
        values.append(v)
        qg = q.reshape(B, KV, G, n, D)  # the G query heads that share a KV head
        scores = [(qg.reshape(B, KV, G * n, D) @ keys[0].transpose(-1, -2)).view(B, KV, G, n, n)
                  .masked_fill(~causal, float("-inf"))]
        scores += [(qg * kj[:, :, None]).sum(-1, keepdim=True) for kj in keys[1:]]  # own chain: index t only
        probs = torch.softmax(torch.cat(scores, dim=-1).float() * D ** -0.5, dim=-1).to(v.dtype)
        out = (probs[..., :n].reshape(B, KV, G * n, n) @ values[0]).view(B, KV, G, n, D)
        for j, vj in enumerate(values[1:]):
            out = out + probs[..., n + j, None] * vj[:, :, None]
        o = h + attn.wo(out.reshape(B, H, n, D).transpose(1, 2).reshape(B, n, H * D))
        h = o + layer.feed_forward(layer.ffn_norm(o))
        outputs.append(h)
    return outputs


def eagle3_losses(draft, embed, ids, feats, top_idx, top_p, learn, answer, preset: Preset):
    """Per unrolled step k: (weighted loss, summed soft CE, hits, positions with a loss, answer positions). The LM head
    runs only where there is a loss; an answer whose target is outside the draft vocabulary is a miss."""
    results = []
    for k, h in enumerate(eagle3_unroll(draft, embed, ids, feats, preset.unroll)):
        sel = _shift(learn, k + 1, False)  # the target at position t + k + 1; none past the end
        n_answer = _shift(answer, k + 1, False).sum()
        idx, p = _shift(top_idx, k + 1, -1)[sel], _shift(top_p, k + 1, 0.0)[sel]
        logp = draft.log_probs(h[sel])
        ce = -(p * logp.gather(1, idx.clamp(min=0))).sum(-1)
        hits = (logp.argmax(-1) == idx[:, 0]).sum()
        mean = ce.sum() / max(1, int(sel.sum()))
        results.append((preset.unroll_decay ** k * mean, ce.sum().detach(), hits, sel.sum(), n_answer))
    return results


def batch_losses(draft, target, items, preset: Preset, dtype: str, draft_index, training: bool):
    """Either architecture's per-step losses on a batch (draft_index: EAGLE-3's vocabulary map), in
    bf16 autocast unless dtype is float32."""
    device = target.norm.weight.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        if draft_index is not None:
            return eagle3_losses(draft, target.tok_embeddings, *collate3(items, device, draft_index), preset)
        return draft_losses(draft, target.tok_embeddings, target.output, *collate(items, device), preset, training)


@torch.no_grad()
def validate(draft, target, data, preset: Preset, dtype: str, draft_index=None) -> dict:
    """Per unrolled step: EAGLE-1/2 "val_smooth_l1", "val_ce", "val_acc" (top-1); EAGLE-3 (draft_index) "val_ce" (soft),
    "val_acc" (top-1, targets outside the vocabulary are misses), "val_acc_in_vocab" (the same among those inside)."""
    draft.eval()
    eagle3 = draft_index is not None
    sums = torch.zeros(preset.unroll, 4 if eagle3 else 3)
    for batch in make_batches_by_length([len(r["ids"]) for r in data], preset.batch_tokens, False, None,
                                        None if eagle3 else [r["turns"] for r in data]):
        res = batch_losses(draft, target, [data[i] for i in batch], preset, dtype, draft_index, False)
        if eagle3:
            sums += torch.tensor([[float(x) for x in r[1:]] for r in res])
        else:  # means of batches, weighted by their conversations
            sums += torch.tensor([[l1, ce, acc] for _, l1, ce, acc in res]) * len(batch)
    draft.train()
    if not eagle3:
        return dict(zip(("val_smooth_l1", "val_ce", "val_acc"), (sums / len(data)).T.tolist()))
    ce_sum, hits, n_sel, n_answer = sums.unbind(-1)
    scores = (ce_sum / n_sel.clamp(min=1), hits / n_answer.clamp(min=1), hits / n_sel.clamp(min=1))
    return {name: x.tolist() for name, x in zip(("val_ce", "val_acc", "val_acc_in_vocab"), scores)}


def val_score(val_acc, decay: float) -> float:
    """What decides which head is shipped: each unrolled step's held-out top-1 accuracy, weighted as the
    loss weights the steps. Not tau: on a dozen prompts it is too noisy to rank near-equal heads."""
    weights = [decay ** k for k in range(len(val_acc))]
    return sum(w * a for w, a in zip(weights, val_acc)) / sum(weights)


@torch.no_grad()
def measure_tau(target, draft, stop_ids, prompts, preset: Preset):
    """Mean accepted tokens per round of greedy EAGLE-2-tree decoding of prompts; None when no round ran."""
    draft = copy.deepcopy(draft).to(target.norm.weight.dtype).eval()  # decode in the target's dtype
    draft.max_seq_length = -1  # training replaced the draft's KV cache: let the Speculator make one
    spec = Speculator(target, draft, stop_ids=stop_ids, tree_depth=preset.tau_depth)
    rounds = []
    for ids in prompts:
        prompt = torch.tensor([list(map(int, ids))], device=target.norm.weight.device)
        rounds += speculative_generate(spec, prompt, preset.tau_max_tokens)[1][0]
    return sum(rounds) / len(rounds) if rounds else None


def setup_for_training(draft, max_len: int):
    """RoPE tables for up to max_len tokens; the KV cache is swapped per batch."""
    draft.max_seq_length = -1
    draft.setup_caches(1, max_len)


def baseline_scores(args, target, init, val, tau_prompts, stop_ids, preset: Preset):
    """The bar a new head must beat on this run's held-out data: the better of the head in out_dir (--force) and the one
    training starts from (--init_from), as {"dir", "val_tau", "val_acc"}; None without either."""
    heads = {}  # resolved path -> (the path as given, the head): one directory is measured once
    if (args.out_dir / "draft.safetensors").exists():
        heads[args.out_dir.resolve()] = args.out_dir, load_draft(args.out_dir, target.config, args.device,
                                                                 torch.float32)
    if init is not None:
        heads[args.init_from.resolve()] = args.init_from, init
    scores = []
    for path, head in heads.values():
        setup_for_training(head, max(len(r["ids"]) for r in val) + preset.unroll + 1)
        index = index_of_vocab(head.vocab, target.config.vocab_size) if isinstance(head, Eagle3Draft) else None
        acc = validate(head, target, val, preset, args.dtype, index)["val_acc"]
        scores.append({"dir": str(path), "val_tau": measure_tau(target, head, stop_ids, tau_prompts, preset),
                       "val_acc": acc})
        print(f"the head in {path}: validation tau {scores[-1]['val_tau']}, accuracy per unrolled step "
              f"{[round(a, 4) for a in acc]}", file=sys.stderr)
    return max(scores, key=lambda x: val_score(x["val_acc"], preset.unroll_decay), default=None)


def make_draft(target, arch: str, vocab, head_weight, init):
    """A copy of `init` (--init_from) or a fresh head. EAGLE-3's is over vocab, its LM head warm-started
    as the target's rows of that vocabulary (head_weight [vocab, dim]), its final norm as the target's."""
    if init is not None:
        return copy.deepcopy(init).requires_grad_(True)
    if arch == "eagle3":
        draft = Eagle3Draft(draft_config_for(target.config), len(vocab), eagle3_layer_ids(target.config.n_layer))
        draft.vocab.copy_(vocab)
        with torch.no_grad():
            draft.lm_head.weight.copy_(head_weight[draft.vocab.to(head_weight.device)])
            draft.norm.weight.copy_(target.norm.weight)
        return draft
    return EagleDraft(draft_config_for(target.config))


def train(target, data, tau_prompts, stop_ids, preset: Preset, args, vocab, on_eval, baseline, head_weight, init):
    """Both architectures. Validation after every epoch and every eval_every steps, then on_eval(draft,
    state, ship): ship when the head beats the best so far and baseline. The state is saved every
    save_every steps, at every validation and at max_steps; --resume continues it bit for bit (an
    epoch's batch order is rebuilt from the random state saved at its start)."""
    torch.manual_seed(args.seed)
    draft = make_draft(target, args.arch, vocab, head_weight, init).to(target.norm.weight.device).train()
    use_attention(draft)  # the attention kernels of the device it trains on
    index = index_of_vocab(vocab, target.config.vocab_size) if args.arch == "eagle3" else None
    setup_for_training(draft, max(len(r["ids"]) for r in data["train"] + data["val"]) + preset.unroll + 1)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay)
    rng = random.Random(args.seed)
    steps_per_epoch = len(make_batches(data["train"], preset.batch_tokens, False, rng))
    total = preset.epochs * steps_per_epoch
    print(f"{steps_per_epoch} steps an epoch, {total} in all", file=sys.stderr, flush=True)

    def lr_at(step):  # linear warm-up, then cosine to 10%
        if step < preset.warmup_steps:
            return (step + 1) / preset.warmup_steps
        progress = (step - preset.warmup_steps) / max(1, total - preset.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    state_file = args.work_dir / "train_state.pt"
    st = {"epoch": 0, "batch": 0, "step": 0, "epoch_rng": rng.getstate(), "history": [], "losses": [],
          "seconds": 0.0, "best_score": None, "baseline": baseline, "shipped_step": None, "last_eval": 0}
    if state_file.is_file():
        saved = torch.load(state_file, weights_only=False)
        for name, part in (("draft", draft), ("opt", opt), ("sched", sched)):
            part.load_state_dict(saved.pop(name))
        torch.set_rng_state(saved.pop("torch_rng"))
        changed = {k: (v, getattr(preset, k, None)) for k, v in saved.pop("preset", {}).items()
                   if getattr(preset, k, None) != v}
        if changed:
            print(f"resuming with changed settings (saved, now): {changed}", file=sys.stderr)
        st.update(saved)
        print(f"resuming at epoch {st['epoch']}, batch {st['batch']}, step {st['step']}", file=sys.stderr)

    def save():
        state = {**st, "draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                 "torch_rng": torch.get_rng_state(), "preset": asdict(preset)}
        replace_atomically(state_file, lambda tmp: torch.save(state, tmp))

    def evaluate(epoch_done: bool):  # once per step: an epoch's end may share the record
        if st["history"] and st["history"][-1]["step"] == st["step"]:
            st["history"][-1]["epoch_end"] = st["history"][-1]["epoch_end"] or epoch_done
            return
        since, st["last_eval"] = st["last_eval"], len(st["losses"])
        record = {"step": st["step"], "epoch": round(st["epoch"] + st["batch"] / max(1, steps_per_epoch), 3),
                  "epoch_end": epoch_done, "train_minutes": round(st["seconds"] / 60, 2),
                  "train_loss": sum(st["losses"][since:]) / max(1, len(st["losses"]) - since),
                  **validate(draft, target, data["val"], preset, args.dtype, index)}
        if tau_prompts:
            record["val_tau"] = measure_tau(target, draft, stop_ids, tau_prompts, preset)
        st["history"].append(record)
        print(json.dumps(record), file=sys.stderr, flush=True)
        score = record["val_score"] = val_score(record["val_acc"], preset.unroll_decay)
        before = st["baseline"] and val_score(st["baseline"]["val_acc"], preset.unroll_decay)
        ship = all(b is None or score > b for b in (st["best_score"], before))
        if ship:
            st["best_score"], st["shipped_step"] = score, st["step"]
        on_eval(draft, st, ship)

    while st["epoch"] < preset.epochs:
        rng.setstate(st["epoch_rng"])
        batches = make_batches(data["train"], preset.batch_tokens, True, rng)
        bar = tqdm(range(st["batch"], len(batches)), desc=f"epoch {st['epoch'] + 1}/{preset.epochs}", unit="batch",
                   initial=st["batch"], total=len(batches), mininterval=30)
        for b in bar:
            t0 = time.time()
            res = batch_losses(draft, target, [data["train"][i] for i in batches[b]], preset, args.dtype, index, True)
            loss = sum(r[0] for r in res)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(params, preset.grad_clip)
            opt.step()
            sched.step()
            st["step"], st["batch"] = st["step"] + 1, b + 1
            st["losses"].append(loss.item())
            st["seconds"] += time.time() - t0
            acc = [float(r[2]) / max(1, float(r[3])) for r in res] if index is not None else [r[-1].item() for r in res]
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in acc),
                            lr=f"{sched.get_last_lr()[0]:.1e}", s_step=f"{time.time() - t0:.2f}", refresh=False)
            if st["batch"] == len(batches):
                break  # the epoch's end: validated below
            evaluating = preset.eval_every and st["step"] % preset.eval_every == 0
            if evaluating:
                evaluate(False)
            if evaluating or st["step"] % preset.save_every == 0 or st["step"] == args.max_steps:
                save()
            if st["step"] == args.max_steps:
                return st
        st["epoch"], st["batch"], st["epoch_rng"] = st["epoch"] + 1, 0, rng.getstate()
        evaluate(True)
        save_draft(draft, args.work_dir / f"epoch_{st['epoch']:02d}", dtype=torch.bfloat16)
        save()
        if st["step"] == args.max_steps:
            break
    return st


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, required=True, help="the target's model.pth")
    p.add_argument("--arch", choices=sorted(PRESETS), default="eagle", help="eagle: EAGLE-1/2; eagle3: EAGLE-3")
    p.add_argument("--preset", choices=sorted(PRESETS["eagle"]), default="smollm2-cpu")
    p.add_argument("--out_dir", type=Path, required=True, help="where the trained head is written")
    p.add_argument("--work_dir", type=Path, help="resumable state, features, per-epoch heads (default: OUT_DIR.work)")
    p.add_argument("--data_dir", type=Path, help="conversation shards (default: WORK_DIR/conversations)")
    p.add_argument("--cache_dir", type=Path, help="the shards' features (default: WORK_DIR/features), shareable")
    p.add_argument("--resume", action="store_true", help="continue the training state in WORK_DIR, bit for bit")
    p.add_argument("--max_steps", type=int, help="stop after this many optimizer steps in all")
    p.add_argument("--first_shard", type=int, default=0, help="train on shards FIRST_SHARD .. n_shards-1 only")
    p.add_argument("--data_only", action="store_true", help="write the conversation shards, then stop")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the target's; autocast")
    p.add_argument("--init_from", type=Path, help="start from this trained head (fresh optimizer and schedule)")
    p.add_argument("--tau_prompts", type=int, default=6, help="held-out prompts decoded for tau at each validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace the head in OUT_DIR (only by a better one)")
    for name, field in Preset.__dataclass_fields__.items():
        p.add_argument(f"--{name}", type=type(field.default), help="a Preset value")
    args = p.parse_args(argv)
    args.work_dir = args.work_dir or args.out_dir.with_name(args.out_dir.name + ".work")
    args.data_dir = args.data_dir or args.work_dir / "conversations"
    args.cache_dir = args.cache_dir or args.work_dir / "features"
    state, used = args.work_dir / "train_state.pt", args.work_dir / "train_data.json"
    if not args.checkpoint_path.is_file():
        p.error(f"checkpoint not found: {args.checkpoint_path}")
    if (args.out_dir / "draft.safetensors").exists() and not args.force and not args.data_only:
        p.error(f"{args.out_dir} already holds a head; pass --force to replace it")
    if state.is_file() and not args.resume and not args.data_only:
        p.error(f"{args.work_dir} holds a training state: pass --resume to continue it, or delete {state} "
                "to start over")
    if args.init_from is not None and not (args.init_from / "draft.safetensors").is_file():
        p.error(f"--init_from {args.init_from}: no draft.safetensors there")
    overrides = {k: getattr(args, k) for k in Preset.__dataclass_fields__ if getattr(args, k) is not None}
    preset = replace(PRESETS[args.arch][args.preset], **overrides)
    if not 0 <= args.first_shard < preset.n_shards:
        p.error(f"--first_shard must be in [0, {preset.n_shards - 1}] (below --n_shards), got {args.first_shard}")
    args.shards = shard_names(args.first_shard, preset.n_shards)  # what training reads
    if args.resume and used.is_file() and state.is_file():  # the shards the resumed run started on
        started = json.loads(used.read_text())["shards"]
        if args.n_shards is not None and not args.data_only and started != args.shards:
            p.error(f"the training state in {args.work_dir} runs over {len(started)} shards ({started[0]} .. "
                    f"{started[-1]}), not --first_shard {args.first_shard} --n_shards {args.n_shards}: drop both to "
                    f"continue it, or move {state} away to start another run")
        args.shards = started
    if preset.unroll < 1:
        p.error(f"--unroll must be at least 1, got {preset.unroll}")
    return args, preset


def conversation_data(target, tokenizer, preset: Preset, args, vocab=None):
    """Stages 1-2 on conversation shards: the missing ones up to n_shards written, their features, the
    training records and what training.json says of them. EAGLE-3 also chooses its draft vocabulary
    (or keeps `vocab`, --init_from's, widened by the most frequent tokens it lacks to a larger size)."""
    eagle3 = args.arch == "eagle3"
    make_conversations(target, tokenizer, preset, args.data_dir, args.seed, preset.n_shards)
    layer_ids = eagle3_layer_ids(target.config.n_layer) if eagle3 else None
    data = load_conversations(target, args.data_dir, args.cache_dir, layer_ids, preset.keep_top if eagle3 else 0,
                              args.shards)
    if not data["train"] or not data["val"]:
        raise SystemExit(f"no {'training' if not data['train'] else 'validation'} conversations in {args.data_dir}: "
                         f"raise --n_shards or --val_fraction")
    train, val = data["train"], data["val"]
    info = {"data_dir": str(args.data_dir), "shards": args.shards, "train_conversations": len(train),
            "val_conversations": len(val), "train_tokens": sum(len(r["ids"]) for r in train),
            "train_answer_tokens": int(sum(np.asarray(r["learn"]).sum() for r in train)),
            "two_turn_conversations": sum(r["turns"] == 2 for r in train)}
    (args.work_dir / "train_data.json").write_text(json.dumps({"shards": args.shards}))
    if not eagle3:
        return data, None, info
    V = target.config.vocab_size
    answers = [np.asarray(r["ids"], dtype=np.int64)[1:][np.asarray(r["learn"], dtype=bool)[:-1]] for r in train]
    counts = torch.from_numpy(np.bincount(np.concatenate(answers), minlength=V))  # how often each is an answer
    size = min(preset.draft_vocab_size, V)  # what a vocabulary of this size, a half and a quarter of it hold
    coverage = {str(s): vocab_coverage(val, choose_vocab(counts, s), V)
                for s in (max(1, size // 4), max(1, size // 2), size)}
    print("draft vocabulary coverage of held-out target argmax tokens: "
          + ", ".join(f"{k}: {v:.2%}" for k, v in coverage.items()), file=sys.stderr)
    info.update({"draft_vocab_size": preset.draft_vocab_size, "layer_ids": list(layer_ids),
                 "coverage_of_val_argmax": coverage})
    if vocab is not None:
        info.update(vocab_from=str(args.init_from), coverage_of_val_argmax_by_that_vocab=vocab_coverage(val, vocab, V))
    if vocab is None or preset.draft_vocab_size > len(vocab):
        vocab = choose_vocab(counts, preset.draft_vocab_size, keep=vocab)
    return data, vocab, info


def load_init(args, target, preset: Preset):
    """--init_from's head, the preset with its vocabulary size (EAGLE-3), and its lineage for training.json."""
    init = load_draft(args.init_from, target.config, args.device, torch.float32)
    if isinstance(init, Eagle3Draft) != (args.arch == "eagle3"):
        kind = "an EAGLE-3" if isinstance(init, Eagle3Draft) else "an EAGLE-1/2"
        raise SystemExit(f"--init_from {args.init_from} holds {kind} head, not one for --arch {args.arch}")
    if args.arch == "eagle3":  # a larger --draft_vocab_size widens the head; a smaller one would drop rows
        if args.draft_vocab_size is not None and args.draft_vocab_size < init.draft_vocab_size:
            raise SystemExit(f"--init_from {args.init_from} drafts over {init.draft_vocab_size} tokens; "
                             f"--draft_vocab_size {args.draft_vocab_size} would drop some (only widening is supported)")
        preset = replace(preset, draft_vocab_size=args.draft_vocab_size or init.draft_vocab_size)
    record = {"dir": str(args.init_from)}
    if (args.init_from / "training.json").is_file():  # its own lineage: what it had learned from
        before = json.loads((args.init_from / "training.json").read_text())
        record.update({k: before.get(k) for k in ("command", "steps", "shipped_step", "init_from")})
        record["shards"] = before.get("data", {}).get("shards")
    return init, preset, record


def main(argv=None):
    args, preset = parse_args(argv)
    t0 = time.time()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    target = load_model(args.checkpoint_path, args.device, getattr(torch, args.dtype)).requires_grad_(False)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    eagle3 = args.arch == "eagle3"
    head_weight = target.output.weight.detach()  # (the warm start reads it; packing makes it opaque)
    # Eager bf16 on a CPU: weights in oneDNN's layout once (a no-op elsewhere). An EAGLE-1/2 head's loss
    # runs through the target's LM head, which stays a plain linear.
    pack_linears(target if eagle3 else target.layers)
    if eagle3 and args.draft_vocab_size is not None and not 1 <= args.draft_vocab_size <= target.config.vocab_size:
        raise SystemExit(f"--draft_vocab_size must be in [1, {target.config.vocab_size}] (the target's vocabulary), "
                         f"got {args.draft_vocab_size}")
    if args.data_only:
        return make_conversations(target, tokenizer, preset, args.data_dir, args.seed, preset.n_shards)
    init, init_record = None, None
    if args.init_from is not None:
        init, preset, init_record = load_init(args, target, preset)
    data, vocab, info_data = conversation_data(target, tokenizer, preset, args,
                                               init.vocab.cpu() if eagle3 and init is not None else None)
    if init is not None and eagle3 and len(vocab) > init.draft_vocab_size:
        init_record["widened_from_vocab_size"] = init.draft_vocab_size
        init = widen_vocab(init, vocab, head_weight)
    tau_prompts = [r["prompt"] for r in data["val"][:args.tau_prompts]]
    data_minutes = (time.time() - t0) / 60
    print(f"data: {info_data['train_conversations']} train / {info_data['val_conversations']} val conversations, "
          f"{info_data['train_tokens']} train tokens, {data_minutes:.1f} min so far", file=sys.stderr)
    target.max_seq_length = -1  # generation's caches are no longer needed
    target.kv_storage = None
    for layer in target.layers:
        layer.attention.kv_cache = None
    baseline = None  # a resumed run kept its baseline in its state
    if not (args.work_dir / "train_state.pt").is_file():
        baseline = baseline_scores(args, target, init, data["val"], tau_prompts, tokenizer.stop_ids, preset)

    def write_record(st, *dirs):
        curve = [sum(st["losses"][i:i + 25]) / len(st["losses"][i:i + 25]) for i in range(0, len(st["losses"]), 25)]
        record = {"command": " ".join(sys.argv), "arch": args.arch, "preset": args.preset, "settings": asdict(preset),
                  "init_from": init_record, "target": str(args.checkpoint_path),
                  "device": args.device, "dtype": args.dtype, "hardware": platform.processor() or platform.machine(),
                  "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "data": info_data,
                  "steps": st["step"], "shipped_step": st["shipped_step"], "baseline": st["baseline"],
                  "train_minutes": st["seconds"] / 60, "data_minutes_this_run": data_minutes,
                  "train_loss_per_25_steps": curve, "history": st["history"]}
        for d in dirs:
            (d / "training.json").write_text(json.dumps(record, indent=1))

    def on_eval(draft, st, ship):
        write_record(st, args.work_dir)
        if ship:
            save_draft(draft, args.out_dir, dtype=torch.bfloat16)
            write_record(st, args.out_dir)
            last = st["history"][-1]
            print(f"step {st['step']}: wrote {args.out_dir} (validation score {last['val_score']:.4f}, "
                  f"tau {last.get('val_tau')})", file=sys.stderr, flush=True)

    st = train(target, data, tau_prompts, tokenizer.stop_ids, preset, args, vocab, on_eval, baseline, head_weight,
               init)
    shipped, bar = st["shipped_step"] is not None, st["baseline"]
    write_record(st, args.work_dir, *([args.out_dir] if shipped else []))
    if shipped:
        outcome = f"head of step {st['shipped_step']} in {args.out_dir}"
    elif bar is None:
        outcome = f"no validation ran: {args.out_dir} left as it was"
    else:
        outcome = (f"no head beat the head in {bar.get('dir', args.out_dir)} (validation score "
                   f"{val_score(bar['val_acc'], preset.unroll_decay):.4f}): {args.out_dir} left as it was")
    print(f"done in {(time.time() - t0) / 3600:.2f} h: {st['step']} steps, {outcome}", file=sys.stderr)


if __name__ == "__main__":
    main()
