"""Train an EAGLE draft head for a target model, offline, on data the target writes itself.

    python scripts/train_eagle.py --checkpoint_path checkpoints/SmolLM2-135M-Instruct/model.pth \
        --preset smollm2-cpu --out_dir heads/SmolLM2-135M-Instruct

Three stages, each cached under --work_dir and resumed when rerun:
  1. prompts    Magpie: the target, given only its chat template up to an empty user turn, writes
                user messages. Sampled with temperature, deduplicated, filtered; a slice is held
                out for validation. No outside or evaluation data is used.
  2. answers    The target answers every prompt (greedy, and a share sampled). Its final post-norm
                hidden states (the features the draft learns to predict) are recorded for every
                token of prompt + answer and stored as float16 shards.
  3. train      EAGLE-1/2 objective: SmoothL1 between the draft's predicted next feature and the
                true one, plus 0.1 x cross-entropy between the target's next-token distribution and
                the draft's (both through the frozen LM head); uniform noise on input features;
                AdamW, warm-up and cosine decay, gradient clipping, bf16 autocast. With --unroll K
                the draft is also trained on its own predictions K-1 steps deep (EAGLE-3's
                "training-time test"), as it runs inside a tree.
The head is written with checkpoint.save_draft: its own weights only, not the target's embedding or
LM head.
"""
import argparse
import copy
import json
import math
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import load_model, save_draft  # noqa: E402
from draft import Eagle3Draft, EagleDraft, draft_config_for, eagle3_layer_ids  # noqa: E402
from model import apply_rope  # noqa: E402
from sampling import sample  # noqa: E402
from speculative import Speculator, speculative_generate  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Preset:
    n_prompts: int = 6000        # prompts kept after filtering
    val_fraction: float = 0.05   # held out for validation
    prompt_max_tokens: int = 96
    prompt_temperature: float = 1.0
    prompt_top_k: int = 100      # user messages are sampled among the 100 most probable tokens
    answer_max_tokens: int = 320
    sampled_fraction: float = 0.25  # answers sampled at temperature 1 (the rest greedy)
    gen_batch: int = 128         # rows generated at once
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
    # EAGLE-3 only
    multi_turn_fraction: float = 0.5  # conversations where the target also writes the user's follow-up
    keep_top: int = 64           # the target's most probable next tokens recorded per position
    draft_vocab_size: int = 8192  # the draft's reduced vocabulary: the most frequent answer tokens
    tau_depth: int = 6           # tree depth of the tau measured after each epoch


PRESETS = {
    "eagle": {
        # SmolLM2-135M on a 2-core CPU (bf16 matmuls). The shipped EAGLE-2 head: prompts ~0.5 h, answers of
        # the first 32 of 47 batches (--max_answer_batches 32, 1.15M tokens) 47 min, 6 epochs 64 min.
        "smollm2-cpu": Preset(),
        # A GPU: more data and epochs; the 135M target trains in minutes, a 7B one in hours.
        "gpu": Preset(n_prompts=40000, answer_max_tokens=768, gen_batch=256, epochs=10, batch_tokens=32768,
                      lr=3e-4, warmup_steps=500, unroll=3),
        # Seconds, for tests.
        "tiny": Preset(n_prompts=24, prompt_max_tokens=12, answer_max_tokens=16, gen_batch=8, epochs=2,
                       batch_tokens=256, lr=3e-3, warmup_steps=2, val_fraction=0.25),
    },
    "eagle3": {
        # SmolLM2-135M on a 2-core CPU: about two hours of data and training (see the README's
        # training record for the shipped head's measured times).
        "smollm2-cpu": Preset(n_prompts=6000, answer_max_tokens=256, epochs=3, unroll=5, lr=1e-3,
                              warmup_steps=100, draft_vocab_size=8192),
        # A GPU: the reference's recipe scaled to what the data stage can write in a few hours.
        "gpu": Preset(n_prompts=40000, answer_max_tokens=768, gen_batch=256, epochs=10, batch_tokens=32768,
                      lr=3e-4, warmup_steps=500, unroll=7, tau_depth=8),
        "tiny": Preset(n_prompts=24, prompt_max_tokens=12, answer_max_tokens=16, gen_batch=8, epochs=2,
                       batch_tokens=256, lr=3e-3, warmup_steps=2, val_fraction=0.25, unroll=3, keep_top=8,
                       draft_vocab_size=256, tau_depth=4),
    },
}


