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
from draft import EagleDraft, draft_config_for  # noqa: E402
from sampling import sample  # noqa: E402
from speculative import Speculator, speculative_generate  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


@dataclass
class Preset:
    n_prompts: int = 6000        # prompts kept after filtering
    val_fraction: float = 0.05   # held out for validation
    prompt_max_tokens: int = 96
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.98
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


PRESETS = {
    # SmolLM2-135M on a 2-core CPU (bf16 matmuls). The shipped head: prompts ~0.5 h, answers of the
    # first 32 of 47 batches (--max_answer_batches 32, 1.15M tokens) 47 min, 6 epochs 64 min.
    "smollm2-cpu": Preset(),
    # A GPU: more data and epochs; the 135M target trains in minutes, a 7B one in hours.
    "gpu": Preset(n_prompts=40000, answer_max_tokens=768, gen_batch=256, epochs=10, batch_tokens=32768,
                  lr=3e-4, warmup_steps=500, unroll=3),
    # Seconds, for tests.
    "tiny": Preset(n_prompts=24, prompt_max_tokens=12, answer_max_tokens=16, gen_batch=8, epochs=2,
                   batch_tokens=256, lr=3e-3, warmup_steps=2, val_fraction=0.25),
}


# ---------------------------------------------------------------------------------------------
# Batched generation with per-row prompt lengths: rows are right-padded, each row's positions
# and cache slots continue from its own length (model.py takes them per row), so a pad slot is
# overwritten by that row's next token before the row ever attends to it.
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_batch(model, prompts, max_new_tokens, temperature, top_p, stop_ids):
    """prompts: lists of ids. Returns (ids, features) per row: prompt + answer (cut after the first
    stop token) and the target's features at every one of those tokens, float16 on the CPU."""
    device = model.norm.weight.device
    B, lengths = len(prompts), torch.tensor([len(p) for p in prompts], device=device)
    L = int(lengths.max())
    model.setup_caches(B, L + max_new_tokens + 1)
    padded = torch.tensor([p + [0] * (L - len(p)) for p in prompts], device=device)
    logits, features, _ = model(padded, torch.arange(L, device=device), return_features=True)
    rows = torch.arange(B, device=device)
    steps_tokens, steps_features = [], []
    token = sample(logits[rows, lengths - 1], temperature, None, top_p)
    stop = torch.tensor(sorted(stop_ids), device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    pos = lengths.clone()
    for step in range(max_new_tokens):
        # Feeding the token gives its feature (needed as the last training target) and the next token.
        logits, feats, _ = model(token[:, None], pos[:, None], return_features=True)
        steps_tokens.append(token)
        steps_features.append(feats[:, 0])
        done |= torch.isin(token, stop)
        if step % 8 == 7 and bool(done.all()):
            break
        token = sample(logits[:, -1], temperature, None, top_p)
        pos += 1
    new_tokens = torch.stack(steps_tokens, 1).cpu()
    new_features = torch.stack(steps_features, 1).half().cpu()
    features = features.half().cpu()
    out = []
    for b in range(B):
        answer = new_tokens[b].tolist()
        n = next((i + 1 for i, t in enumerate(answer) if t in stop_ids), len(answer))
        out.append((prompts[b] + answer[:n],
                    torch.cat([features[b, :len(prompts[b])], new_features[b, :n]])))
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
    if path.is_file():
        return json.loads(path.read_text())
    prefix = user_turn_prefix(tokenizer)
    stop_ids = set(tokenizer.stop_ids)
    prompts, seen = [], set()
    torch.manual_seed(seed)
    bar = tqdm(total=preset.n_prompts, desc="prompts", unit="prompt")
    attempts = 0
    while len(prompts) < preset.n_prompts:
        attempts += preset.gen_batch
        if attempts > 20 * preset.n_prompts + 10 * preset.gen_batch:
            raise RuntimeError(f"only {len(prompts)} usable prompts after {attempts} samples: is the chat "
                               f"template right for this model?")
        for ids, _ in generate_batch(model, [prefix] * preset.gen_batch, preset.prompt_max_tokens,
                                     preset.prompt_temperature, preset.prompt_top_p, stop_ids):
            answer = ids[len(prefix):]
            if not answer or answer[-1] not in stop_ids:
                continue  # ran out of tokens: a truncated message
            text = tokenizer.decode(answer[:-1]).strip()
            if keep_prompt(text, seen) and len(prompts) < preset.n_prompts:
                prompts.append(text)
                bar.update(1)
    bar.close()
    random.Random(seed).shuffle(prompts)
    n_val = max(1, int(preset.val_fraction * len(prompts)))
    split = {"train": prompts[n_val:], "val": prompts[:n_val], "attempts": attempts}
    path.write_text(json.dumps(split, indent=1))
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
        torch.save({"ids": [torch.tensor(ids, dtype=torch.int32) for ids, _ in results],
                    "features": [f for _, f in results],
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
    """Length-sorted batches of at most batch_tokens padded tokens."""
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    batches, current = [], []
    for i in order:
        longest = len(items[i][0])  # sorted by length: the newest item is the longest
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


@torch.no_grad()
def measure_tau(target, draft, tokenizer, prompts, max_new_tokens=96, **tree):
    """Mean accepted tokens per round of real eagle2 decoding (greedy) on a few prompts."""
    draft = copy.deepcopy(draft).to(target.norm.weight.dtype)  # decode in the target's dtype
    draft.max_seq_length = -1  # training replaced the draft's KV cache: let the Speculator make one
    spec = Speculator(target, draft, stop_ids=tokenizer.stop_ids, **tree)
    rounds = []
    for text in prompts:
        prompt = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": text}])],
                              device=target.norm.weight.device)
        _, per_round = speculative_generate(spec, prompt, max_new_tokens)
        rounds += per_round[0]
    return sum(rounds) / len(rounds)


def setup_for_training(draft, max_len: int):
    """RoPE tables for sequences of up to max_len tokens; the KV cache is swapped per batch."""
    draft.max_seq_length = -1
    draft.setup_caches(1, max_len)


def train(target, tokenizer, data, prompts, preset: Preset, args):
    device = target.norm.weight.device
    torch.manual_seed(args.seed)
    draft = EagleDraft(draft_config_for(target.config), fc_bias=args.fc_bias).to(device).train()
    max_len = max(len(ids) for ids, _, _ in data["train"] + data["val"])
    setup_for_training(draft, max_len)
    opt = torch.optim.AdamW(draft.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay)
    rng = random.Random(args.seed)
    steps_per_epoch = len(make_batches(data["train"], preset.batch_tokens, False, rng))
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
        batches = make_batches(data["train"], preset.batch_tokens, True, rng)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{preset.epochs}", unit="batch")
        for batch in bar:
            ids, feats, learn = collate([data["train"][i] for i in batch], device)
            with autocast():
                res = draft_losses(draft, target.tok_embeddings, target.output, ids, feats, learn, preset, noise=True)
            loss = sum(r[0] for r in res)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(draft.parameters(), preset.grad_clip)
            opt.step()
            sched.step()
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{r[3].item():.2f}" for r in res),
                            lr=f"{sched.get_last_lr()[0]:.1e}")
        val = validate(draft, target, data["val"], preset, device, autocast)
        record = {"epoch": epoch + 1, "step": step, "minutes": (time.time() - t_start) / 60,
                  "val_smooth_l1": val[:, 0].tolist(), "val_ce": val[:, 1].tolist(), "val_acc": val[:, 2].tolist()}
        if val_prompts:
            draft.eval()
            record["val_tau_eagle2"] = measure_tau(target, draft, tokenizer, val_prompts)
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
    p.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-cpu")
    p.add_argument("--out_dir", type=Path, required=True, help="where the trained head is written")
    p.add_argument("--work_dir", type=Path, default=None, help="data and resumable state (default: OUT_DIR.work)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="target for data generation, and training autocast")
    p.add_argument("--fc_bias", action=argparse.BooleanOptionalAction, default=True,
                   help="a bias on fc (EAGLE's LLaMA-2/Vicuna heads have one, LLaMA-3 heads not)")
    p.add_argument("--tau_prompts", type=int, default=6, help="validation prompts decoded for tau after each epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_answer_batches", type=int, default=None,
                   help="answer only the first N generation batches (greedy answers come first, sorted by "
                        "prompt length); trains on less data when time is short")
    p.add_argument("--force", action="store_true", help="overwrite an existing head in OUT_DIR")
    for name, field in Preset.__dataclass_fields__.items():  # every preset value can be overridden
        p.add_argument(f"--{name}", type=type(field.default), default=None)
    args = p.parse_args(argv)
    if not args.checkpoint_path.is_file():
        p.error(f"checkpoint not found: {args.checkpoint_path}")
    if (args.out_dir / "draft.safetensors").exists() and not args.force:
        p.error(f"{args.out_dir} already holds a head; pass --force to replace it")
    args.work_dir = args.work_dir or args.out_dir.with_name(args.out_dir.name + ".work")
    preset = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in Preset.__dataclass_fields__ if getattr(args, k) is not None}
    return args, Preset(**{**asdict(preset), **overrides})


def main(argv=None):
    args, preset = parse_args(argv)
    t0 = time.time()
    (args.work_dir / "data").mkdir(parents=True, exist_ok=True)
    target = load_model(args.checkpoint_path, args.device, getattr(torch, args.dtype))
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = load_tokenizer(args.checkpoint_path.parent)

    prompts = make_prompts(target, tokenizer, preset, args.work_dir / "prompts.json", args.seed)
    make_shards(target, tokenizer, preset, prompts, args.work_dir / "data", args.seed,
                args.max_answer_batches)
    data = load_shards(args.work_dir / "data")
    n_tokens = sum(len(ids) for ids, _, _ in data["train"])
    print(f"data: {len(data['train'])} train / {len(data['val'])} val conversations, {n_tokens} train tokens, "
          f"{(time.time() - t0) / 60:.1f} min so far", file=sys.stderr)
    target.max_seq_length = -1  # generation's caches are no longer needed
    for layer in target.layers:
        layer.attention.kv_cache = None

    draft, history = train(target, tokenizer, data, prompts, preset, args)
    save_draft(draft, args.out_dir, dtype=torch.bfloat16)
    info = {"command": " ".join(sys.argv), "preset": args.preset, "settings": asdict(preset),
            "target": str(args.checkpoint_path), "device": args.device, "dtype": args.dtype,
            "hardware": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "data": {"train_conversations": len(data["train"]), "val_conversations": len(data["val"]),
                     "train_tokens": n_tokens, "prompt_samples": prompts.get("attempts")},
            "hours": (time.time() - t0) / 3600, "history": history}
    (args.out_dir / "training.json").write_text(json.dumps(info, indent=1))
    print(f"wrote {args.out_dir} in {info['hours']:.2f} h", file=sys.stderr)


if __name__ == "__main__":
    main()
