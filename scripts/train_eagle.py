"""Train an EAGLE draft head for a target model, offline, on data the target writes itself
(docs/training.md: the method, the presets, the commands).

    python scripts/train_eagle.py --arch eagle3 --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth \
        --preset smollm2-cpu --out_dir heads/my-eagle3 --data_dir data/SmolLM2-135M-Instruct --n_shards 16

Three stages, each cached and resumed when rerun:
  1. data       Magpie: the target, given its chat template up to an empty user turn, writes user
                messages, then answers them. An EAGLE-1/2 head (--arch eagle) without --data_dir:
                one-turn prompts and answers in its work dir. Otherwise conversation shards of one
                or two turns under --data_dir: token ids, compressed, small enough for git, so that
                a later session, even on a fresh machine, continues from them.
  2. features   One teacher-forced forward of the target over each conversation: the final
                post-norm hidden state (EAGLE-1/2), or the residual streams entering three layers
                and the target's most probable next tokens (EAGLE-3). Cached under --cache_dir.
  3. train      EAGLE-1/2: SmoothL1 on the next feature plus ce_weight x cross-entropy through the
                frozen LM head, noise on the input features. EAGLE-3: soft cross-entropy over the
                draft vocabulary at each of --unroll steps of the training-time test (the draft fed
                its own outputs, as inside a tree), weighted unroll_decay^k; its LM head and final
                norm start from the target's. AdamW, warm-up and cosine, clipping, bf16 autocast; the
                state is saved every --save_every steps and --resume continues bit for bit.
Validation after every epoch (and every --eval_every steps): top-1 accuracy per unrolled step on
held-out conversations, and tau of real tree decoding on held-out prompts. The head is written to
--out_dir (checkpoint.save_draft, bf16: its own weights, not the target's embedding or LM head) only
when its held-out accuracy beats the head already there (--force) and the head it starts from
(--init_from), all measured on the same conversations.

Every Preset field is a flag too (e.g. --unroll 3).
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
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attention import use_attention  # noqa: E402
from checkpoint import load_draft, load_model, save_draft  # noqa: E402
from cpu import pack_linears  # noqa: E402
from draft import Eagle3Draft, EagleDraft, draft_config_for, eagle3_layer_ids  # noqa: E402
from model import KVCache, apply_rope  # noqa: E402
from sampling import sample_from  # noqa: E402
from speculative import Speculator, speculative_generate  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Preset:
    n_prompts: int = 6000        # EAGLE-1/2: prompts kept after filtering
    val_fraction: float = 0.05   # held out for validation
    prompt_max_tokens: int = 96
    prompt_temperature: float = 1.0
    prompt_top_k: int = 100      # user messages are sampled among the 100 most probable tokens
    answer_max_tokens: int = 320
    sampled_fraction: float = 0.25  # answers sampled at temperature 1 (the rest greedy)
    gen_batch: int = 128         # rows generated at once (EAGLE-3: conversations per data shard)
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
    # EAGLE-3 only
    n_shards: int = 40           # data shards of gen_batch conversations to write before training
    multi_turn_fraction: float = 0.4  # conversations with a follow-up turn
    keep_top: int = 64           # the target's most probable next tokens kept per position
    draft_vocab_size: int = 8192  # the draft's reduced vocabulary: the most frequent answer tokens
    tau_depth: int = 6           # tree depth of the tau measured at validation
    tau_max_tokens: int = 96     # tokens decoded per tau prompt


PRESETS = {
    "eagle": {
        "smollm2-cpu": Preset(),  # SmolLM2-135M on a CPU
        # a GPU: more data and epochs
        "gpu": Preset(n_prompts=40000, answer_max_tokens=768, gen_batch=256, epochs=10, batch_tokens=32768,
                      lr=3e-4, warmup_steps=500, unroll=3),
        "tiny": Preset(n_prompts=24, prompt_max_tokens=12, answer_max_tokens=16, gen_batch=8, epochs=2,  # for tests
                       batch_tokens=256, lr=3e-3, warmup_steps=2, val_fraction=0.25),
    },
    "eagle3": {
        # SmolLM2-135M on a CPU, over several sessions: the shards are kept in git (data/), the
        # training state resumes
        "smollm2-cpu": Preset(prompt_max_tokens=128, answer_max_tokens=256, sampled_fraction=0.15, val_fraction=0.03,
                              epochs=4, unroll=5, lr=1e-3, warmup_steps=100, draft_vocab_size=8192, save_every=25,
                              eval_every=250, tau_max_tokens=128),
        # a GPU: the reference's recipe, scaled to the data a GPU writes in a few hours
        "gpu": Preset(n_shards=160, answer_max_tokens=768, gen_batch=256, epochs=10, batch_tokens=32768,
                      lr=3e-4, warmup_steps=500, unroll=7, tau_depth=8, sampled_fraction=0.15,
                      val_fraction=0.02),
        "tiny": Preset(n_shards=3, prompt_max_tokens=12, answer_max_tokens=16, gen_batch=8, epochs=2,
                       batch_tokens=256, lr=3e-3, warmup_steps=2, val_fraction=0.25, unroll=3, keep_top=8,
                       draft_vocab_size=256, tau_depth=4, save_every=2),
    },
}


# ---------------------------------------------------------------------------------------------
# Batched generation with per-row prompt lengths: rows are right-padded, each row's positions
# and cache slots continue from its own length (model.py takes them per row), so a pad slot is
# overwritten by that row's next token before the row ever attends to it.
# ---------------------------------------------------------------------------------------------
def sample_rows(logits, temperature, top_k):
    """Next token of each row of logits [B, V]; temperature [B] (0: greedy) or one float. Only the
    rows that sample pay for it, and with top_k among their top_k logits only: a softmax and a
    cumulative sum over the whole vocabulary for a large batch cost a good part of a decode step."""
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
    """Shrink the target's KV cache to the batch rows `rows`: rows that finished their answer stop
    costing a decode step (a batch otherwise runs as long as its longest answer)."""
    model.kv_storage = model.kv_storage[:, :, rows]
    model.max_batch_size = len(rows)
    for layer, storage in zip(model.layers, model.kv_storage):
        layer.attention.kv_cache = KVCache(storage)


@torch.no_grad()
def generate_batch(model, prompts, max_new_tokens, temperature, top_k, stop_ids, chunk=16):
    """prompts: lists of ids; temperature: one float or one per row (0: greedy). Returns per row
    the prompt + answer ids, cut after the first stop token. Prompts are prefilled chunk positions
    at a time (the [rows, chunk, vocab] logits stay small), attention reads only the live slots
    (kv_len), and every 8 steps rows that have stopped leave the batch once they are a quarter of it."""
    device = model.norm.weight.device
    B, lengths = len(prompts), torch.tensor([len(p) for p in prompts], device=device)
    temps = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(B).clone()
    L = int(lengths.max())
    model.setup_caches(B, L + max_new_tokens + 1)
    if model.max_batch_size > B:  # a bigger cache from an earlier call: use its first B rows
        keep_cache_rows(model, torch.arange(B, device=device))
    padded = torch.tensor([p + [0] * (L - len(p)) for p in prompts], device=device)
    last = torch.zeros(B, model.config.vocab_size, device=device)
    rows = torch.arange(B, device=device)
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        logits = model(padded[:, c0:c1], torch.arange(c0, c1, device=device), kv_len=c1)
        inside = (lengths - 1 >= c0) & (lengths - 1 < c1)  # rows whose last prompt token is in this chunk
        last = torch.where(inside[:, None], logits[rows, (lengths - 1 - c0).clamp(0, c1 - c0 - 1)], last)
    token = sample_rows(last, temps, top_k)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    answers = torch.full((B, max_new_tokens), -1, dtype=torch.long)
    live = torch.arange(B, device=device)  # which prompt each batch row answers
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
        # Feeding the token gives the next one; a finished row's extra tokens are cut below.
        logits = model(token[:, None], pos[:, None], kv_len=L + step + 1)
        token = sample_rows(logits[:, -1], temps, top_k)
        pos += 1
    out = []
    for b in range(B):
        answer = [t for t in answers[b].tolist() if t >= 0]
        n = next((i + 1 for i, t in enumerate(answer) if t in stop_ids), len(answer))
        out.append(list(prompts[b]) + answer[:n])
    return out


@torch.no_grad()
def target_features(model, seqs, layer_ids=None, keep_top=0, max_tokens=8192):
    """Teacher-forced: one forward of the target over each id sequence, several sequences per
    forward (length-sorted, at most max_tokens padded tokens), as a prefill. Returns per sequence
    "features" float16 [n, F]: the final post-norm hidden state (EAGLE-1/2), or with layer_ids the
    residual streams entering those layers, concatenated (EAGLE-3); with keep_top also "top_ids"
    int64 and "top_probs" float16 [n, keep_top], the target's most probable next tokens at every
    position under its own distribution (temperature 1). Right padding changes nothing: attention
    is causal."""
    device = model.norm.weight.device
    out = [None] * len(seqs)
    groups = make_batches_by_length([len(s) for s in seqs], max_tokens, False, None)
    output = model.output
    if not keep_top:  # no logits needed: skip the LM head, a large part of the forward
        model.output = torch.nn.Identity()
    try:
        for group in groups:
            n = max(len(seqs[i]) for i in group)
            model.setup_caches(len(group), n)
            if model.max_batch_size > len(group):
                keep_cache_rows(model, torch.arange(len(group), device=device))
            ids = torch.tensor([list(seqs[i]) + [0] * (n - len(seqs[i])) for i in group], device=device)
            logits, final, layer_inputs = model(ids, torch.arange(n, device=device), return_features=True,
                                                layer_ids=layer_ids or (), kv_len=n)
            feats = final if layer_ids is None else torch.cat(layer_inputs, dim=-1)
            # float16 halves the cache; the rare residual-stream value beyond its range is clamped
            # rather than turned into inf
            feats = feats.float().clamp(-65504, 65504)
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


# ---------------------------------------------------------------------------------------------
# Stage 1: prompts (Magpie)
# ---------------------------------------------------------------------------------------------
def user_turn_prefix(tokenizer):
    """The token ids of the chat template up to where a user's first message begins."""
    return next_user_prefix(tokenizer, [])