# ---------------------------------------------------------------------------------------------
# Batched generation with per-row prompt lengths: rows are right-padded, each row's positions
# and cache slots continue from its own length (model.py takes them per row), so a pad slot is
# overwritten by that row's next token before the row ever attends to it.
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_batch(model, prompts, max_new_tokens, temperature, top_k, stop_ids, layer_ids=None, keep_top=0,
                   chunk=16):
    """prompts: lists of ids. Returns one dict per row: "ids", the prompt + answer (cut after the
    first stop token), and for every one of those tokens "features", float16 on the CPU: the
    target's final post-norm hidden state (EAGLE-1/2), or with layer_ids the residual streams
    entering those layers, concatenated (EAGLE-3); with keep_top, also "top_ids" int32 and
    "top_probs" float16 [n, keep_top]: the keep_top most probable next tokens at each position
    under the target's own distribution (temperature 1), which EAGLE-3 trains against.

    The prompts are prefilled chunk positions at a time (so that [rows, chunk, vocab] logits stay
    small) and attention reads only the live slots (kv_len): both keep a batch of 100+ rows fast."""
    device = model.norm.weight.device
    B, lengths = len(prompts), torch.tensor([len(p) for p in prompts], device=device)
    L = int(lengths.max())
    model.setup_caches(B, L + max_new_tokens + 1)
    padded = torch.tensor([p + [0] * (L - len(p)) for p in prompts], device=device)
    record = []  # per position: (features [B, c, F], top_ids, top_probs) on the CPU

    def forward(tokens, pos, kv_len):
        logits, final, layer_inputs = model(tokens, pos, return_features=True, layer_ids=layer_ids or (),
                                            kv_len=kv_len)
        feats = final if layer_ids is None else torch.cat(layer_inputs, dim=-1)
        top = torch.softmax(logits.float(), dim=-1).topk(keep_top, dim=-1) if keep_top else None
        record.append((feats.half().cpu(), *((top.indices.int().cpu(), top.values.half().cpu()) if top else ())))
        return logits

    last = torch.zeros(B, model.config.vocab_size, device=device)
    rows = torch.arange(B, device=device)
    for c0 in range(0, L, chunk):
        c1 = min(L, c0 + chunk)
        logits = forward(padded[:, c0:c1], torch.arange(c0, c1, device=device), c1)
        inside = (lengths - 1 >= c0) & (lengths - 1 < c1)  # rows whose last prompt token is in this chunk
        last = torch.where(inside[:, None], logits[rows, (lengths - 1 - c0).clamp(0, c1 - c0 - 1)], last)
    n_prompt = len(record)
    token = sample(last, temperature, top_k, None)
    stop = torch.tensor(sorted(stop_ids), device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    pos, steps_tokens = lengths.clone(), []
    for step in range(max_new_tokens):
        # Feeding the token gives its features (the last position's are a training target too)
        # and the next token.
        logits = forward(token[:, None], pos[:, None], L + step + 1)
        steps_tokens.append(token)
        done |= torch.isin(token, stop)
        if step % 8 == 7 and bool(done.all()):
            break
        token = sample(logits[:, -1], temperature, top_k, None)
        pos += 1
    new_tokens = torch.stack(steps_tokens, 1).cpu()
    columns = [torch.cat(parts, dim=1) for parts in zip(*record[:n_prompt])]  # the prompt's positions
    steps = [torch.cat(parts, dim=1) for parts in zip(*record[n_prompt:])]    # then one per new token
    names = ["features", "top_ids", "top_probs"]
    out = []
    for b in range(B):
        answer = new_tokens[b].tolist()
        n = next((i + 1 for i, t in enumerate(answer) if t in stop_ids), len(answer))
        plen = len(prompts[b])
        row = {"ids": prompts[b] + answer[:n]}
        for name, prompt_part, answer_part in zip(names, columns, steps):
            row[name] = torch.cat([prompt_part[b, :plen], answer_part[b, :n]])
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# Stage 1: prompts (Magpie)
# ---------------------------------------------------------------------------------------------
def user_turn_prefix(tokenizer):
    """The token ids of the chat template up to where a user's first message begins."""
    a = tokenizer.apply_chat_template([{"role": "user", "content": "A"}], add_generation_prompt=False)
    b = tokenizer.apply_chat_template([{"role": "user", "content": "B"}], add_generation_prompt=False)
    n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return a[:n]


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
            answer = row["ids"][len(prefix):]
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
def make_shards(model, tokenizer, preset: Preset, prompts: dict, data_dir: Path, seed: int,
                max_batches: int | None = None):
    """Shards of {"ids", "features", "prompt_len", "split"}; one shard per generation batch, so an
    interrupted run resumes where it stopped."""
    jobs = [(split, text) for split in ("train", "val") for text in prompts[split]]
    rng = random.Random(seed)
    sampled = {i for i in range(len(jobs)) if rng.random() < preset.sampled_fraction}
    # Sort by prompt length so a batch pads little; greedy and sampled answers in separate batches.
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for _, text in jobs]
    order = sorted(range(len(jobs)), key=lambda i: (i in sampled, len(chats[i])))
    batches = [order[i:i + preset.gen_batch] for i in range(0, len(order), preset.gen_batch)]
    batches = batches[:max_batches]
    for n, batch in enumerate(tqdm(batches, desc="answers", unit="batch")):
        shard = data_dir / f"shard_{n:05d}.pt"
        if shard.is_file():
            continue
        temperature = 1.0 if batch[0] in sampled else 0.0
        torch.manual_seed(seed + n)
        results = generate_batch(model, [chats[i] for i in batch], preset.answer_max_tokens, temperature,
                                 None, set(tokenizer.stop_ids))
        torch.save({"ids": [torch.tensor(r["ids"], dtype=torch.int32) for r in results],
                    "features": [r["features"] for r in results],
                    "prompt_len": [len(chats[i]) for i in batch],
                    "split": [jobs[i][0] for i in batch],
                    "temperature": temperature}, shard)


