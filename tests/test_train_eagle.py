"""scripts/train_eagle.py: batched self-distillation data, the unrolled training graph matching
what the draft sees in a tree, and training that actually helps speculative decoding."""
import copy
import json
import random

import numpy as np
import pytest
import torch

import checkpoint
import generate as gen
import speculative
import train_eagle as te
from checkpoint import load_draft
from conftest import random_draft, tiny_target
from draft import Eagle3Draft, draft_config_for
from tokenizer import load_tokenizer


@torch.no_grad()
def test_generate_batch_rows_of_different_lengths_equal_single_runs():
    """Right-padded rows with their own positions, rows leaving the batch once they stop, one
    greedy and one sampled temperature per row: each row's ids equal a single-row run's."""
    model = tiny_target("tiny-llama", seed=3)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 9, 2, 7, 3, 4)]
    model.setup_caches(1, 64)
    free = [gen.generate(model, torch.tensor([p]), 24)[0] for p in prompts]
    stop = {free[0][2], free[1][9], free[3][12]}  # rows stop at different steps: the batch shrinks
    rows = te.generate_batch(model, prompts, 24, [0.0] * 5 + [1.0], None, stop, chunk=4)
    assert sum(len(r) - len(p) < 24 for r, p in zip(rows, prompts)) >= 2
    for prompt, row in zip(prompts[:5], rows):
        model.setup_caches(1, 64)
        assert row == prompt + gen.generate(model, torch.tensor([prompt]), 24, stop_ids=stop)[0]
    assert rows[5][:len(prompts[5])] == prompts[5] and len(rows[5]) > len(prompts[5])


def test_sample_rows_greedy_rows_and_top_k_draws():
    """Greedy rows take the argmax; sampled rows draw among their top_k tokens with the softmax of
    those logits over temperature."""
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]]).repeat(4000, 1)
    temps = torch.tensor([0.0, 1.0]).repeat(2000)
    tokens = te.sample_rows(logits, temps, top_k=2)
    assert (tokens[0::2] == 1).all()
    drawn = tokens[1::2]
    assert set(drawn.tolist()) <= {1, 2}
    p1 = torch.softmax(torch.tensor([2.0, 1.0]), 0)[0].item()
    assert abs((drawn == 1).float().mean().item() - p1) < 0.04  # 2000 draws: 4 standard deviations
    assert torch.equal(te.sample_rows(logits[:3], 0.0, None), torch.tensor([1, 1, 1]))


@torch.no_grad()
def test_target_features_equal_a_forward_of_each_sequence():
    """Teacher-forced features of sequences batched with padding equal each sequence's own forward:
    the final feature, or the three layers' inputs and the top next tokens (EAGLE-3)."""
    model = tiny_target("tiny-llama", seed=3, n_layer=4)
    seqs = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 9)]
    final = te.target_features(model, seqs, max_tokens=40)  # two forwards: 9 + 5 padded to 9, then 17
    fused = te.target_features(model, seqs, layer_ids=(0, 2, 3), keep_top=4)
    for ids, f, g in zip(seqs, final, fused):
        model.setup_caches(1, len(ids))
        logits, expected, layers = model(torch.tensor([ids]), torch.arange(len(ids)), return_features=True,
                                         layer_ids=(0, 2, 3))
        torch.testing.assert_close(f["features"].float(), expected[0], atol=2e-3, rtol=2e-3)  # float16
        torch.testing.assert_close(g["features"].float(), torch.cat(layers, -1)[0], atol=2e-3, rtol=2e-3)
        top = torch.softmax(logits[0], -1).topk(4)
        assert torch.equal(g["top_ids"], top.indices)
        torch.testing.assert_close(g["top_probs"].float(), top.values, atol=1e-3, rtol=1e-3)


def test_next_user_prefix_and_prompt_filter(smollm2_checkpoint):
    tokenizer = load_tokenizer(smollm2_checkpoint)
    prefix = tokenizer.decode(te.next_user_prefix(tokenizer, []))
    assert prefix.endswith("<|im_end|>\n<|im_start|>user\n") and "SmolLM" in prefix
    seen = set()
    assert te.keep_prompt("How do I bake bread at home?", seen)
    assert not te.keep_prompt("How do I bake bread at home?", seen)  # duplicate
    assert not te.keep_prompt("Hi there", seen)  # too short
    assert not te.keep_prompt("go go go go go go go go go go go go", seen)  # a loop
    assert not te.keep_prompt("1234 5678 9012 3456 7890", seen)  # no words
    assert not te.keep_prompt("Tell me <|im_start|> something", seen)


