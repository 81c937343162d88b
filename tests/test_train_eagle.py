"""scripts/train_eagle.py: batched self-distillation data, the unrolled training graph matching
what the draft sees in a tree, and training that actually helps speculative decoding."""
import copy
import json
import random

import pytest
import torch

import checkpoint
import generate as gen
import speculative
import train_eagle as te
from checkpoint import load_draft
from conftest import random_draft, tiny_target
from tokenizer import load_tokenizer


@torch.no_grad()
def test_generate_batch_rows_of_different_lengths_equal_single_runs():
    model = tiny_target("tiny-llama", seed=3)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 2)]
    stop = {17}
    rows = te.generate_batch(model, prompts, 20, 0.0, None, stop, chunk=4)
    for prompt, row in zip(prompts, rows):
        ids, feats = row["ids"], row["features"]
        single = gen.generate(model, torch.tensor([prompt]), 20, stop_ids=stop)[0]
        assert ids == prompt + single
        model.setup_caches(1, len(ids))
        _, expected, _ = model(torch.tensor([ids]), torch.arange(len(ids)), return_features=True)
        torch.testing.assert_close(feats.float(), expected[0], atol=2e-3, rtol=2e-3)  # stored as float16


def test_user_turn_prefix_and_prompt_filter(smollm2_checkpoint):
    tokenizer = load_tokenizer(smollm2_checkpoint)
    prefix = tokenizer.decode(te.user_turn_prefix(tokenizer))
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
    rows = te.generate_batch(target, prompts, 40, 0.0, None, set())
    return [(torch.tensor(r["ids"]), r["features"], len(p)) for r, p in zip(rows, prompts)]


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
        return te.validate(draft, target, held_out, preset, torch.device("cpu"), torch.no_grad)[:, 0].sum()

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
        for ids, _, plen in held_out:
            rounds += speculative.speculative_generate(spec, ids[None, :plen], 30)[1][0]
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
    shards = sorted((tmp_path / "head.work" / "data").glob("shard_*.pt"))
    stamp = [s.stat().st_mtime for s in shards]
    te.main(argv + ["--force"])
    assert [s.stat().st_mtime for s in shards] == stamp  # data reused, not regenerated


# ---------------------------------------------------------------------------------------------
# EAGLE-3
# ---------------------------------------------------------------------------------------------
def test_eagle3_end_to_end_on_a_tiny_checkpoint(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """--arch eagle3: two-turn conversations with the three layers' inputs and the target's top
    tokens, a reduced vocabulary with its coverage, training that lowers the soft cross-entropy,
    and a head that loads as an Eagle3Draft and decodes exactly as vanilla."""
    from convert_hf_checkpoint import convert_hf
    from draft import Eagle3Draft

    model_path = convert_hf(tiny_hf_checkpoint("qwen2"), dtype="float32")
    state = torch.load(model_path)
    stop = load_tokenizer(model_path.parent).stop_ids[0]
    state["tok_embeddings.weight"][stop] *= 4  # (tied LM head) a random model that ends its turns now and then
    torch.save(state, model_path)
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()))
    out = tmp_path / "head3"
    argv = ["--arch", "eagle3", "--checkpoint_path", str(model_path), "--preset", "tiny", "--out_dir", str(out),
            "--dtype", "float32", "--tau_prompts", "1", "--prompt_max_tokens", "64", "--multi_turn_fraction", "1.0",
            "--epochs", "3", "--vocab_report", "64", "128", "--answer_max_tokens", "64"]
    te.main(argv)
    info = json.loads((out / "training.json").read_text())
    assert info["arch"] == "eagle3" and info["data"]["two_turn_conversations"] > 0
    assert set(info["data"]["coverage_of_val_argmax"]) == {"64", "128", "256"}
    coverage = [info["data"]["coverage_of_val_argmax"][k] for k in ("64", "128", "256")]
    assert coverage == sorted(coverage) and 0 < coverage[-1] <= 1  # a bigger vocabulary covers more
    ce = [h["val_ce"][0] for h in info["history"]]
    assert ce[-1] < ce[0]
    records = [r for shard in sorted((tmp_path / "head3.work" / "data3").glob("conv_*.pt"))
               for r in torch.load(shard, weights_only=True)["records"]]
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    r = records[0]
    assert r["features"].shape == (len(r["ids"]), 3 * target.config.dim) and r["top_ids"].shape == (len(r["ids"]), 8)
    head = load_draft(out, target.config)
    assert isinstance(head, Eagle3Draft) and head.draft_vocab_size == 256
    assert head.vocab.dtype == torch.long and torch.equal(head.vocab, head.vocab.sort().values)
    spec = speculative.Speculator(target, head, tree_top_k=4, tree_depth=4, tree_tokens=16)
    prompt = r["ids"][None, :6].long()
    ids, _ = speculative.speculative_generate(spec, prompt, 24)
    target.setup_caches(1, 64)
    assert ids == gen.generate(target, prompt, 24)


def test_prompt_stage_resumes_where_it_stopped(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """An interrupted prompt stage continues from its saved prompts and sampler state: the result
    equals an uninterrupted run's."""
    from convert_hf_checkpoint import convert_hf

    model_path = convert_hf(tiny_hf_checkpoint("qwen2"), dtype="float32")
    target = checkpoint.load_model(model_path, "cpu", torch.float32)
    tokenizer = load_tokenizer(model_path.parent)
    monkeypatch.setattr(te, "keep_prompt", lambda text, seen: bool(text.strip()) and not seen.add(text))
    preset = te.Preset(n_prompts=20, prompt_max_tokens=48, gen_batch=8, val_fraction=0.25)
    whole = te.make_prompts(target, tokenizer, preset, tmp_path / "whole.json", seed=3)

    calls, real = [], te.generate_batch

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(te, "generate_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        te.make_prompts(target, tokenizer, preset, tmp_path / "resumed.json", seed=3)
    assert (tmp_path / "resumed.partial.pt").is_file() and not (tmp_path / "resumed.json").exists()
    monkeypatch.setattr(te, "generate_batch", real)
    assert te.make_prompts(target, tokenizer, preset, tmp_path / "resumed.json", seed=3) == whole
    assert not (tmp_path / "resumed.partial.pt").exists()