def load_shards(data_dir: Path):
    data = {"train": [], "val": []}
    for shard in sorted(data_dir.glob("shard_*.pt")):
        s = torch.load(shard, weights_only=True)
        for ids, feats, plen, split in zip(s["ids"], s["features"], s["prompt_len"], s["split"]):
            if len(ids) > plen + 1:  # at least one answer token to learn from
                data[split].append((ids.long(), feats, plen))
    return data


# ---------------------------------------------------------------------------------------------
# Stage 2 for EAGLE-3: conversations of one or two turns. For a two-turn conversation the target
# writes the user's follow-up too (Magpie again, after its own first answer), then answers it, so
# that second turns like MT-bench's are in the data. Each record holds the whole conversation as
# the chat template encodes it, the three layers' inputs and the target's top keep_top next-token
# probabilities at every token, and which tokens are the assistant's (the ones learned).
# ---------------------------------------------------------------------------------------------
def next_user_prefix(tokenizer, messages):
    """The token ids of the conversation `messages` followed by the template's opening of the
    next user message (the Magpie prompt for a follow-up)."""
    a = tokenizer.apply_chat_template(messages + [{"role": "user", "content": "A"}], add_generation_prompt=False)
    b = tokenizer.apply_chat_template(messages + [{"role": "user", "content": "B"}], add_generation_prompt=False)
    n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return a[:n]


def answer_spans(ids, starts, stop_ids):
    """For each start (where an assistant answer begins), the span [start, end) up to and including
    the answer's stop token."""
    spans = []
    for start in starts:
        end = next((i + 1 for i in range(start, len(ids)) if ids[i] in stop_ids), len(ids))
        spans.append((start, end))
    return spans


def conversation_record(row, spans):
    """What a shard stores per conversation; learn[p]: the token after position p is an answer token."""
    learn = torch.zeros(len(row["ids"]), dtype=torch.bool)
    for start, end in spans:
        learn[start - 1:end - 1] = True
    return {"ids": torch.tensor(row["ids"], dtype=torch.int32), "features": row["features"],
            "top_ids": row["top_ids"], "top_probs": row["top_probs"], "learn": learn}