def keep_prompt(text: str, seen: set) -> bool:
    """Filters for self-written prompts: non-empty, a real sentence, not degenerate, not seen."""
    words = text.split()
    key = " ".join(words).lower()[:80]
    if len(words) < 3 or len(text) > 600 or "<|" in text or key in seen:
        return False
    if len(words) > 8 and len(set(words)) / len(words) < 0.5:  # repetition loops
        return False
    if sum(c.isalpha() for c in text) < 0.5 * len(text):  # mostly digits, symbols or code noise
        return False
    seen.add(key)
    return True


def make_prompts(model, tokenizer, preset: Preset, path: Path, seed: int):
    """{"train": [...], "val": [...], "attempts": n}, written to path once complete. The prompts
    so far and the sampler's state are saved after every batch (path with .partial), so an
    interrupted run resumes where it stopped."""
    if path.is_file():
        return json.loads(path.read_text())
    prefix = user_turn_prefix(tokenizer)
    stop_ids = set(tokenizer.stop_ids)
    partial = path.with_suffix(".partial.pt")
    torch.manual_seed(seed)
    prompts, attempts = [], 0
    if partial.is_file():
        state = torch.load(partial, weights_only=False)
        prompts, attempts = state["prompts"], state["attempts"]
        torch.set_rng_state(state["rng"])
    seen = set()
    for text in prompts:
        keep_prompt(text, seen)  # rebuilds the duplicate filter
    bar = tqdm(total=preset.n_prompts, initial=len(prompts), desc="prompts", unit="prompt")
    while len(prompts) < preset.n_prompts:
        attempts += preset.gen_batch
        if attempts > 20 * preset.n_prompts + 10 * preset.gen_batch:
            raise RuntimeError(f"only {len(prompts)} usable prompts after {attempts} samples: is the chat "
                               f"template right for this model?")
        for row in generate_batch(model, [prefix] * preset.gen_batch, preset.prompt_max_tokens,
                                  preset.prompt_temperature, preset.prompt_top_k, stop_ids):
            answer = row[len(prefix):]
            if not answer or answer[-1] not in stop_ids:
                continue  # ran out of tokens: a truncated message
            text = tokenizer.decode(answer[:-1]).strip()
            if keep_prompt(text, seen) and len(prompts) < preset.n_prompts:
                prompts.append(text)
                bar.update(1)
        torch.save({"prompts": prompts, "attempts": attempts, "rng": torch.get_rng_state()}, partial)
    bar.close()
    random.Random(seed).shuffle(prompts)
    n_val = max(1, int(preset.val_fraction * len(prompts)))
    split = {"train": prompts[n_val:], "val": prompts[:n_val], "attempts": attempts}
    path.write_text(json.dumps(split, indent=1))
    partial.unlink()
    return split


# ---------------------------------------------------------------------------------------------
# Stage 2: answers and features
# ---------------------------------------------------------------------------------------------
def make_shards(model, tokenizer, preset: Preset, prompts: dict, data_dir: Path, seed: int):
    """Shards of {"ids", "features", "prompt_len", "split"}; one shard per generation batch, so an
    interrupted run resumes where it stopped."""
    jobs = [(split, text) for split in ("train", "val") for text in prompts[split]]
    rng = random.Random(seed)
    sampled = {i for i in range(len(jobs)) if rng.random() < preset.sampled_fraction}
    # Sort by prompt length so a batch pads little; greedy and sampled answers in separate batches.
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for _, text in jobs]
    order = sorted(range(len(jobs)), key=lambda i: (i in sampled, len(chats[i])))
    batches = [order[i:i + preset.gen_batch] for i in range(0, len(order), preset.gen_batch)]
    for n, batch in enumerate(tqdm(batches, desc="answers", unit="batch")):
        shard = data_dir / f"shard_{n:05d}.pt"
        if shard.is_file():
            continue
        temperature = 1.0 if batch[0] in sampled else 0.0
        torch.manual_seed(seed + n)
        seqs = generate_batch(model, [chats[i] for i in batch], preset.answer_max_tokens, temperature,
                              None, set(tokenizer.stop_ids))
        feats = target_features(model, seqs)
        torch.save({"ids": [torch.tensor(s, dtype=torch.int32) for s in seqs],
                    "features": [f["features"] for f in feats],
                    "prompt_len": [len(chats[i]) for i in batch],
                    "split": [jobs[i][0] for i in batch],
                    "temperature": temperature}, shard)


def answer_record(ids: torch.Tensor, features: torch.Tensor, prompt_len: int) -> dict:
    """The training record of a one-turn answer, in the form load_conversations gives a
    conversation's (numpy arrays): learn[p] says that the token after position p is an answer token."""
    ids = ids.numpy().astype(np.int64)
    learn = np.zeros(len(ids), dtype=bool)
    learn[prompt_len - 1:len(ids) - 1] = True
    return {"ids": ids, "features": features.numpy(), "learn": learn, "turns": 1, "prompt": ids[:prompt_len]}


def load_shards(data_dir: Path):
    data = {"train": [], "val": []}
    for shard in sorted(data_dir.glob("shard_*.pt")):
        s = torch.load(shard, weights_only=True)
        for ids, feats, plen, split in zip(s["ids"], s["features"], s["prompt_len"], s["split"]):
            if len(ids) > plen + 1:  # at least one answer token to learn from
                data[split].append(answer_record(ids, feats, plen))
    return data


# ---------------------------------------------------------------------------------------------
# Stage 1+2 for EAGLE-3: conversations of one or two turns, kept as token ids.
#
# A user message is Magpie-sampled after the template's user-turn opening plus the opening words
# of a kind of request (our own words, one category per conversation; "open" adds none): the
# target writes the rest. A two-turn conversation's follow-up is seeded the same way with words
# that ask to rewrite, continue or critique the first answer. Answers are greedy, a share sampled
# at temperature 1. A shard stores the conversations as the chat template encodes them (uint16
# ids) and which tokens are assistant tokens (those the draft learns), compressed.
# ---------------------------------------------------------------------------------------------
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