def test_unrolled_mask_is_the_tree_view():
    m = te.unrolled_mask(5, 3, "cpu")  # queries: step-3 entries; keys: steps 1, 2, 3 (5 each)
    t = 4
    assert m[t, :5].nonzero().flatten().tolist() == [0, 1, 2]  # true entries up to t - 2
    assert m[t, 5:10].nonzero().flatten().tolist() == [3]      # its step-2 guess at t - 1
    assert m[t, 10:].nonzero().flatten().tolist() == [4]       # itself


@torch.no_grad()
def test_unrolled_training_step_equals_the_draft_inside_a_tree():
    """Step k's output at position t, computed in one pass during training, equals the draft run
    as a depth-(k-1) tree node at inference: true prefix entries, then its own chain of guesses."""
    target = tiny_target("tiny-llama", seed=4)
    draft = random_draft(target, std=0.2)
    n, steps = 12, 3
    ids = torch.randint(0, 512, (1, n))
    feats = torch.randn(1, n, 64)
    m = n - 1
    te.setup_for_training(draft, n)
    draft.layer.attention.kv_cache = te.GrowingKV()
    x_next, pos = target.tok_embeddings(ids[:, 1:]), torch.arange(m)
    preds, inputs = [], feats[:, :m]
    for step in range(1, steps + 1):
        if step > 1:
            inputs = torch.cat([preds[-1][:, :1], preds[-1][:, :-1]], 1)
        preds.append(draft(x_next, inputs, pos, pos, te.unrolled_mask(m, step, "cpu")[None]))

    for step in range(1, steps + 1):
        for t in range(step - 1, m):
            ref = copy.deepcopy(draft)
            ref.max_seq_length = -1
            ref.setup_caches(1, n)
            start = t - step + 1  # true entries 0 .. start
            h = ref(x_next[:, :start + 1], feats[:, :start + 1], torch.arange(start + 1))[:, -1:]
            for p in range(start + 1, t + 1):  # the chain of guesses, one token at a time
                h = ref(x_next[:, p:p + 1], h, torch.tensor([p]))
            scale = float(h.abs().max())  # deep chains of random layers grow to ~100: compare relatively
            torch.testing.assert_close(preds[step - 1][0, t], h[0, 0], atol=3e-5 * scale, rtol=1e-4)