def make_conversations(model, tokenizer, preset: Preset, prompts: dict, data_dir: Path, seed: int,
                       layer_ids, max_batches: int | None = None):
    """Shards conv_NNNNN.pt of conversation records, one per generation batch, so that an
    interrupted run resumes where it stopped. Greedy and sampled (temperature 1) conversations
    come in separate batches, each batch of prompts of similar length."""
    jobs = [(split, text) for split in ("train", "val") for text in prompts[split]]
    rng = random.Random(seed)
    sampled = [rng.random() < preset.sampled_fraction for _ in jobs]
    two_turns = [rng.random() < preset.multi_turn_fraction for _ in jobs]
    chat = lambda messages, gen=True: tokenizer.apply_chat_template(messages, add_generation_prompt=gen)  # noqa: E731
    firsts = [chat([{"role": "user", "content": text}]) for _, text in jobs]
    order = sorted(range(len(jobs)), key=lambda i: (sampled[i], len(firsts[i])))
    batches = [order[i:i + preset.gen_batch] for i in range(0, len(order), preset.gen_batch)]
    # Batches run in a shuffled order so that a run cut short (--max_answer_batches) still sees
    # short and long prompts, greedy and sampled answers, train and validation prompts.
    random.Random(seed + 1).shuffle(batches)
    batches = batches[:max_batches]
    stop_ids = set(tokenizer.stop_ids)
    for n, batch in enumerate(tqdm(batches, desc="conversations", unit="batch")):
        shard = data_dir / f"conv_{n:05d}.pt"
        if shard.is_file():
            continue
        temperature = 1.0 if sampled[batch[0]] else 0.0
        torch.manual_seed(seed + n)
        turn1 = generate_batch(model, [firsts[i] for i in batch], preset.answer_max_tokens, temperature, None,
                               stop_ids, layer_ids, preset.keep_top)
        records, seconds = {}, []
        for j, i in enumerate(batch):
            finished = turn1[j]["ids"][-1] in stop_ids
            if two_turns[i] and finished:  # a cut-off answer gets no follow-up
                answer = tokenizer.decode(turn1[j]["ids"][len(firsts[i]):-1])
                seconds.append((j, [{"role": "user", "content": jobs[i][1]}, {"role": "assistant", "content": answer}]))
            else:
                records[j] = conversation_record(turn1[j], answer_spans(turn1[j]["ids"], [len(firsts[i])], stop_ids))
        if seconds:
            follow = generate_batch(model, [next_user_prefix(tokenizer, m) for _, m in seconds],
                                    preset.prompt_max_tokens, preset.prompt_temperature, preset.prompt_top_k,
                                    stop_ids, layer_ids=None)
            kept, seen = [], set()
            for (j, messages), row in zip(seconds, follow):
                text = row["ids"][len(next_user_prefix(tokenizer, messages)):]
                text = tokenizer.decode(text[:-1]).strip() if text and text[-1] in stop_ids else ""
                if text and keep_prompt(text, seen):
                    kept.append((j, messages + [{"role": "user", "content": text}]))
                else:  # no usable follow-up: keep the first turn alone
                    i = batch[j]
                    records[j] = conversation_record(turn1[j], answer_spans(turn1[j]["ids"], [len(firsts[i])], stop_ids))
            if kept:
                prompts2 = [chat(m) for _, m in kept]
                turn2 = generate_batch(model, prompts2, preset.answer_max_tokens, temperature, None, stop_ids,
                                       layer_ids, preset.keep_top)
                for (j, messages), prompt2, row in zip(kept, prompts2, turn2):
                    start1 = len(chat(messages[:1]))
                    records[j] = conversation_record(row, answer_spans(row["ids"], [start1, len(prompt2)], stop_ids))
        torch.save({"records": [records[j] for j in range(len(batch))],
                    "split": [jobs[i][0] for i in batch], "temperature": temperature}, shard)


def load_conversations(data_dir: Path):
    data = {"train": [], "val": []}
    for shard in sorted(data_dir.glob("conv_*.pt")):
        s = torch.load(shard, weights_only=True)
        for record, split in zip(s["records"], s["split"]):
            if record["learn"].any():
                data[split].append(record)
    return data