def next_user_prefix(tokenizer, messages):
    """The token ids of the conversation `messages` followed by the template's opening of the
    next user message (the Magpie prompt for a follow-up)."""
    a = tokenizer.apply_chat_template(messages + [{"role": "user", "content": "A"}], add_generation_prompt=False)
    b = tokenizer.apply_chat_template(messages + [{"role": "user", "content": "B"}], add_generation_prompt=False)
    n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return a[:n]


def assistant_header(tokenizer):
    """The ids the template puts before every assistant answer (after the user's message)."""
    m = [{"role": "user", "content": "A"}]
    a, b = tokenizer.apply_chat_template(m, False), tokenizer.apply_chat_template(m, True)
    return b[len(a):]


def assistant_mask(ids, header, stop_ids):
    """Per token: whether it belongs to an assistant answer (from the token after an assistant
    header up to and including the answer's stop token)."""
    mask, i, h = [False] * len(ids), 0, len(header)
    while i + h <= len(ids):
        if ids[i:i + h] == header:
            j = i + h
            while j < len(ids):
                mask[j] = True
                if ids[j] in stop_ids:
                    break
                j += 1
            i = j + 1
        else:
            i += 1
    return mask


def seeded_messages(model, tokenizer, prefixes, openers, preset: Preset, stop_ids):
    """Magpie with a seed: after each prefix (ids ending where a user message begins) and its
    opening words, the target writes the rest of the message. Returns the texts (None where the
    message was cut off)."""
    seeds = [tokenizer.encode(o, bos=False) if o else [] for o in openers]
    rows = generate_batch(model, [p + s for p, s in zip(prefixes, seeds)], preset.prompt_max_tokens,
                          preset.prompt_temperature, preset.prompt_top_k, stop_ids)
    texts = []
    for p, row in zip(prefixes, rows):
        message = row[len(p):]
        texts.append(tokenizer.decode(message[:-1]).strip() if message and message[-1] in stop_ids else None)
    return texts


def make_conversation_shard(model, tokenizer, preset: Preset, index: int, seed: int):
    """gen_batch conversations (fewer when too few messages pass the filter): dicts of "ids",
    "assistant" (bools), "split", "temperature", "category", "turns"."""
    rng = random.Random(seed * 1_000_003 + index)
    torch.manual_seed(seed * 1_000_003 + index)
    stop_ids = set(tokenizer.stop_ids)
    chat = tokenizer.apply_chat_template
    n_try = preset.gen_batch + preset.gen_batch // 4  # some messages fail the filter
    categories = [rng.choice(CATEGORIES) for _ in range(n_try)]
    openers = [rng.choice(OPENERS[c]) for c in categories]
    prefix = user_turn_prefix(tokenizer)
    seen, convs = set(), []
    for text, category in zip(seeded_messages(model, tokenizer, [prefix] * n_try, openers, preset, stop_ids),
                              categories):
        if text and keep_prompt(text, seen) and len(convs) < preset.gen_batch:
            convs.append({"messages": [{"role": "user", "content": text}], "category": category,
                          "temperature": 1.0 if rng.random() < preset.sampled_fraction else 0.0,
                          "turns": 2 if rng.random() < preset.multi_turn_fraction else 1,
                          "split": "val" if rng.random() < preset.val_fraction else "train"})
    header = assistant_header(tokenizer)

    def answer(group):  # the target's answers to the conversations' last user messages
        prompts = [chat(c["messages"]) for c in group]
        seqs = generate_batch(model, prompts, preset.answer_max_tokens, [c["temperature"] for c in group], None,
                              stop_ids)
        for c, p, s in zip(group, prompts, seqs):
            c["ids"], c["answer"] = s, s[len(p):]

    answer(convs)
    # Follow-ups, also after an answer cut off at answer_max_tokens: MT-bench's second turns follow
    # first answers cut at the benchmark's token budget the same way (the template closes the turn).
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
    """One compressed .npz: ids uint16 (all conversations back to back), offsets, the assistant
    mask bit-packed, and per conversation its split, temperature, category and number of turns.
    Written to a temporary name first, so that a killed run leaves no half shard."""
    ids = np.concatenate([np.asarray(c["ids"], dtype=np.int64) for c in convs]) if convs else np.zeros(0, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2 ** 16):
        raise ValueError("token ids must fit in uint16 (a vocabulary of at most 65,536)")
    mask = np.concatenate([np.asarray(c["assistant"], dtype=bool) for c in convs]) if convs else np.zeros(0, bool)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(
        tmp, ids=ids.astype(np.uint16), offsets=np.cumsum([0] + [len(c["ids"]) for c in convs]).astype(np.int64),
        assistant=np.packbits(mask), val=np.array([c["split"] == "val" for c in convs], dtype=bool),
        temperature=np.array([c["temperature"] for c in convs], dtype=np.float32),
        category=np.array([CATEGORIES.index(c["category"]) for c in convs], dtype=np.uint8),
        turns=np.array([c["turns"] for c in convs], dtype=np.uint8),
        categories=np.array(CATEGORIES), meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)


def load_conversation_arrays(path: Path) -> dict:
    """A shard's arrays: ids (uint16), offsets, assistant (bool per token), val, temperature,
    category (names), turns."""
    with np.load(path, allow_pickle=False) as z:
        s = {k: z[k] for k in z.files}
    s["assistant"] = np.unpackbits(s["assistant"], count=len(s["ids"])).astype(bool)
    s["category"] = np.asarray(s["categories"])[s["category"]] if len(s["category"]) else np.array([], dtype=str)
    return s


def load_conversation_shard(path: Path):
    """The conversations of a shard, as make_conversation_shard returned them."""
    s = load_conversation_arrays(path)
    o = s["offsets"]
    return [{"ids": s["ids"][o[i]:o[i + 1]].astype(np.int64).tolist(),
             "assistant": s["assistant"][o[i]:o[i + 1]].tolist(), "split": "val" if s["val"][i] else "train",
             "temperature": float(s["temperature"][i]), "category": str(s["category"][i]), "turns": int(s["turns"][i])}
            for i in range(len(o) - 1)]


def shard_name(n: int) -> str:
    """The file of conversation shard n (the one place its name is spelled)."""
    return f"conv_{n:05d}.npz"


def shard_names(first: int, end: int):
    return [shard_name(n) for n in range(first, end)]