def synthetic_data(target, n_conv, seed):
    """The target's own greedy continuations of random prompts, as the data stage makes them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_conv)]
    seqs = te.generate_batch(target, prompts, 40, 0.0, None, set())
    feats = te.target_features(target, seqs)
    records = []
    for s, f, p in zip(seqs, feats, prompts):  # load_conversations' form: learn[t], the token after t is an answer's
        learn = np.zeros(len(s), dtype=bool)
        learn[len(p) - 1:len(s) - 1] = True
        records.append({"ids": np.array(s), "features": f["features"].numpy(), "learn": learn, "turns": 1,
                        "prompt": np.array(s[:len(p)])})
    return records


def test_training_lowers_the_loss_and_raises_tau():
    target = tiny_target("tiny-llama", seed=5)
    for p in target.parameters():
        p.requires_grad_(False)
    data = synthetic_data(target, 96, seed=0)
    held_out = synthetic_data(target, 8, seed=1)
    preset = te.Preset(batch_tokens=1024, lr=3e-3, unroll=2, noise=0.0)
    torch.manual_seed(0)
    draft = random_draft(target, seed=2, fc_bias=True).train()
    untrained = copy.deepcopy(draft).eval()
    te.setup_for_training(draft, 64)
    opt = torch.optim.AdamW(draft.parameters(), lr=preset.lr)
    rng = random.Random(0)

    def val_loss():
        return sum(te.validate(draft, target, held_out, preset, "float32")["val_smooth_l1"])

    before = val_loss()
    for epoch in range(12):
        for batch in te.make_batches(data, preset.batch_tokens, True, rng):
            ids, feats, learn = te.collate([data[i] for i in batch], "cpu")
            loss = sum(r[0] for r in te.draft_losses(draft, target.tok_embeddings, target.output, ids, feats,
                                                      learn, preset, noise=False))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert val_loss() < 0.5 * before

    def tau(d):
        d.max_seq_length = -1  # training swapped its KV cache out: the Speculator makes a new one
        spec = speculative.Speculator(target, d.eval(), tree_top_k=4, tree_depth=4, tree_tokens=16)
        rounds = []
        for r in held_out:
            rounds += speculative.speculative_generate(spec, torch.tensor(r["prompt"])[None], 30)[1][0]
        return sum(rounds) / len(rounds)

    trained_tau, random_tau = tau(draft), tau(untrained)
    assert trained_tau > random_tau + 0.5, (trained_tau, random_tau)


def test_end_to_end_on_a_tiny_checkpoint(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """The whole script on a tiny random model (whose 'prompts' are noise: the quality filter is
    relaxed here, it has a test of its own): data, training, a loadable head, and a rerun that
    reuses the cached data and refuses to overwrite the head without --force."""
    from convert_hf_checkpoint import convert_hf

    model_path = convert_hf(tiny_hf_checkpoint("qwen2"), dtype="float32")
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()))
    out = tmp_path / "head"
    argv = ["--checkpoint_path", str(model_path), "--preset", "tiny", "--out_dir", str(out), "--dtype", "float32",
            "--tau_prompts", "1", "--prompt_max_tokens", "64"]
    te.main(argv)
    info = json.loads((out / "training.json").read_text())
    assert info["data"]["train_conversations"] > 0 and len(info["history"]) == 2
    assert "val_tau" in info["history"][-1]
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    head = load_draft(out, target.config)
    assert head.fc_bias and "embed" not in " ".join(head.state_dict())  # the target's tables are not stored
    with pytest.raises(SystemExit):
        te.main(argv)  # the head exists: no overwrite without --force
    shards = sorted((tmp_path / "head.work" / "conversations").glob("conv_*.npz"))
    assert len(shards) == 3
    stamp = [s.stat().st_mtime for s in shards]
    with pytest.raises(SystemExit):
        te.main(argv + ["--force"])  # a training state exists: continue it (--resume) or delete it
    te.main(argv + ["--force", "--resume"])
    assert [s.stat().st_mtime for s in shards] == stamp  # data reused, not regenerated


# ---------------------------------------------------------------------------------------------
# EAGLE-3
# ---------------------------------------------------------------------------------------------
def tiny_eagle3_checkpoint(tiny_hf_checkpoint):
    """A tiny random qwen2 checkpoint whose target ends its turns now and then (a stronger stop
    token row in its tied embedding / LM head), so that conversations have second turns."""
    from convert_hf_checkpoint import convert_hf

    model_path = convert_hf(tiny_hf_checkpoint("qwen2"), dtype="float32")
    state = torch.load(model_path)
    stop = load_tokenizer(model_path.parent).stop_ids[0]
    state["tok_embeddings.weight"][stop] *= 4
    torch.save(state, model_path)
    return model_path


def eagle3_argv(model_path, out, *extra):
    return ["--arch", "eagle3", "--checkpoint_path", str(model_path), "--preset", "tiny", "--out_dir", str(out),
            "--dtype", "float32", "--prompt_max_tokens", "64", "--multi_turn_fraction", "1.0",
            "--answer_max_tokens", "64", *extra]


def test_eagle3_end_to_end_on_a_tiny_checkpoint(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """--arch eagle3: two-turn conversations kept as token ids, their features recomputed by a
    teacher-forced forward, a reduced vocabulary with its coverage, training that lowers the soft
    cross-entropy, and a head that loads as an Eagle3Draft and decodes exactly as vanilla."""
    from draft import Eagle3Draft

    model_path = tiny_eagle3_checkpoint(tiny_hf_checkpoint)
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()))
    out = tmp_path / "head3"
    argv = eagle3_argv(model_path, out, "--tau_prompts", "1", "--epochs", "3")
    te.main(argv)
    info = json.loads((out / "training.json").read_text())
    assert info["arch"] == "eagle3" and info["data"]["two_turn_conversations"] > 0
    assert info["data"]["shards"] == ["conv_00000.npz", "conv_00001.npz", "conv_00002.npz"]
    assert set(info["data"]["coverage_of_val_argmax"]) == {"64", "128", "256"}
    coverage = [info["data"]["coverage_of_val_argmax"][k] for k in ("64", "128", "256")]
    assert coverage == sorted(coverage) and 0 < coverage[-1] <= 1  # a bigger vocabulary covers more
    epochs = [h for h in info["history"] if h["epoch_end"]]
    assert len(epochs) == 3 and epochs[-1]["val_ce"][0] < epochs[0]["val_ce"][0]
    assert all(0 <= a <= b <= 1 for h in epochs for a, b in zip(h["val_acc"], h["val_acc_in_vocab"]))
    assert info["shipped_step"] is not None and info["steps"] == epochs[-1]["step"]
    assert all((tmp_path / "head3.work" / f"epoch_{e:02d}" / "draft.safetensors").is_file() for e in (1, 2, 3))
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    work = tmp_path / "head3.work"
    convs = te.load_conversation_shard(work / "conversations" / "conv_00000.npz")
    meta = json.loads(str(te.load_conversation_arrays(work / "conversations" / "conv_00000.npz")["meta"]))
    assert meta["dtype"] == "float32" and meta["shard"] == 0  # what generated it, kept with it
    feats = np.load(work / "features" / "conv_00000.features.npy")
    assert feats.shape == (sum(len(c["ids"]) for c in convs), 3 * target.config.dim)
    assert np.load(work / "features" / "conv_00000.top_ids.npy").shape == (feats.shape[0], 8)
    head = load_draft(out, target.config)
    assert isinstance(head, Eagle3Draft) and head.draft_vocab_size == 256
    assert head.vocab.dtype == torch.long and torch.equal(head.vocab, head.vocab.sort().values)
    spec = speculative.Speculator(target, head, tree_top_k=4, tree_depth=4, tree_tokens=16)
    prompt = torch.tensor([convs[0]["ids"][:6]])
    ids, _ = speculative.speculative_generate(spec, prompt, 24)
    target.setup_caches(1, 64)
    assert ids == gen.generate(target, prompt, 24)


def test_eagle2_head_on_the_kept_conversation_shards(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """--arch eagle --data_dir: an EAGLE-1/2 head trains on the conversation shards kept for EAGLE-3
    (two-turn ones included), learning every answer token of each turn and nothing else. Its
    final-hidden-state features are cached beside an EAGLE-3 run's in a shared cache dir without
    replacing them, and the head decodes exactly as vanilla."""
    from draft import EagleDraft

    model_path = tiny_eagle3_checkpoint(tiny_hf_checkpoint)
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()))
    data_dir, cache = tmp_path / "convs", tmp_path / "features"
    te.main(eagle3_argv(model_path, tmp_path / "head3", "--tau_prompts", "0", "--epochs", "1", "--data_dir",
                        str(data_dir), "--cache_dir", str(cache)))
    eagle3_feats = np.load(cache / "conv_00000.features.npy")
    out = tmp_path / "head2"
    te.main(["--checkpoint_path", str(model_path), "--preset", "tiny", "--out_dir", str(out), "--dtype", "float32",
             "--data_dir", str(data_dir), "--cache_dir", str(cache), "--n_shards", "3", "--tau_prompts", "1"])
    info = json.loads((out / "training.json").read_text())
    assert info["data"]["shards"] == ["conv_00000.npz", "conv_00001.npz", "conv_00002.npz"]
    assert info["data"]["two_turn_conversations"] > 0 and len(info["history"]) == 2
    assert "val_tau" in info["history"][-1]
    assert not (out.with_name("head2.work") / "data").exists()  # no Magpie answers were written
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    final = np.load(cache / "conv_00000.final.features.npy")
    assert final.shape == (eagle3_feats.shape[0], target.config.dim)
    assert np.array_equal(np.load(cache / "conv_00000.features.npy"), eagle3_feats)  # EAGLE-3's cache kept

    # The batch a training step sees: the shard's features and its answers' tokens, per turn.
    data = te.load_conversations(target, data_dir, cache, None, 0, ["conv_00000.npz"])
    record = next(r for r in data["train"] + data["val"] if r["turns"] == 2)
    ids, feats, learn = te.collate([record], "cpu")
    conv = next(c for c in te.load_conversation_shard(data_dir / "conv_00000.npz")
                if c["ids"] == np.asarray(record["ids"]).tolist())
    assert learn[0, :-1].tolist() == conv["assistant"][1:] and not learn[0, -1]
    with torch.no_grad():
        want = te.target_features(target, [conv["ids"]])[0]["features"].float()
    # (the cache ran several conversations per forward: float16 storage of a float32 sum in another order)
    torch.testing.assert_close(feats[0], want, rtol=1e-2, atol=1e-2)

    head = load_draft(out, target.config)
    assert isinstance(head, EagleDraft)
    spec = speculative.Speculator(target, head, tree_top_k=4, tree_depth=4, tree_tokens=16)
    prompt = torch.tensor([conv["ids"][:6]])
    out_ids, _ = speculative.speculative_generate(spec, prompt, 24)
    target.setup_caches(1, 64)
    assert out_ids == gen.generate(target, prompt, 24)

    # --init_from: the head it starts from is measured first, on the same conversations and prompts;
    # unchanged (a zero learning rate) it ties with itself, and a tie writes nothing.
    again = tmp_path / "again"
    te.main(["--checkpoint_path", str(model_path), "--preset", "tiny", "--out_dir", str(again), "--dtype", "float32",
             "--data_dir", str(data_dir), "--cache_dir", str(cache), "--n_shards", "3", "--tau_prompts", "1",
             "--init_from", str(out), "--lr", "0"])
    info = json.loads((tmp_path / "again.work" / "training.json").read_text())
    assert info["baseline"]["dir"] == str(out) and info["init_from"]["dir"] == str(out)
    assert info["baseline"]["val_acc"] == info["history"][-1]["val_acc"]
    assert info["baseline"]["val_tau"] == info["history"][-1]["val_tau"]
    assert info["shipped_step"] is None and not again.exists()


def test_eagle3_resume_continues_bit_for_bit(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """A run stopped after a few steps (--max_steps) and continued with --resume computes the same
    losses, step for step, and ends with the same head as a run that was never stopped; features
    missing from the work dir are recomputed from the kept shards."""
    model_path = tiny_eagle3_checkpoint(tiny_hf_checkpoint)
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()))
    data = tmp_path / "data"
    common = ["--data_dir", str(data), "--tau_prompts", "0", "--epochs", "2", "--save_every", "4"]
    te.main(eagle3_argv(model_path, tmp_path / "whole", *common))
    whole = torch.load(tmp_path / "whole.work" / "train_state.pt", weights_only=False)
    steps = whole["step"]
    assert steps > 8 and len(whole["losses"]) == steps

    argv = eagle3_argv(model_path, tmp_path / "parts", *common)
    te.main(argv + ["--max_steps", "7"])  # stops mid-epoch, between two periodic saves
    part = torch.load(tmp_path / "parts.work" / "train_state.pt", weights_only=False)
    assert part["step"] == 7 and part["losses"] == whole["losses"][:7]
    with pytest.raises(SystemExit):
        te.main(argv + ["--force"])  # a saved state: no silent restart
    te.main(argv + ["--force", "--resume"])
    resumed = torch.load(tmp_path / "parts.work" / "train_state.pt", weights_only=False)
    assert resumed["losses"] == whole["losses"]  # bit for bit, the first step after the stop included
    for name, value in whole["draft"].items():
        assert torch.equal(resumed["draft"][name], value), name

    # A fresh machine: the shards are kept (in git), the work dir is not: features are recomputed.
    te.main(eagle3_argv(model_path, tmp_path / "fresh", *common, "--max_steps", "3"))
    fresh = torch.load(tmp_path / "fresh.work" / "train_state.pt", weights_only=False)
    assert fresh["losses"] == whole["losses"][:3]

    # --first_shard: a run over the newest shards only (their features, their validation split).
    te.main(eagle3_argv(model_path, tmp_path / "newest", *common, "--first_shard", "1", "--max_steps", "1"))
    used = json.loads((tmp_path / "newest.work" / "train_data.json").read_text())["shards"]
    assert used == ["conv_00001.npz", "conv_00002.npz"]
    assert sorted(p.name for p in (tmp_path / "newest.work" / "features").glob("*.features.npy")) == \
        ["conv_00001.features.npy", "conv_00002.features.npy"]


def test_eagle3_init_from_continues_a_trained_head(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """--init_from starts from a trained head's weights and draft vocabulary (not a fresh, warm-started
    head): with a zero learning rate the head written out is the one it started from (and into the
    directory of that head, it ties with it and does not replace it), with a real
    one training begins at the loss the first head ended near, below a fresh head's; a head of
    another architecture is refused with a one-line error."""
    from draft import EagleDraft

    model_path = tiny_eagle3_checkpoint(tiny_hf_checkpoint)
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()))
    common = ["--data_dir", str(tmp_path / "data"), "--tau_prompts", "0"]
    te.main(eagle3_argv(model_path, tmp_path / "first", *common, "--epochs", "1", "--draft_vocab_size", "128"))
    first = load_draft(tmp_path / "first")
    first_record = json.loads((tmp_path / "first" / "training.json").read_text())
    first_losses = torch.load(tmp_path / "first.work" / "train_state.pt", weights_only=False)["losses"]

    te.main(eagle3_argv(model_path, tmp_path / "same", *common, "--epochs", "1", "--lr", "0", "--max_steps", "1",
                        "--init_from", str(tmp_path / "first")))
    same = torch.load(tmp_path / "same.work" / "train_state.pt", weights_only=False)["draft"]
    assert torch.equal(same["vocab"], first.vocab) and len(same["vocab"]) == 128  # not the preset's 256
    for name, value in first.state_dict().items():
        assert torch.equal(same[name], value), name
    info = json.loads((tmp_path / "same.work" / "training.json").read_text())
    assert info["init_from"]["dir"] == str(tmp_path / "first") and info["init_from"]["steps"] == first_record["steps"]
    assert info["data"]["vocab_from"] == str(tmp_path / "first")

    # Into the first head's own directory, unchanged weights: measured on the same conversations it
    # ties with the head already there, and a tie does not replace it.
    before = (tmp_path / "first" / "draft.safetensors").read_bytes()
    te.main(eagle3_argv(model_path, tmp_path / "first", *common, "--epochs", "1", "--lr", "0", "--force",
                        "--init_from", str(tmp_path / "first"), "--work_dir", str(tmp_path / "again.work")))
    again = json.loads((tmp_path / "again.work" / "training.json").read_text())
    assert again["baseline"]["val_acc"] == again["history"][-1]["val_acc"] and again["shipped_step"] is None
    assert (tmp_path / "first" / "draft.safetensors").read_bytes() == before

    te.main(eagle3_argv(model_path, tmp_path / "more", *common, "--epochs", "1", "--max_steps", "1",
                        "--init_from", str(tmp_path / "first")))
    more_loss = torch.load(tmp_path / "more.work" / "train_state.pt", weights_only=False)["losses"][0]
    assert more_loss < first_losses[0] and more_loss < sum(first_losses) / len(first_losses)

    with pytest.raises(SystemExit, match="drafts over 128 tokens; --draft_vocab_size 64 would drop some"):
        te.main(eagle3_argv(model_path, tmp_path / "other", *common, "--draft_vocab_size", "64",
                            "--init_from", str(tmp_path / "first")))

    with pytest.raises(SystemExit, match="must be in \\[1, 512\\]"):
        te.main(eagle3_argv(model_path, tmp_path / "other", *common, "--draft_vocab_size", "100000",
                            "--init_from", str(tmp_path / "first")))

    # A larger --draft_vocab_size widens the head: its 128 trained rows kept, 64 more from the target.
    te.main(eagle3_argv(model_path, tmp_path / "wide", *common, "--epochs", "1", "--lr", "0", "--max_steps", "1",
                        "--draft_vocab_size", "192", "--init_from", str(tmp_path / "first")))
    wide = torch.load(tmp_path / "wide.work" / "train_state.pt", weights_only=False)["draft"]
    assert len(wide["vocab"]) == 192 and set(first.vocab.tolist()) <= set(wide["vocab"].tolist())
    at = {t: i for i, t in enumerate(wide["vocab"].tolist())}
    for i, t in enumerate(first.vocab.tolist()):
        assert torch.equal(wide["lm_head.weight"][at[t]], first.lm_head.weight[i])
    info = json.loads((tmp_path / "wide.work" / "training.json").read_text())
    assert info["init_from"]["widened_from_vocab_size"] == 128 and info["data"]["draft_vocab_size"] == 192
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    checkpoint.save_draft(EagleDraft(te.draft_config_for(target.config)), tmp_path / "eagle1")
    with pytest.raises(SystemExit, match="holds an EAGLE-1/2 head, not one for --arch eagle3"):
        te.main(eagle3_argv(model_path, tmp_path / "other", *common, "--init_from", str(tmp_path / "eagle1")))


def test_conversation_shards_round_trip(tmp_path):
    """Token ids (uint16), assistant masks (bit-packed) and per-conversation fields come back as
    saved; ids that do not fit uint16 are refused."""
    rng = random.Random(0)
    convs = [{"ids": [rng.randrange(65536) for _ in range(n)], "assistant": [rng.random() < 0.5 for _ in range(n)],
              "split": rng.choice(["train", "val"]), "temperature": rng.choice([0.0, 1.0]),
              "category": rng.choice(te.CATEGORIES), "turns": rng.choice([1, 2])} for n in (1, 7, 300, 13)]
    path = tmp_path / "conv_00000.npz"
    te.save_conversations(path, convs, {"seed": 0})
    assert te.load_conversation_shard(path) == convs
    assert not list(tmp_path.glob("*.tmp*"))
    with pytest.raises(ValueError, match="uint16"):
        te.save_conversations(tmp_path / "bad.npz", [{**convs[0], "ids": [65536]}], {})


def test_assistant_mask_marks_every_answer(smollm2_checkpoint):
    """The tokens learned are those of each assistant answer, its stop token included, in a
    two-turn chat as the template encodes it."""
    tokenizer = load_tokenizer(smollm2_checkpoint)
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Make it shorter."}]
    prompt = tokenizer.apply_chat_template(messages)
    answer2 = tokenizer.encode("Red.", bos=False) + [tokenizer.stop_ids[-1]]
    ids = prompt + answer2
    mask = te.assistant_mask(ids, te.assistant_header(tokenizer), set(tokenizer.stop_ids))
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]).replace("<|im_end|>", "|") == "Blue.|Red.|"
    assert sum(mask) == len(tokenizer.encode("Blue.", bos=False)) + 1 + len(answer2)
    assert mask[-len(answer2):] == [True] * len(answer2) and not mask[-len(answer2) - 1]


def test_make_batches_keeps_groups_apart():
    lengths = [10, 30, 12, 50, 11, 40]
    turns = [1, 2, 1, 2, 1, 2]
    batches = te.make_batches_by_length(lengths, 100, False, random.Random(0), turns)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len({turns[i] for i in b}) == 1 for b in batches)
    assert all(max(lengths[i] for i in b) * len(b) <= 100 for b in batches)


def random_eagle3_draft(target, vocab, std=0.2, seed=1):
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config_for(target.config), len(vocab), (0, 1, 1)).eval()
    draft.vocab.copy_(vocab)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, std)
    return draft


@torch.no_grad()
def test_eagle3_unroll_equals_the_draft_as_a_chain():
    """The training graph is inference: step k of the training-time test at index t equals the
    draft run through its KV cache on the true entries 0 .. t, then fed its own output k times,
    one token at a time (a depth-k tree chain), in float32."""
    target = tiny_target("tiny-llama", seed=4)
    vocab = torch.arange(0, 512, 3)
    draft = random_eagle3_draft(target, vocab)
    n, unroll = 12, 4
    ids = torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(0))
    feats = torch.randn(2, n, 3 * 64, generator=torch.Generator().manual_seed(1))
    te.setup_for_training(draft, n + unroll)
    outs = te.eagle3_unroll(draft, target.tok_embeddings, ids, feats, unroll)
    assert len(outs) == unroll
    embed = target.tok_embeddings
    for b in range(2):
        for t in range(n - 1):
            ref = copy.deepcopy(draft)
            ref.max_seq_length = -1
            ref.setup_caches(1, n + unroll)
            h = ref(embed(ids[b:b + 1, 1:t + 2]), feats[b:b + 1, :t + 1], torch.arange(t + 1))[:, -1:]
            for k in range(unroll):
                if t + k + 1 >= n:
                    break
                if k:  # the next chain entry: token t + k + 1 at position t + k, fed the last output
                    h = ref(embed(ids[b:b + 1, t + k + 1:t + k + 2]), h, torch.tensor([t + k]))
                scale = max(1.0, float(h.abs().max()))  # float32 rounding grows with the values
                torch.testing.assert_close(outs[k][b, t], h[0, 0], atol=3e-5 * scale, rtol=1e-4)
                # and the logits the loss reads are the draft's inference log-probabilities
                torch.testing.assert_close(torch.log_softmax(draft.lm_head(draft.norm(outs[k][b, t])), -1),
                                           ref.log_probs(h)[0, 0], atol=1e-5, rtol=1e-5)


def test_eagle3_losses_count_out_of_vocabulary_targets_as_misses():
    """Accuracy counts every answer position, a target token outside the draft vocabulary as a
    miss; the loss is only over positions whose target the draft can say."""
    target = tiny_target("tiny-llama", seed=4)
    vocab = torch.arange(0, 512, 2)  # even ids only
    draft = random_eagle3_draft(target, vocab, std=0.05)
    index = torch.full((512,), -1, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    n = 10
    g = torch.Generator().manual_seed(0)
    top = torch.randint(0, 256, (n, 4), generator=g) * 2
    top[::3, 0] += 1  # every third target argmax is odd: outside the vocabulary
    item = {"ids": np.arange(n) * 2, "learn": np.array([False] + [True] * (n - 1)),
            "features": np.random.default_rng(0).standard_normal((n, 192)).astype(np.float16),
            "top_ids": top.numpy(), "top_probs": np.full((n, 4), 0.25, dtype=np.float16)}
    ids, feats, top_idx, top_p, learn, answer = te.collate3([item], "cpu", index)
    assert int(answer.sum()) == n - 1 and int(learn.sum()) == n - 1 - len(range(3, n, 3))
    te.setup_for_training(draft, n + 2)
    res = te.eagle3_losses(draft, target.tok_embeddings, ids, feats, top_idx, top_p, learn, answer,
                           te.Preset(unroll=2))
    for k, (loss, ce_sum, hits, n_sel, n_answer) in enumerate(res):
        assert int(n_answer) == int(answer[0, k + 1:].sum()) and int(n_sel) == int(learn[0, k + 1:].sum())
        assert torch.isfinite(loss) and 0 <= int(hits) <= int(n_sel) < int(n_answer)


def test_warm_start_copies_the_target_rows():
    """The draft's LM head starts as exactly the target's output rows named by the vocabulary map
    (row i = target token vocab[i]), its final norm as the target's."""
    target = tiny_target("tiny-llama", seed=6)
    with torch.no_grad():
        target.norm.weight.normal_()
    vocab = torch.tensor([3, 17, 18, 100, 511])
    draft = te.make_draft(target, "eagle3", vocab, target.output.weight, None)
    for i, t in enumerate(vocab.tolist()):
        assert torch.equal(draft.lm_head.weight[i], target.output.weight[t])
    assert torch.equal(draft.norm.weight, target.norm.weight)
    hidden = torch.randn(1, 2, 64)  # so the draft's logits are the target head's, on the vocabulary
    torch.testing.assert_close(draft.log_probs(hidden).exp().sum(-1), torch.ones(1, 2))
    torch.testing.assert_close(draft.lm_head(draft.norm(hidden)), target.output(target.norm(hidden))[..., vocab])