# ---------------------------------------------------------------------------------------------
# EAGLE-3's reduced vocabulary
# ---------------------------------------------------------------------------------------------
def token_counts(records, vocab_size: int) -> torch.Tensor:
    """How often each token is an answer token (a learned position's next token)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        ids = r["ids"].long()
        counts += torch.bincount(ids[1:][r["learn"][:-1]], minlength=vocab_size)
    return counts


def choose_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens, in ascending id order (ties: lower id first)."""
    order = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def vocab_coverage(records, vocab: torch.Tensor, vocab_size: int) -> float:
    """The share of the target's argmax tokens at learned positions that the vocabulary holds:
    guesses outside it cannot be drafted, so this bounds what the reduction costs."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    hit = total = 0
    for r in records:
        top1 = r["top_ids"][:, 0].long()[r["learn"]]
        hit += int(inside[top1].sum())
        total += top1.numel()
    return hit / max(1, total)


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


def make_batches(items, batch_tokens: int, shuffle: bool, rng: random.Random):
    """Length-sorted batches of at most batch_tokens padded tokens (items: (ids, ...) tuples)."""
    return make_batches_by_length([len(item[0]) for item in items], batch_tokens, shuffle, rng)


def make_batches_by_length(lengths, batch_tokens: int, shuffle: bool, rng: random.Random):
    """Batches of indices into lengths, length-sorted, of at most batch_tokens padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        longest = lengths[i]  # sorted by length: the newest item is the longest
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def collate(items, device):
    n = max(len(ids) for ids, _, _ in items)
    B, dim = len(items), items[0][1].size(-1)
    ids = torch.zeros(B, n, dtype=torch.long)
    feats = torch.zeros(B, n, dim)
    learn = torch.zeros(B, n, dtype=torch.bool)  # positions t whose next feature is an answer token's
    for b, (x, f, plen) in enumerate(items):
        ids[b, :len(x)], feats[b, :len(x)] = x, f.float()
        learn[b, plen - 1:len(x) - 1] = True
    return ids.to(device), feats.to(device), learn.to(device)


def draft_losses(draft, embed, head, ids, feats, learn, preset: Preset, noise: bool):
    """Per unrolled step: (weighted loss, SmoothL1, CE, top-1 accuracy of the predicted token).

    The CE target is the target's next-token distribution restricted to its ce_topk most probable
    tokens (renormalised; they hold nearly all of its mass). With z the draft's logits,
    CE = logsumexp(z) - sum_i p_i z_i needs z in full only for the logsumexp: no [tokens, vocab]
    products or copies, which dominated a training step with a 49k vocabulary on a CPU."""
    B, n = ids.shape
    m = n - 1  # draft positions t = 0 .. n-2: input (f_t, x_{t+1}), target f_{t+1}
    x_next = embed(ids[:, 1:])
    target = feats[:, 1:]
    learn = learn[:, :m]
    # The CE runs on a random share of the learned positions: through a 49k-vocabulary head it
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