def make_conversations(model, tokenizer, preset: Preset, data_dir: Path, seed: int, n_shards: int):
    """Shards conv_00000.npz ... up to n_shards; the ones already there are kept (a later session
    continues where an earlier one stopped)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    meta = {"seed": seed, "gen_batch": preset.gen_batch, "answer_max_tokens": preset.answer_max_tokens,
            "prompt_max_tokens": preset.prompt_max_tokens, "sampled_fraction": preset.sampled_fraction,
            "multi_turn_fraction": preset.multi_turn_fraction, "val_fraction": preset.val_fraction,
            "dtype": str(model.tok_embeddings.weight.dtype).replace("torch.", "")}  # the target's, as it generated
    todo = [n for n in range(n_shards) if not (data_dir / shard_name(n)).is_file()]
    for n in tqdm(todo, desc="conversation shards", unit="shard"):
        t0 = time.time()
        convs = make_conversation_shard(model, tokenizer, preset, n, seed)
        minutes = (time.time() - t0) / 60
        save_conversations(data_dir / shard_name(n), convs, {**meta, "shard": n, "minutes": minutes})
        print(f"shard {n}: {len(convs)} conversations ({sum(c['turns'] == 2 for c in convs)} two-turn), "
              f"{sum(len(c['ids']) for c in convs)} tokens in {minutes:.1f} min", file=sys.stderr, flush=True)


def conversation_features(model, shard: Path, cache_dir: Path, layer_ids, keep_top: int, max_tokens=8192):
    """The teacher-forced features and top tokens of a shard's conversations: (features [T, F]
    float16, top_ids [T, K] uint16, top_probs [T, K] float16) in the shard's token order, cached
    as .npy files under cache_dir (memory-mapped when read) and recomputed when missing or made
    from other ids. layer_ids: EAGLE-3's fused layers, or None for the final hidden state
    (EAGLE-1/2, files named apart: both kinds of head may share a cache_dir)."""
    s = load_conversation_arrays(shard)
    stamp = {"tokens": int(len(s["ids"])), "crc32": zlib.crc32(s["ids"].tobytes()),
             "layer_ids": None if layer_ids is None else list(layer_ids), "keep_top": keep_top}
    stem = shard.stem if layer_ids is not None else f"{shard.stem}.final"
    names = [cache_dir / f"{stem}.{part}.npy" for part in ("features", "top_ids", "top_probs")]
    stamp_file = cache_dir / f"{stem}.json"
    if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        cache_dir.mkdir(parents=True, exist_ok=True)
        o = s["offsets"]
        seqs = [s["ids"][o[i]:o[i + 1]].astype(np.int64).tolist() for i in range(len(o) - 1)]
        rows = target_features(model, seqs, layer_ids, keep_top, max_tokens)
        width = model.config.dim * (1 if layer_ids is None else len(layer_ids))
        T = sum(len(q) for q in seqs)
        parts = [torch.cat([r["features"] for r in rows]) if rows else torch.zeros(0, width, dtype=torch.half),
                 torch.cat([r["top_ids"] for r in rows]).to(torch.int32) if rows and keep_top
                 else torch.zeros(T, keep_top),
                 torch.cat([r["top_probs"] for r in rows]) if rows and keep_top else torch.zeros(T, keep_top)]
        for name, array, dtype in zip(names, parts, (np.float16, np.uint16, np.float16)):
            np.save(name.with_suffix(".tmp.npy"), array.numpy().astype(dtype))
            os.replace(name.with_suffix(".tmp.npy"), name)
        stamp_file.write_text(json.dumps(stamp))
    return tuple(np.load(name, mmap_mode="r") for name in names)


def load_conversations(model, data_dir: Path, cache_dir: Path, layer_ids, keep_top: int, shards=None):
    """Training records {"ids", "learn", "features", "top_ids", "top_probs", "turns", "prompt"} of
    every conversation in the shards (names, default all in data_dir), split into train and val;
    features and top tokens are memory-mapped slices. learn[p]: the token after position p is an
    assistant token. prompt: the ids up to the last answer (what a tau measurement starts from)."""
    data = {"train": [], "val": []}
    names = shards if shards is not None else sorted(p.name for p in data_dir.glob("conv_*.npz"))
    for name in tqdm(names, desc="features", unit="shard"):
        s = load_conversation_arrays(data_dir / name)
        feats, top_ids, top_probs = conversation_features(model, data_dir / name, cache_dir, layer_ids, keep_top)
        o = s["offsets"]
        for i in range(len(o) - 1):
            a, b = o[i], o[i + 1]
            answer = s["assistant"][a:b]
            if not answer[1:].any():
                continue
            starts = np.flatnonzero(answer[1:] & ~answer[:-1]) + 1
            data["val" if s["val"][i] else "train"].append(
                {"ids": s["ids"][a:b], "learn": np.concatenate([answer[1:], [False]]), "features": feats[a:b],
                 "top_ids": top_ids[a:b], "top_probs": top_probs[a:b], "turns": int(s["turns"][i]),
                 "prompt": s["ids"][a:a + starts[-1]]})
    return data


# ---------------------------------------------------------------------------------------------
# EAGLE-3's reduced vocabulary
# ---------------------------------------------------------------------------------------------
def token_counts(records, vocab_size: int) -> torch.Tensor:
    """How often each token is an answer token (a learned position's next token)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for r in records:
        ids, learn = np.asarray(r["ids"], dtype=np.int64), np.asarray(r["learn"], dtype=bool)
        counts += np.bincount(ids[1:][learn[:-1]], minlength=vocab_size)
    return torch.from_numpy(counts)


def choose_vocab(counts: torch.Tensor, size: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The `size` most frequent answer tokens, in ascending id order (ties: lower id first); with
    keep (a trained head's vocabulary, widened), keep's tokens first, then the most frequent others."""
    kept = set() if keep is None else set(keep.tolist())
    order = sorted(range(counts.numel()), key=lambda t: (t not in kept, -int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def vocab_coverage(records, vocab: torch.Tensor, vocab_size: int) -> float:
    """The share of the target's argmax tokens at learned positions that the vocabulary holds:
    guesses outside it cannot be drafted, so this bounds what the reduction costs."""
    inside = np.zeros(vocab_size, dtype=bool)
    inside[vocab.numpy()] = True
    hit = total = 0
    for r in records:
        top1 = np.asarray(r["top_ids"][:, 0], dtype=np.int64)[np.asarray(r["learn"], dtype=bool)]
        hit += int(inside[top1].sum())
        total += top1.size
    return hit / max(1, total)


def warm_start(draft: Eagle3Draft, head_weight: torch.Tensor, norm_weight: torch.Tensor):
    """The draft's LM head starts as the target's output rows (head_weight [vocab, dim]) for the
    draft vocabulary, its final norm as the target's: from the first step its logits are the
    target's own head read off the draft's output, instead of random."""
    with torch.no_grad():
        draft.lm_head.weight.copy_(head_weight[draft.vocab.to(head_weight.device)])
        draft.norm.weight.copy_(norm_weight)


def widen_vocab(draft: Eagle3Draft, vocab: torch.Tensor, head_weight: torch.Tensor) -> Eagle3Draft:
    """A copy of a trained EAGLE-3 draft over `vocab` (ascending target ids holding the draft's
    own: choose_vocab(counts, size, keep=draft.vocab)): its trained LM-head rows kept, a new
    token's row the target's output row (head_weight [vocab, dim]), as warm_start does."""
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
    with torch.no_grad():
        wide.lm_head.weight.copy_(rows)
    wide.vocab = vocab.to(draft.vocab.device)  # (a registered buffer: saved with the head)
    return wide


# ---------------------------------------------------------------------------------------------
# Stage 3: training
# ---------------------------------------------------------------------------------------------
class GrowingKV(torch.nn.Module):
    """A functional stand-in for the draft's KV cache during training: each unrolled step's keys
    and values are appended (no in-place writes, so autograd sees every step)."""

    def __init__(self):
        super().__init__()
        self.k = self.v = None

    def update(self, cache_pos, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def unrolled_mask(n: int, step: int, device) -> torch.Tensor:
    """Which keys the queries of unrolled step `step` (1-based) see, as the draft sees them in a tree.

    Step 1 entries are (f_t, x_{t+1}) with true features; step k > 1 entries (f^_t, x_{t+1}) use
    the feature that step k - 1 predicted from position t - 1, like a depth-(k-1) tree node. Such an
    entry at t sees the true entries up to t - k + 1 (the prefix), then the chain of its own guesses,
    one entry per earlier step at t - k + j, then itself. Keys are all steps' entries, step-major."""
    t = torch.arange(n, device=device)
    blocks = [t[None, :] <= t[:, None] - step + 1]  # true prefix
    for j in range(2, step + 1):
        blocks.append(t[None, :] == t[:, None] - step + j)  # the guess made at step j on this chain
    return torch.cat(blocks, dim=1)


def make_batches(records, batch_tokens: int, shuffle: bool, rng: random.Random):
    """Length-sorted batches of at most batch_tokens padded tokens, one-turn and two-turn
    conversations apart (records: dicts with "ids" and "turns")."""
    return make_batches_by_length([len(r["ids"]) for r in records], batch_tokens, shuffle, rng,
                                  [r["turns"] for r in records])


def make_batches_by_length(lengths, batch_tokens: int, shuffle: bool, rng: random.Random, groups=None):
    """Batches of indices into lengths, length-sorted, of at most batch_tokens padded tokens. With
    groups (one key per item, e.g. its number of turns) a batch holds one group only: long
    two-turn conversations do not make a batch of short one-turn ones wait."""
    groups = groups or [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (groups[i], lengths[i]))
    batches, current = [], []
    for i in order:
        longest = lengths[i]  # sorted by length: the newest item is the longest
        if current and (longest * (len(current) + 1) > batch_tokens or groups[i] != groups[current[-1]]):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def pad_rows(records, key: str, dtype, fill=0) -> torch.Tensor:
    """records[i][key] (numpy arrays or memory-mapped slices, [n_i, ...]) right-padded with fill
    into one tensor [B, max n_i, ...] of the numpy dtype: a copy out of the memory maps."""
    rows = [r[key] for r in records]
    out = np.full((len(rows), max(len(x) for x in rows), *rows[0].shape[1:]), fill, dtype=dtype)
    for b, x in enumerate(rows):
        out[b, :len(x)] = x
    return torch.from_numpy(out)


def collate(records, device):
    """EAGLE-1/2 batch, right-padded: ids [B, n], features [B, n, F] and learn [B, n] (positions t
    whose next token is an answer token)."""
    return tuple(pad_rows(records, key, dtype).to(device)
                 for key, dtype in (("ids", np.int64), ("features", np.float32), ("learn", bool)))


def draft_losses(draft, embed, head, ids, feats, learn, preset: Preset, noise: bool):
    """Per unrolled step: (weighted loss, SmoothL1, CE, top-1 accuracy of the predicted token).

    The CE target is the target's next-token distribution restricted to its ce_topk most probable
    tokens (renormalised; they hold nearly all of its mass). With z the draft's logits,
    CE = logsumexp(z) - sum_i p_i z_i needs z in full only for the logsumexp: no [tokens, vocab]
    products or copies, which would dominate a training step with a large vocabulary."""
    B, n = ids.shape
    m = n - 1  # draft positions t = 0 .. n-2: input (f_t, x_{t+1}), target f_{t+1}
    x_next = embed(ids[:, 1:])
    target = feats[:, 1:]
    learn = learn[:, :m]
    # The CE runs on a random share of the learned positions: through a large vocabulary's head it
    # costs far more than everything else, and the SmoothL1 term, on every position, carries most
    # of the signal.
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


def autocast(device, dtype: str):
    """Training's and validation's autocast: bf16 where --dtype bfloat16, a no-op otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


@torch.no_grad()
def validate(draft, target, data, preset: Preset, device, dtype: str):
    draft.eval()
    sums, count = None, 0
    for batch in make_batches(data, preset.batch_tokens, False, random.Random(0)):
        ids, feats, learn = collate([data[i] for i in batch], device)
        with autocast(device, dtype):
            res = draft_losses(draft, target.tok_embeddings, target.output, ids, feats, learn, preset, noise=False)
        vals = torch.tensor([[l1, ce, acc] for _, l1, ce, acc in res])
        sums = vals * len(batch) if sums is None else sums + vals * len(batch)
        count += len(batch)
    draft.train()
    return sums / count  # [unroll, 3]: SmoothL1, CE, accuracy per step


# ---------------------------------------------------------------------------------------------
# EAGLE-3 training: the training-time test. Step 0 reads the target's fused features; step k
# feeds the draft's own outputs of step k - 1 back, k tokens further on, exactly as a depth-k tree
# node does at inference: at index t it holds (o^{k-1}_t, tok_{t+k+1}) at RoPE position t + k,
# and sees the true entries up to t (the prefix) plus its own chain, the entries of steps 1 .. k
# at index t. Its loss is the soft cross-entropy against the target's distribution at position
# t + k + 1 restricted to the draft vocabulary, weighted unroll_decay ** k.
# ---------------------------------------------------------------------------------------------
def collate3(items, device, draft_index: torch.Tensor):
    """Right-padded batch: ids [B, n]; features [B, n, F]; the target's top tokens as draft-vocab
    indices [B, n, K] (-1: outside it) with their probabilities renormalised over the draft
    vocabulary; answer [B, n]: positions whose next token is an answer token; learn [B, n]: those
    of them the draft can say (the target's argmax lies in its vocabulary; the reference masks
    the loss so). Items hold numpy arrays or memory-mapped slices (load_conversations)."""
    ids, feats, answer = collate(items, "cpu")
    real = torch.arange(ids.size(1)) < torch.tensor([len(r["ids"]) for r in items])[:, None]  # not padding
    top_idx = torch.where(real[..., None], draft_index[pad_rows(items, "top_ids", np.int64)], -1)
    top_p = pad_rows(items, "top_probs", np.float32)
    top_p = top_p * (top_idx >= 0)
    learn = answer & (top_idx[..., 0] >= 0)
    top_p = top_p / top_p.sum(-1, keepdim=True).clamp(min=1e-12)
    return tuple(x.to(device) for x in (ids, feats, top_idx, top_p, learn, answer))


def _shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, k:] padded at the end to x's length: index t of the result holds x[:, t + k]."""
    if k == 0:
        return x
    pad = x.new_full((x.size(0), k, *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


def eagle3_unroll(draft, embed, ids, feats, unroll: int):
    """The draft's outputs o^k [B, n, dim] of the unrolled steps k = 0 .. unroll - 1, all positions
    of a step in one pass (attention written out: step 0 is causal over the true entries, a later
    step also sees its own chain at the same index)."""
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
        q, kk, v = attn.wqkv(x).split([H * D, KV * D, KV * D], dim=-1)
        q = q.view(B, n, H, D).transpose(1, 2)
        kk = kk.view(B, n, KV, D).transpose(1, 2)
        v = v.view(B, n, KV, D).transpose(1, 2)
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
    """Per unrolled step k: (weighted loss, summed soft CE, hits, positions with a loss, answer
    positions). The LM head and log-softmax run only on the positions that carry a loss (most
    of a step's cost otherwise, and most positions are prompts or padding); an answer position
    whose target token is outside the draft vocabulary is a miss without running them."""
    n = ids.size(1)
    t = torch.arange(n, device=ids.device)
    results = []
    for k, h in enumerate(eagle3_unroll(draft, embed, ids, feats, preset.unroll)):
        inside = t + k + 1 < n  # the target at position t + k + 1; positions past the end learn nothing
        sel = _shift(learn, k + 1, False) & inside
        n_answer = (_shift(answer, k + 1, False) & inside).sum()
        idx, p = _shift(top_idx, k + 1, -1)[sel], _shift(top_p, k + 1, 0.0)[sel]
        logp = torch.log_softmax(draft.lm_head(draft.norm(h[sel])).float(), dim=-1)
        ce = -(p * logp.gather(1, idx.clamp(min=0))).sum(-1)
        hits = (logp.argmax(-1) == idx[:, 0]).sum()
        mean = ce.sum() / max(1, int(sel.sum()))
        results.append((preset.unroll_decay ** k * mean, ce.sum().detach(), hits, sel.sum(), n_answer))
    return results


@torch.no_grad()
def validate3(draft, target, data, preset: Preset, device, dtype: str, draft_index):
    """Per unrolled step: [soft CE, top-1 accuracy (out-of-vocabulary targets are misses), top-1
    accuracy among targets in the vocabulary], over every answer token of data."""
    draft.eval()
    sums = torch.zeros(preset.unroll, 4)
    for batch in make_batches_by_length([len(r["ids"]) for r in data], preset.batch_tokens, False, random.Random(0)):
        with autocast(device, dtype):
            res = eagle3_losses(draft, target.tok_embeddings, *collate3([data[i] for i in batch], device, draft_index),
                                preset)
        sums += torch.tensor([[float(x) for x in r[1:]] for r in res])
    draft.train()
    ce_sum, hits, n_sel, n_answer = sums.unbind(-1)
    return torch.stack([ce_sum / n_sel.clamp(min=1), hits / n_answer.clamp(min=1), hits / n_sel.clamp(min=1)], -1)


def index_of_vocab(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """target token id -> its row in the draft vocabulary, -1 outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab.cpu()] = torch.arange(len(vocab))
    return index


def head_scores(head, target, val, tau_prompts, stop_ids, preset: Preset, dtype: str) -> dict:
    """A trained head (either architecture) on this run's held-out conversations, as a validation
    record has it: top-1 accuracy per unrolled step ("val_acc", over an EAGLE-3 head's own
    vocabulary) and tau on tau_prompts ("val_tau", None without prompts). What a new head must beat
    to be written out."""
    setup_for_training(head, max(len(r["ids"]) for r in val) + preset.unroll + 1)
    device = target.norm.weight.device
    if isinstance(head, Eagle3Draft):
        index = index_of_vocab(head.vocab, target.config.vocab_size)
        acc = validate3(head, target, val, preset, device, dtype, index)[:, 1].tolist()
    else:
        acc = validate(head, target, val, preset, device, dtype)[:, 2].tolist()
    tau = measure_tau(target, head, stop_ids, tau_prompts, preset.tau_max_tokens, tree_depth=preset.tau_depth)
    return {"val_tau": tau, "val_acc": acc}


def val_score(val_acc, decay: float) -> float:
    """What decides which head is shipped: the top-1 accuracy of each unrolled step on every held-out
    answer token, weighted as the loss weights the steps (decay ** k). Not validation tau: tau on a
    dozen prompts (a few hundred rounds) is too noisy to rank heads of near-equal skill."""
    weights = [decay ** k for k in range(len(val_acc))]
    return sum(w * a for w, a in zip(weights, val_acc)) / sum(weights)


@torch.no_grad()
def measure_tau(target, draft, stop_ids, prompts, max_new_tokens=96, **tree):
    """Mean accepted tokens per round of real EAGLE-2-tree decoding (greedy) on prompts (id lists);
    None when no round ran (every answer stopped at its first token, as a barely trained tiny
    target's may)."""
    draft = copy.deepcopy(draft).to(target.norm.weight.dtype)  # decode in the target's dtype
    draft.max_seq_length = -1  # training replaced the draft's KV cache: let the Speculator make one
    spec = Speculator(target, draft, stop_ids=stop_ids, **tree)
    rounds = []
    for ids in prompts:
        prompt = torch.tensor([list(map(int, ids))], device=target.norm.weight.device)
        _, per_round = speculative_generate(spec, prompt, max_new_tokens)
        rounds += per_round[0]
    return sum(rounds) / len(rounds) if rounds else None


def setup_for_training(draft, max_len: int):
    """RoPE tables for sequences of up to max_len tokens; the KV cache is swapped per batch."""
    draft.max_seq_length = -1
    draft.setup_caches(1, max_len)


def make_draft(target, args, vocab=None, head_weight=None, init=None):
    """The head training starts from: a copy of `init` (a trained head, --init_from), or a fresh
    one: EAGLE-3 with the draft vocabulary `vocab`, warm-started from the target's LM head weight,
    or EAGLE-1/2."""
    if init is not None:
        draft = copy.deepcopy(init)
        for p in draft.parameters():
            p.requires_grad_(True)
        return draft
    if args.arch == "eagle3":
        draft = Eagle3Draft(draft_config_for(target.config), len(vocab), eagle3_layer_ids(target.config.n_layer))
        draft.vocab.copy_(vocab)
        warm_start(draft, target.output.weight if head_weight is None else head_weight, target.norm.weight)
        return draft
    return EagleDraft(draft_config_for(target.config))


def save_state(path: Path, state: dict):
    """torch.save through a temporary file: a run killed while saving keeps the previous state."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(target, data, tau_prompts, stop_ids, preset: Preset, args, vocab=None, on_eval=None, baseline=None,
          head_weight=None, init=None):
    """The training loop of both architectures. Validation (and tau on tau_prompts) after every
    epoch and every eval_every steps; the state is saved every save_every steps, at every
    validation and at max_steps, and --resume continues from it bit for bit (an epoch's batch
    order is rebuilt from the random state saved at its start). on_eval(draft, state, ship) after
    every validation: ship when the head's val_score beats the best so far and baseline's (the
    scores of the heads it must beat). head_weight: the target's LM head weight (target.output may
    be packed). init: the trained head to start from (--init_from). Returns (draft, state)."""
    device = target.norm.weight.device
    torch.manual_seed(args.seed)
    eagle3 = args.arch == "eagle3"
    draft = make_draft(target, args, vocab, head_weight, init).to(device).train()
    use_attention(draft)  # the attention kernels of the device it trains on
    if eagle3:
        draft_index = index_of_vocab(vocab, target.config.vocab_size)
    lengths = [len(r["ids"]) for r in data["train"]]
    groups = [r["turns"] for r in data["train"]]
    max_len = max(lengths + [len(r["ids"]) for r in data["val"]])
    setup_for_training(draft, max_len + preset.unroll + 1)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay)
    rng = random.Random(args.seed)
    steps_per_epoch = len(make_batches_by_length(lengths, preset.batch_tokens, False, rng, groups))
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
        draft.load_state_dict(saved.pop("draft"))
        opt.load_state_dict(saved.pop("opt"))
        sched.load_state_dict(saved.pop("sched"))
        torch.set_rng_state(saved.pop("torch_rng"))
        changed = {k: (v, getattr(preset, k, None)) for k, v in saved.pop("preset", {}).items()
                   if getattr(preset, k, None) != v}
        if changed:
            print(f"resuming with changed settings (saved, now): {changed}", file=sys.stderr)
        st.update(saved)
        print(f"resuming at epoch {st['epoch']}, batch {st['batch']}, step {st['step']}", file=sys.stderr)

    def save():
        save_state(state_file, {**st, "draft": draft.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "torch_rng": torch.get_rng_state(),
                                "preset": asdict(preset)})

    def evaluate(epoch_done: bool):
        """Validation record of the current step (once per step: an epoch's end may share it)."""
        if st["history"] and st["history"][-1]["step"] == st["step"]:
            st["history"][-1]["epoch_end"] = st["history"][-1]["epoch_end"] or epoch_done
            return
        since, st["last_eval"] = st["last_eval"], len(st["losses"])
        record = {"step": st["step"], "epoch": round(st["epoch"] + st["batch"] / max(1, steps_per_epoch), 3),
                  "epoch_end": epoch_done, "train_minutes": round(st["seconds"] / 60, 2),
                  "train_loss": sum(st["losses"][since:]) / max(1, len(st["losses"]) - since)}
        if eagle3:
            val = validate3(draft, target, data["val"], preset, device, args.dtype, draft_index)
            record.update(val_ce=val[:, 0].tolist(), val_acc=val[:, 1].tolist(), val_acc_in_vocab=val[:, 2].tolist())
        else:
            val = validate(draft, target, data["val"], preset, device, args.dtype)
            record.update(val_smooth_l1=val[:, 0].tolist(), val_ce=val[:, 1].tolist(), val_acc=val[:, 2].tolist())
        if tau_prompts:
            draft.eval()
            record["val_tau"] = measure_tau(target, draft, stop_ids, tau_prompts, preset.tau_max_tokens,
                                            tree_depth=preset.tau_depth)
            draft.train()
        st["history"].append(record)
        print(json.dumps(record), file=sys.stderr, flush=True)
        score = record["val_score"] = val_score(record["val_acc"], preset.unroll_decay)
        before = st["baseline"] and val_score(st["baseline"]["val_acc"], preset.unroll_decay)
        ship = all(b is None or score > b for b in (st["best_score"], before))
        if ship:
            st["best_score"], st["shipped_step"] = score, st["step"]
        if on_eval is not None:
            on_eval(draft, st, ship)

    while st["epoch"] < preset.epochs:
        rng.setstate(st["epoch_rng"])
        batches = make_batches_by_length(lengths, preset.batch_tokens, True, rng, groups)
        bar = tqdm(range(st["batch"], len(batches)), desc=f"epoch {st['epoch'] + 1}/{preset.epochs}", unit="batch",
                   initial=st["batch"], total=len(batches), mininterval=30)
        for b in bar:
            t0 = time.time()
            items = [data["train"][i] for i in batches[b]]
            with autocast(device, args.dtype):
                if eagle3:
                    res = eagle3_losses(draft, target.tok_embeddings, *collate3(items, device, draft_index), preset)
                else:
                    res = draft_losses(draft, target.tok_embeddings, target.output, *collate(items, device), preset,
                                       noise=True)
            loss = sum(r[0] for r in res)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(params, preset.grad_clip)
            opt.step()
            sched.step()
            st["step"], st["batch"] = st["step"] + 1, b + 1
            st["losses"].append(loss.item())
            st["seconds"] += time.time() - t0
            acc = [float(r[2]) / max(1, float(r[3])) for r in res] if eagle3 else [r[-1].item() for r in res]
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
                return draft.eval(), st
        st["epoch"], st["batch"], st["epoch_rng"] = st["epoch"] + 1, 0, rng.getstate()
        evaluate(True)
        save_draft(draft, args.work_dir / f"epoch_{st['epoch']:02d}", dtype=torch.bfloat16)
        save()
        if st["step"] == args.max_steps:
            break
    return draft.eval(), st


# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, required=True, help="the target's model.pth")
    p.add_argument("--arch", choices=sorted(PRESETS), default="eagle",
                   help="eagle: an EAGLE-1/2 head; eagle3: an EAGLE-3 head (three fused layers, its own vocabulary)")
    p.add_argument("--preset", choices=sorted(PRESETS["eagle"]), default="smollm2-cpu")
    p.add_argument("--out_dir", type=Path, required=True, help="where the trained head is written")
    p.add_argument("--work_dir", type=Path, default=None,
                   help="resumable state, cached features, per-epoch heads (default: OUT_DIR.work)")
    p.add_argument("--data_dir", type=Path, default=None,
                   help="the conversation shards (default: WORK_DIR/conversations); eagle: train on them instead "
                        "of one-turn answers")
    p.add_argument("--cache_dir", type=Path, default=None,
                   help="the shards' teacher-forced features (default: WORK_DIR/features), shared by runs on them")
    p.add_argument("--resume", action="store_true",
                   help="continue the training state in WORK_DIR, bit for bit, over the shards it started on")
    p.add_argument("--max_steps", type=int, default=None, help="stop after this many optimizer steps in all")
    p.add_argument("--first_shard", type=int, default=0, help="train on shards FIRST_SHARD .. n_shards-1 only")
    p.add_argument("--data_only", action="store_true", help="write the conversation shards, then stop")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the target's, for data and features, and training's autocast")
    p.add_argument("--init_from", type=Path, default=None,
                   help="start from this trained head (fresh optimizer and schedule); eagle3: its vocabulary is "
                        "kept, or widened to a larger --draft_vocab_size")
    p.add_argument("--tau_prompts", type=int, default=6, help="held-out prompts decoded for tau at each validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace the head in OUT_DIR (only by a better one)")
    for name, field in Preset.__dataclass_fields__.items():  # every preset value can be overridden
        p.add_argument(f"--{name}", type=type(field.default), default=None, help="a Preset value (see the dataclass)")
    args = p.parse_args(argv)
    if not args.checkpoint_path.is_file():
        p.error(f"checkpoint not found: {args.checkpoint_path}")
    if (args.out_dir / "draft.safetensors").exists() and not args.force and not args.data_only:
        p.error(f"{args.out_dir} already holds a head; pass --force to replace it")
    args.work_dir = args.work_dir or args.out_dir.with_name(args.out_dir.name + ".work")
    # EAGLE-3 always trains on conversation shards; an EAGLE-1/2 head on them when --data_dir names
    # some, and otherwise on the one-turn Magpie answers it writes into its work dir.
    args.on_shards = args.arch == "eagle3" or args.data_dir is not None
    args.data_dir = args.data_dir or args.work_dir / "conversations"
    args.cache_dir = args.cache_dir or args.work_dir / "features"
    if (args.work_dir / "train_state.pt").is_file() and not args.resume and not args.data_only:
        p.error(f"{args.work_dir} holds a training state: pass --resume to continue it, or delete "
                f"{args.work_dir / 'train_state.pt'} to start over")
    if args.init_from is not None and not (args.init_from / "draft.safetensors").is_file():
        p.error(f"--init_from {args.init_from}: no draft.safetensors there")
    preset = PRESETS[args.arch][args.preset]
    overrides = {k: getattr(args, k) for k in Preset.__dataclass_fields__ if getattr(args, k) is not None}
    preset = Preset(**{**asdict(preset), **overrides})
    if args.first_shard and not args.on_shards:
        p.error("--first_shard is for conversation shards (--arch eagle3, or --data_dir): an EAGLE-1/2 run "
                "without them trains on all the answers it writes")
    if not 0 <= args.first_shard < preset.n_shards:
        p.error(f"--first_shard must be in [0, {preset.n_shards - 1}] (below --n_shards), got {args.first_shard}")
    # A resumed run on shards keeps the ones it started on; asked for other shards, it would train
    # the old list without a word (and a finished run would do nothing), so say what to do instead.
    started = resumed_shards(args)
    asked = None if args.n_shards is None else shard_names(args.first_shard, args.n_shards)
    if started is not None and asked is not None and not args.data_only and started != asked:
        p.error(f"the training state in {args.work_dir} runs over {len(started)} shards ({started[0]} .. "
                f"{started[-1]}), not --first_shard {args.first_shard} --n_shards {args.n_shards}: drop both to "
                f"continue it, or move {args.work_dir / 'train_state.pt'} away to start another run")
    if preset.unroll < 1:
        p.error(f"--unroll must be at least 1, got {preset.unroll}")
    return args, preset


def resumed_shards(args):
    """The shard list of the training state in the work dir, which --resume keeps; None when there
    is no state to resume."""
    used = args.work_dir / "train_data.json"
    if args.resume and used.is_file() and (args.work_dir / "train_state.pt").is_file():
        return json.loads(used.read_text())["shards"]
    return None


def conversation_data(target, tokenizer, preset: Preset, args, layer_ids, keep_top: int):
    """Stages 1-2 over the kept conversation shards, for either kind of head: shards up to n_shards
    (the missing ones written first), their features (layer_ids: EAGLE-3's fused layers, or None for
    the final hidden state of EAGLE-1/2), the training records and what the training record says
    about them. The shards a training state was started on are kept when resuming (a later session
    may have written more)."""
    make_conversations(target, tokenizer, preset, args.data_dir, args.seed, preset.n_shards)
    shards = resumed_shards(args)
    if shards is None:
        shards = shard_names(args.first_shard, preset.n_shards)
    data = load_conversations(target, args.data_dir, args.cache_dir, layer_ids, keep_top, shards)
    if not data["train"] or not data["val"]:
        raise SystemExit(f"no {'training' if not data['train'] else 'validation'} conversations in {args.data_dir}: "
                         f"raise --n_shards or --val_fraction")
    train = data["train"]
    info = {"data_dir": str(args.data_dir), "shards": shards, "train_conversations": len(train),
            "val_conversations": len(data["val"]), "train_tokens": sum(len(r["ids"]) for r in train),
            "train_answer_tokens": int(sum(np.asarray(r["learn"]).sum() for r in train)),
            "two_turn_conversations": sum(r["turns"] == 2 for r in train)}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.work_dir / "train_data.json").write_text(json.dumps({"shards": shards}))
    return data, info


def eagle3_data(target, tokenizer, preset: Preset, args, vocab=None):
    """Stages 1-2 of EAGLE-3: conversation_data over the shards, and the draft vocabulary (chosen
    from the data, or `vocab`: the one of the head training starts from, widened by the most
    frequent tokens it lacks when the preset's size is larger)."""
    layer_ids = eagle3_layer_ids(target.config.n_layer)
    data, info = conversation_data(target, tokenizer, preset, args, layer_ids, preset.keep_top)
    V = target.config.vocab_size
    counts = token_counts(data["train"], V)
    size = min(preset.draft_vocab_size, V)  # what a vocabulary of this size, a half and a quarter of it hold
    sizes = [max(1, size // 4), max(1, size // 2), size]
    coverage = {str(s): vocab_coverage(data["val"], choose_vocab(counts, s), V) for s in sizes}
    print("draft vocabulary coverage of held-out target argmax tokens: "
          + ", ".join(f"{k}: {v:.2%}" for k, v in coverage.items()), file=sys.stderr)
    info.update({"draft_vocab_size": preset.draft_vocab_size, "layer_ids": list(layer_ids),
                 "coverage_of_val_argmax": coverage})
    if vocab is not None:
        info["vocab_from"] = str(args.init_from)
        info["coverage_of_val_argmax_by_that_vocab"] = vocab_coverage(data["val"], vocab, V)
    if vocab is None or preset.draft_vocab_size > len(vocab):
        vocab = choose_vocab(counts, preset.draft_vocab_size, keep=vocab)
    return data, vocab, info


def main(argv=None):
    args, preset = parse_args(argv)
    t0 = time.time()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    target = load_model(args.checkpoint_path, args.device, getattr(torch, args.dtype))
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)
    eagle3 = args.arch == "eagle3"
    head_weight = target.output.weight.detach()  # (the warm start reads it; packing makes it opaque)
    # Eager bf16 on a CPU: weights in oneDNN's layout once, instead of reordered at every call (a
    # no-op elsewhere). Training needs no gradient through the target's layers; an EAGLE-1/2 head's
    # loss runs through the target's LM head, which stays a plain linear.
    pack_linears(target if eagle3 else target.layers)

    init, init_record = None, None
    if eagle3 and args.draft_vocab_size is not None and not 1 <= args.draft_vocab_size <= target.config.vocab_size:
        raise SystemExit(f"--draft_vocab_size must be in [1, {target.config.vocab_size}] (the target's vocabulary), "
                         f"got {args.draft_vocab_size}")
    if args.init_from is not None and not args.data_only:
        init = load_draft(args.init_from, target.config, args.device, torch.float32)
        if isinstance(init, Eagle3Draft) != eagle3:
            kind = "an EAGLE-3" if isinstance(init, Eagle3Draft) else "an EAGLE-1/2"
            raise SystemExit(f"--init_from {args.init_from} holds {kind} head, not one for --arch {args.arch}")
        if eagle3:
            # A larger --draft_vocab_size widens the head (widen_vocab, once the data's token counts are
            # known); a smaller one would throw trained rows away: refused.
            if args.draft_vocab_size is not None and args.draft_vocab_size < init.draft_vocab_size:
                raise SystemExit(f"--init_from {args.init_from} drafts over {init.draft_vocab_size} tokens; "
                                 f"--draft_vocab_size {args.draft_vocab_size} would drop some (only widening is "
                                 f"supported)")
            preset = replace(preset, draft_vocab_size=args.draft_vocab_size or init.draft_vocab_size)
        init_record = {"dir": str(args.init_from)}
        if (args.init_from / "training.json").is_file():  # its own lineage: what it had learned from
            before = json.loads((args.init_from / "training.json").read_text())
            init_record.update({k: before.get(k) for k in ("command", "steps", "shipped_step", "init_from")})
            init_record["shards"] = before.get("data", {}).get("shards")
    if args.on_shards:
        if args.data_only:
            make_conversations(target, tokenizer, preset, args.data_dir, args.seed, preset.n_shards)
            return
        if eagle3:
            init_vocab = None if init is None else init.vocab.cpu()
            data, vocab, info_data = eagle3_data(target, tokenizer, preset, args, init_vocab)
            if init is not None and len(vocab) > init.draft_vocab_size:
                init_record["widened_from_vocab_size"] = init.draft_vocab_size
                init = widen_vocab(init, vocab, head_weight)
        else:  # an EAGLE-1/2 head on the conversations kept for EAGLE-3: the final hidden state only
            (data, info_data), vocab = conversation_data(target, tokenizer, preset, args, None, 0), None
        tau_prompts = [r["prompt"] for r in data["val"][:args.tau_prompts]]
    else:
        prompts = make_prompts(target, tokenizer, preset, args.work_dir / "prompts.json", args.seed)
        data_dir = args.work_dir / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        make_shards(target, tokenizer, preset, prompts, data_dir, args.seed)
        if args.data_only:
            return
        data, vocab = load_shards(data_dir), None
        info_data = {"train_conversations": len(data["train"]), "val_conversations": len(data["val"]),
                     "train_tokens": sum(len(r["ids"]) for r in data["train"]),
                     "prompt_samples": prompts.get("attempts")}
        tau_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}])
                       for text in prompts["val"][:args.tau_prompts]]
    data_minutes = (time.time() - t0) / 60
    print(f"data: {info_data['train_conversations']} train / {info_data['val_conversations']} val conversations, "
          f"{info_data['train_tokens']} train tokens, {data_minutes:.1f} min so far", file=sys.stderr)
    target.max_seq_length = -1  # generation's caches are no longer needed
    target.kv_storage = None
    for layer in target.layers:
        layer.attention.kv_cache = None

    # What a new head must beat to be written to out_dir, on the same conversations and prompts:
    # the head there now (--force), and the head training starts from (--init_from), so that a
    # continuation that made it worse is not shipped. The better of the two is the bar; a resumed
    # run kept it in its state.
    baseline = None
    if not (args.work_dir / "train_state.pt").is_file():
        heads = {}  # resolved path -> (the path as given, the head)
        if (args.out_dir / "draft.safetensors").exists():
            heads[args.out_dir.resolve()] = args.out_dir, load_draft(args.out_dir, target.config, args.device,
                                                                     torch.float32)
        if init is not None:
            heads[args.init_from.resolve()] = args.init_from, init  # (the same directory as out_dir: measured once)
        for path, head in heads.values():
            scores = {"dir": str(path), **head_scores(head, target, data["val"], tau_prompts, tokenizer.stop_ids,
                                                      preset, args.dtype)}
            print(f"the head in {path}: validation tau {scores['val_tau']}, accuracy per unrolled step "
                  f"{[round(a, 4) for a in scores['val_acc']]}", file=sys.stderr)
            if baseline is None or (val_score(scores["val_acc"], preset.unroll_decay) >
                                    val_score(baseline["val_acc"], preset.unroll_decay)):
                baseline = scores

    def record(st):
        curve = [sum(st["losses"][i:i + 25]) / len(st["losses"][i:i + 25]) for i in range(0, len(st["losses"]), 25)]
        return {"command": " ".join(sys.argv), "arch": args.arch, "preset": args.preset, "settings": asdict(preset),
                "init_from": init_record, "target": str(args.checkpoint_path),
                "device": args.device, "dtype": args.dtype, "hardware": platform.processor() or platform.machine(),
                "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "data": info_data,
                "steps": st["step"], "shipped_step": st["shipped_step"], "baseline": st["baseline"],
                "train_minutes": st["seconds"] / 60, "data_minutes_this_run": data_minutes,
                "train_loss_per_25_steps": curve, "history": st["history"]}

    def on_eval(draft, st, ship):
        (args.work_dir / "training.json").write_text(json.dumps(record(st), indent=1))
        if ship:
            save_draft(draft, args.out_dir, dtype=torch.bfloat16)
            (args.out_dir / "training.json").write_text(json.dumps(record(st), indent=1))
            last = st["history"][-1]
            print(f"step {st['step']}: wrote {args.out_dir} (validation score {last['val_score']:.4f}, "
                  f"tau {last.get('val_tau')})", file=sys.stderr, flush=True)

    _, st = train(target, data, tau_prompts, tokenizer.stop_ids, preset, args, vocab, on_eval,
                               baseline, head_weight, init)
    (args.work_dir / "training.json").write_text(json.dumps(record(st), indent=1))
    if st["shipped_step"] is not None:
        (args.out_dir / "training.json").write_text(json.dumps(record(st), indent=1))
        print(f"done in {(time.time() - t0) / 3600:.2f} h: {st['step']} steps, head of step {st['shipped_step']} in "
              f"{args.out_dir}", file=sys.stderr)
    else:
        bar = st["baseline"]
        why = "no validation ran" if bar is None else (
            f"no head beat the head in {bar.get('dir', args.out_dir)} (validation score "
            f"{val_score(bar['val_acc'], preset.unroll_decay):.4f})")
        print(f"done in {(time.time() - t0) / 3600:.2f} h: {st['step']} steps; {why}: {args.out_dir} left as it was",
              file=sys.stderr)


if __name__ == "__main__":
    main()