def test_widen_vocab_keeps_trained_rows_and_adds_the_most_frequent_from_the_target():
    """A wider draft vocabulary holds the old one plus the most frequent tokens it lacked (ascending,
    as the map requires); old tokens keep their trained rows, new ones get the target's rows, and
    the rest of the head is unchanged: over its old tokens the wide head's logits are the narrow one's."""
    target = tiny_target("tiny-llama", seed=6)
    V = target.config.vocab_size
    vocab = torch.tensor([3, 17, 18, 100, 511])
    narrow = random_eagle3_draft(target, vocab)
    counts = torch.zeros(V, dtype=torch.long)
    counts[[17, 40, 7, 300, 2]] = torch.tensor([90, 50, 50, 20, 1])  # 17 is already drafted
    assert te.choose_vocab(counts, 5, keep=vocab).tolist() == vocab.tolist()
    wide = te.widen_vocab(narrow, te.choose_vocab(counts, 8, keep=vocab), target.output.weight)
    assert wide.vocab.tolist() == [3, 7, 17, 18, 40, 100, 300, 511] and wide.draft_vocab_size == 8
    for i, t in enumerate(wide.vocab.tolist()):
        expected = narrow.lm_head.weight[vocab.tolist().index(t)] if t in vocab else target.output.weight[t]
        assert torch.equal(wide.lm_head.weight[i], expected), t
    hidden = torch.randn(1, 2, 64)
    old = torch.isin(wide.vocab, vocab)
    torch.testing.assert_close(wide.lm_head(wide.norm(hidden))[..., old], narrow.lm_head(narrow.norm(hidden)))
    assert torch.equal(narrow.vocab, vocab) and narrow.lm_head.weight.size(0) == 5  # the narrow head untouched
    assert te.widen_vocab(narrow, vocab, target.output.weight).vocab.tolist() == vocab.tolist()
    with pytest.raises(ValueError, match="must hold the draft's own 5 tokens"):
        te.widen_vocab(narrow, torch.tensor([3, 7, 17, 18, 40, 100, 300]), target.output.weight)