@torch.no_grad()
def validate(draft, target, data, preset: Preset, device, autocast):
    draft.eval()
    sums, count = None, 0
    for batch in make_batches(data, preset.batch_tokens, False, random.Random(0)):
        ids, feats, learn = collate([data[i] for i in batch], device)
        with autocast():
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
    vocabulary; learn [B, n]: positions whose next token is an answer token the draft can say
    (the target's argmax lies in its vocabulary, as the reference masks)."""
    n = max(len(r["ids"]) for r in items)
    B, F_, K = len(items), items[0]["features"].size(-1), items[0]["top_ids"].size(-1)
    ids = torch.zeros(B, n, dtype=torch.long)
    feats = torch.zeros(B, n, F_)
    top_idx = torch.full((B, n, K), -1, dtype=torch.long)
    top_p = torch.zeros(B, n, K)
    learn = torch.zeros(B, n, dtype=torch.bool)
    for b, r in enumerate(items):
        m = len(r["ids"])
        ids[b, :m], feats[b, :m] = r["ids"].long(), r["features"].float()
        top_idx[b, :m] = draft_index[r["top_ids"].long()]
        top_p[b, :m] = r["top_probs"].float()
        learn[b, :m] = r["learn"]
    top_p = top_p * (top_idx >= 0)
    learn &= top_idx[..., 0] >= 0
    top_p = top_p / top_p.sum(-1, keepdim=True).clamp(min=1e-12)
    return ids.to(device), feats.to(device), top_idx.to(device), top_p.to(device), learn.to(device)


def _shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, k:] padded at the end to x's length: index t of the result holds x[:, t + k]."""
    if k == 0:
        return x
    pad = x.new_full((x.size(0), k, *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


def eagle3_losses(draft, embed, ids, feats, top_idx, top_p, learn, preset: Preset):
    """Per unrolled step k = 0 .. unroll - 1: (weighted loss, soft CE, top-1 accuracy)."""
    B, n = ids.shape
    layer, attn = draft.layer, draft.layer.attention
    H, KV, D = attn.n_head, attn.n_local_heads, attn.head_dim
    G = H // KV
    t = torch.arange(n, device=ids.device)
    causal = t[None, :] <= t[:, None]  # step-0 keys visible from index t
    h = draft.fc(feats.to(draft.fc.weight.dtype))
    keys, values, results = [], [], []
    for k in range(preset.unroll):
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
        logp = torch.log_softmax(draft.lm_head(draft.norm(h)).float(), dim=-1)
        # the target at position t + k + 1; positions past the end learn nothing
        sel = _shift(learn, k + 1, False) & (t + k + 1 < n)
        idx, p = _shift(top_idx, k + 1, -1)[sel], _shift(top_p, k + 1, 0.0)[sel]
        logp = logp[sel]
        ce = -(p * logp.gather(1, idx.clamp(min=0))).sum(-1).mean()
        acc = (logp.argmax(-1) == idx[:, 0]).float().mean()
        results.append((preset.unroll_decay ** k * ce, ce.detach(), acc.detach()))
    return results


@torch.no_grad()
def validate3(draft, target, data, preset: Preset, device, autocast, draft_index):
    draft.eval()
    sums, count = None, 0
    for batch in make_batches_by_length([len(r["ids"]) for r in data], preset.batch_tokens, False, random.Random(0)):
        with autocast():
            res = eagle3_losses(draft, target.tok_embeddings, *collate3([data[i] for i in batch], device, draft_index),
                                preset)
        vals = torch.tensor([[ce, acc] for _, ce, acc in res])
        sums = vals * len(batch) if sums is None else sums + vals * len(batch)
        count += len(batch)
    draft.train()
    return sums / count  # [unroll, 2]: soft CE, accuracy per step


@torch.no_grad()
def measure_tau(target, draft, tokenizer, prompts, max_new_tokens=96, **tree):
    """Mean accepted tokens per round of real EAGLE-2-tree decoding (greedy) on a few prompts; None
    when no round ran (every answer stopped at its first token, as a barely trained tiny target's may)."""
    draft = copy.deepcopy(draft).to(target.norm.weight.dtype)  # decode in the target's dtype
    draft.max_seq_length = -1  # training replaced the draft's KV cache: let the Speculator make one
    spec = Speculator(target, draft, stop_ids=tokenizer.stop_ids, **tree)
    rounds = []
    for text in prompts:
        prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": text}])],
                              device=target.norm.weight.device)
        _, per_round = speculative_generate(spec, prompt, max_new_tokens)
        rounds += per_round[0]
    return sum(rounds) / len(rounds) if rounds else None


def setup_for_training(draft, max_len: int):
    """RoPE tables for sequences of up to max_len tokens; the KV cache is swapped per batch."""
    draft.max_seq_length = -1
    draft.setup_caches(1, max_len)


def train(target, tokenizer, data, prompts, preset: Preset, args, vocab=None):
    """The training loop of both architectures: AdamW, warm-up then cosine, clipping by value,
    bf16 autocast, validation and tau after every epoch, resumable from the last finished epoch.
    vocab: EAGLE-3's draft vocabulary (target ids, ascending)."""
    device = target.norm.weight.device
    torch.manual_seed(args.seed)
    eagle3 = args.arch == "eagle3"
    if eagle3:
        draft = Eagle3Draft(draft_config_for(target.config), len(vocab), eagle3_layer_ids(target.config.n_layer))
        draft.vocab.copy_(vocab)
        draft_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)  # target id -> draft index
        draft_index[vocab] = torch.arange(len(vocab))
        length = lambda item: len(item["ids"])  # noqa: E731
    else:
        draft = EagleDraft(draft_config_for(target.config), fc_bias=args.fc_bias)
        length = lambda item: len(item[0])  # noqa: E731
    draft = draft.to(device).train()
    lengths = [length(item) for item in data["train"]]
    setup_for_training(draft, max(lengths + [length(item) for item in data["val"]]) + preset.unroll + 1)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay)
    rng = random.Random(args.seed)
    steps_per_epoch = len(make_batches_by_length(lengths, preset.batch_tokens, False, rng))
    total = preset.epochs * steps_per_epoch

    def lr_at(step):  # linear warm-up, then cosine to 10%
        if step < preset.warmup_steps:
            return (step + 1) / preset.warmup_steps
        progress = (step - preset.warmup_steps) / max(1, total - preset.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    state_file = args.work_dir / "train_state.pt"
    start_epoch, step, history = 0, 0, []
    if state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, step, history = state["epoch"], state["step"], state["history"]
        rng.setstate(state["rng"])
        print(f"resuming at epoch {start_epoch}, step {step}", file=sys.stderr)
    use_bf16 = args.dtype == "bfloat16"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    val_prompts = prompts["val"][:args.tau_prompts]
    t_start = time.time()
    for epoch in range(start_epoch, preset.epochs):
        batches = make_batches_by_length(lengths, preset.batch_tokens, True, rng)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{preset.epochs}", unit="batch")
        for batch in bar:
            items = [data["train"][i] for i in batch]
            with autocast():
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
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{r[-1].item():.2f}" for r in res),
                            lr=f"{sched.get_last_lr()[0]:.1e}")
        record = {"epoch": epoch + 1, "step": step, "minutes": (time.time() - t_start) / 60}
        if eagle3:
            val = validate3(draft, target, data["val"], preset, device, autocast, draft_index)
            record.update(val_ce=val[:, 0].tolist(), val_acc=val[:, 1].tolist())
        else:
            val = validate(draft, target, data["val"], preset, device, autocast)
            record.update(val_smooth_l1=val[:, 0].tolist(), val_ce=val[:, 1].tolist(), val_acc=val[:, 2].tolist())
        if val_prompts:
            draft.eval()
            record["val_tau"] = measure_tau(target, draft, tokenizer, val_prompts, tree_depth=preset.tau_depth)
            draft.train()
        history.append(record)
        print(json.dumps(record), file=sys.stderr)
        torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "epoch": epoch + 1, "step": step, "history": history, "rng": rng.getstate()}, state_file)
    return draft.eval(), history


# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint_path", type=Path, required=True, help="the target's model.pth")
    p.add_argument("--arch", choices=sorted(PRESETS), default="eagle",
                   help="eagle: an EAGLE-1/2 head (the target's features and LM head); eagle3: an EAGLE-3 head "
                        "(three fused layers, a reduced vocabulary, training-time test)")
    p.add_argument("--preset", choices=sorted(PRESETS["eagle"]), default="smollm2-cpu")
    p.add_argument("--out_dir", type=Path, required=True, help="where the trained head is written")
    p.add_argument("--work_dir", type=Path, default=None, help="data and resumable state (default: OUT_DIR.work)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="target for data generation, and training autocast")
    p.add_argument("--fc_bias", action=argparse.BooleanOptionalAction, default=True,
                   help="a bias on fc (EAGLE's LLaMA-2/Vicuna heads have one, LLaMA-3 heads not)")
    p.add_argument("--tau_prompts", type=int, default=6, help="validation prompts decoded for tau after each epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab_report", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768],
                   help="eagle3: draft vocabulary sizes whose coverage of held-out answers is reported")
    p.add_argument("--max_answer_batches", type=int, default=None,
                   help="answer only the first N generation batches; trains on less data when time is short")
    p.add_argument("--force", action="store_true", help="overwrite an existing head in OUT_DIR")
    for name, field in Preset.__dataclass_fields__.items():  # every preset value can be overridden
        p.add_argument(f"--{name}", type=type(field.default), default=None)
    args = p.parse_args(argv)
    if not args.checkpoint_path.is_file():
        p.error(f"checkpoint not found: {args.checkpoint_path}")
    if (args.out_dir / "draft.safetensors").exists() and not args.force:
        p.error(f"{args.out_dir} already holds a head; pass --force to replace it")
    args.work_dir = args.work_dir or args.out_dir.with_name(args.out_dir.name + ".work")
    preset = PRESETS[args.arch][args.preset]
    overrides = {k: getattr(args, k) for k in Preset.__dataclass_fields__ if getattr(args, k) is not None}
    return args, Preset(**{**asdict(preset), **overrides})