def test_an_existing_head_is_kept_unless_forced_but_data_only_may_write_beside_it(tmp_path, capsys):
    """A head in OUT_DIR is never replaced silently; --data_only writes conversation shards only,
    so it runs beside a shipped head (how a later session grows the data without --force)."""
    ckpt, out = tmp_path / "model.pth", tmp_path / "head"
    ckpt.touch()
    out.mkdir()
    (out / "draft.safetensors").touch()
    argv = ["--arch", "eagle3", "--checkpoint_path", str(ckpt), "--out_dir", str(out)]
    with pytest.raises(SystemExit):
        te.parse_args(argv)
    assert "already holds a head; pass --force" in capsys.readouterr().err
    args, _ = te.parse_args(argv + ["--data_only"])
    assert args.data_only and args.out_dir == out


def test_resume_refuses_another_shard_count(tmp_path, capsys):
    """--resume continues the shard list a run started on; an --n_shards that differs from it (the
    next epoch over more shards, while the last run's state is still in the work dir) is a one-line
    error that says what to do, not a run over the old list."""
    ckpt, out = tmp_path / "model.pth", tmp_path / "head"
    ckpt.touch()
    work = tmp_path / "head.work"
    work.mkdir()
    (work / "train_state.pt").touch()
    (work / "train_data.json").write_text(json.dumps({"shards": [f"conv_{n:05d}.npz" for n in range(57)]}))
    argv = ["--arch", "eagle3", "--checkpoint_path", str(ckpt), "--out_dir", str(out), "--resume"]
    with pytest.raises(SystemExit):
        te.parse_args(argv + ["--n_shards", "72"])
    err = capsys.readouterr().err
    assert "runs over 57 shards" in err and "not --first_shard 0 --n_shards 72" in err and "move" in err
    assert "Traceback" not in err
    assert te.parse_args(argv + ["--n_shards", "57"])[0].resume  # the same count continues
    assert te.parse_args(argv)[0].resume  # no count: the saved list
    assert te.parse_args(argv + ["--n_shards", "72", "--data_only"])[0].data_only  # data only: no training

    # A continuation on the newest shards only (--first_shard) resumes with the same two flags.
    (work / "train_data.json").write_text(json.dumps({"shards": [f"conv_{n:05d}.npz" for n in range(50, 57)]}))
    assert te.parse_args(argv + ["--n_shards", "57", "--first_shard", "50"])[0].first_shard == 50
    with pytest.raises(SystemExit):
        te.parse_args(argv + ["--n_shards", "57"])  # the same end, but from shard 0: another run
    assert "runs over 7 shards (conv_00050.npz .. conv_00056.npz)" in capsys.readouterr().err
    for first in ("57", "-1"):
        with pytest.raises(SystemExit):
            te.parse_args(argv + ["--n_shards", "57", "--first_shard", first])
        assert f"--first_shard must be in [0, 56] (below --n_shards), got {first}" in capsys.readouterr().err
    # EAGLE-1/2 trains on the same shards, so it takes the same flags
    assert te.parse_args(["--arch", "eagle", "--checkpoint_path", str(ckpt), "--out_dir", str(tmp_path / "e2"),
                          "--first_shard", "3"])[0].first_shard == 3