def main(argv=None):
    args, preset = parse_args(argv)
    t0 = time.time()
    data_dir = args.work_dir / ("data3" if args.arch == "eagle3" else "data")
    data_dir.mkdir(parents=True, exist_ok=True)
    target = load_model(args.checkpoint_path, args.device, getattr(torch, args.dtype))
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)

    prompts = make_prompts(target, tokenizer, preset, args.work_dir / "prompts.json", args.seed)
    times = {"data_minutes": None}
    vocab, info_vocab = None, {}
    if args.arch == "eagle3":
        layer_ids = eagle3_layer_ids(target.config.n_layer)
        make_conversations(target, tokenizer, preset, prompts, data_dir, args.seed, layer_ids, args.max_answer_batches)
        data = load_conversations(data_dir)
        n_tokens = sum(len(r["ids"]) for r in data["train"])
        counts = token_counts(data["train"], target.config.vocab_size)
        coverage = {size: vocab_coverage(data["val"], choose_vocab(counts, size), target.config.vocab_size)
                    for size in sorted(set(args.vocab_report) | {preset.draft_vocab_size})
                    if size <= target.config.vocab_size}
        vocab = choose_vocab(counts, preset.draft_vocab_size)
        info_vocab = {"draft_vocab_size": preset.draft_vocab_size, "layer_ids": list(layer_ids),
                      "coverage_of_val_argmax": {str(k): v for k, v in coverage.items()},
                      "two_turn_conversations": sum(int((r["learn"][1:] & ~r["learn"][:-1]).sum()) > 1
                                                    for r in data["train"])}
        print("draft vocabulary coverage of held-out target argmax tokens: "
              + ", ".join(f"{k}: {v:.2%}" for k, v in coverage.items()), file=sys.stderr)
    else:
        make_shards(target, tokenizer, preset, prompts, data_dir, args.seed, args.max_answer_batches)
        data = load_shards(data_dir)
        n_tokens = sum(len(ids) for ids, _, _ in data["train"])
    times["data_minutes"] = (time.time() - t0) / 60
    print(f"data: {len(data['train'])} train / {len(data['val'])} val conversations, {n_tokens} train tokens, "
          f"{times['data_minutes']:.1f} min so far", file=sys.stderr)
    target.max_seq_length = -1  # generation's caches are no longer needed
    target.kv_storage = None
    for layer in target.layers:
        layer.attention.kv_cache = None

    draft, history = train(target, tokenizer, data, prompts, preset, args, vocab)
    save_draft(draft, args.out_dir, dtype=torch.bfloat16)
    info = {"command": " ".join(sys.argv), "arch": args.arch, "preset": args.preset, "settings": asdict(preset),
            "target": str(args.checkpoint_path), "device": args.device, "dtype": args.dtype,
            "hardware": platform.processor() or platform.machine(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "data": {"train_conversations": len(data["train"]), "val_conversations": len(data["val"]),
                     "train_tokens": n_tokens, "prompt_samples": prompts.get("attempts"), **info_vocab},
            "hours": (time.time() - t0) / 3600, **times, "history": history}
    (args.out_dir / "training.json").write_text(json.dumps(info, indent=1))
    print(f"wrote {args.out_dir} in {info['hours']:.2f} h", file=sys.stderr)


if __name__ == "__main__":
    main()
