"""autoshape.py, --tree auto: the pure decision rule on made-up cost curves, the measurement it reads
and caches, and generate.py's fallback to plain decoding or the chosen tree."""
import argparse
import copy

import pytest
import torch

import autoshape
import generate as gen
from checkpoint import save_draft
from conftest import ROOT, mirrored_pair
from speculative import Speculator, accept


def chain_probes(top_k, depth, accepted_len, n=3):
    """Made-up probe rounds: a pool of candidates where the accepted path is the best-scored
    candidate of each of its first accepted_len levels, everything else scored far below."""
    sizes = torch.tensor([top_k] + [top_k ** 2] * (depth - 1))
    levels = torch.repeat_interleave(torch.arange(1, depth + 1), sizes)
    scores = -5.0 - 0.01 * torch.arange(len(levels), dtype=torch.float)
    starts = [0] + sizes.cumsum(0).tolist()
    accepted = [starts[d] for d in range(accepted_len)]
    for d, i in enumerate(accepted):
        scores[i] = -0.1 * (d + 1)
    return [(scores, levels, accepted)] * n


def test_predicted_tau_keeps_the_best_candidates_of_the_allowed_depth():
    probes = chain_probes(top_k=4, depth=6, accepted_len=5)
    assert autoshape.predicted_tau(probes, depth=6, tokens=64) == 6  # the whole path, and the bonus
    assert autoshape.predicted_tau(probes, depth=3, tokens=64) == 4  # the path's first 3 levels
    assert autoshape.predicted_tau(probes, depth=6, tokens=3) == 3   # room for 2 nodes: the 2 best
    assert autoshape.predicted_tau(probes, depth=6, tokens=2) == 2


def test_choose_shape_on_a_cpu_a_gpu_and_where_nothing_pays():
    acceptance = {4: chain_probes(4, 8, accepted_len=5), 8: chain_probes(8, 8, accepted_len=5)}
    # a CPU: verifying costs more the more tokens; levels are cheap
    cpu = autoshape.ShapeCosts(step=1.0, verify={T: 0.5 + 0.1 * T for T in autoshape.AUTO_TOKENS},
                                 grow={4: (0.05, 0.05), 8: (0.1, 0.1)}, other=0.1)
    choice, table = autoshape.choose_shape(cpu, acceptance, depths=range(1, 9))
    assert choice == dict(tree_top_k=4, tree_depth=5, tree_tokens=6)  # tau 6 for 1.45 steps: 4.1x
    assert table[0][0] == pytest.approx(6 / 1.45) and table[0][3] == choice
    assert all(a[0] >= b[0] for a, b in zip(table, table[1:]))  # best first
    # a GPU: verifying 64 tokens costs about what one does; the path gets longer in bigger trees
    gpu = cpu._replace(verify={T: 1.0 + 0.001 * T for T in autoshape.AUTO_TOKENS})
    deep = {8: chain_probes(8, 8, accepted_len=8)}
    assert autoshape.choose_shape(gpu, deep, depths=range(1, 9))[0] == dict(tree_top_k=8, tree_depth=8, tree_tokens=12)
    # nothing pays: every tree costs more than the tokens it brings (and a close call goes to vanilla)
    slow = cpu._replace(verify={T: 3.0 + T for T in autoshape.AUTO_TOKENS})
    assert autoshape.choose_shape(slow, acceptance, depths=range(1, 9))[0] is None
    close = autoshape.ShapeCosts(step=1.0, verify={2: 0.97}, grow={4: (0.0, 0.0)}, other=0.0)
    assert autoshape.choose_shape(close, {4: chain_probes(4, 1, accepted_len=0)}, depths=[1])[0] is None
    # only ratios of costs matter, not the unit
    ms = cpu._replace(step=1e-3, verify={T: s * 1e-3 for T, s in cpu.verify.items()},
                      grow={k: (a * 1e-3, b * 1e-3) for k, (a, b) in cpu.grow.items()}, other=1e-4)
    assert autoshape.choose_shape(ms, acceptance, depths=range(1, 9))[0] == choice


@torch.no_grad()
def test_a_smaller_tree_accepts_what_the_probe_predicts():
    """The claim auto's predictions rest on (greedy): from one state, a tree of depth d and T tokens
    accepts exactly the prefix of the deep, large probe tree's accepted path that it keeps."""
    target, draft = mirrored_pair(seed=2)
    prompt = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(3))
    for depth, tokens in [(2, 4), (3, 6), (4, 8), (3, 12)]:
        big = Speculator(copy.deepcopy(target), copy.deepcopy(draft), tree_top_k=4, tree_depth=4,
                                     tree_tokens=40)
        small = Speculator(copy.deepcopy(target), copy.deepcopy(draft), tree_top_k=4, tree_depth=depth,
                                       tree_tokens=tokens)
        for spec in (big, small):
            spec.prefill(prompt, 40)
        for _ in range(3):  # the same states as long as both accept the same; compare the first round
            tree, pool = big.grow(big.catch_up(), with_pool=True)
            logits, _ = big.verify(tree)
            node, n_accepted, _ = accept(tree, logits, 0.0)
            accepted = pool.keep[0, tree.paths[0, node[0], 1:n_accepted[0] + 1] - 1].tolist()
            predicted = autoshape.predicted_tau([(pool.scores[0], pool.depth, accepted)], depth, tokens)
            tree_s = small.grow(small.catch_up())
            logits_s, _ = small.verify(tree_s)
            assert 1 + int(accept(tree_s, logits_s, 0.0)[1][0]) == predicted
            break


@torch.no_grad()
def test_measure_shapes_probes_every_top_k_and_times_each_part():
    target, draft = mirrored_pair()
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 9)]
    costs, acceptance = autoshape.measure_shapes(target, draft, prompts, top_ks=(2, 4), max_depth=3,
                                                 tokens=(2, 4, 8, 16, 64), rounds=4)
    assert set(acceptance) == {2, 4} and all(len(p) == 4 for p in acceptance.values())
    assert set(costs.verify) == {2, 4, 8, 16} and set(costs.grow) == {2, 4}  # 64 > the largest tree (1 + 4 + 2 * 16)
    assert costs.step > 0 and costs.other > 0 and all(v > 0 for v in costs.verify.values())
    scores, levels, accepted = acceptance[4][0]
    assert levels.tolist() == [1] * 4 + [2] * 16 + [3] * 16 and len(scores) == 36
    assert autoshape.predicted_tau(acceptance[4], 3, 16) > 2  # the mirrored draft's guesses are accepted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@torch.no_grad()
def test_measure_shapes_on_cuda_graph_replays():
    """A compiled run on CUDA is measured on CUDA-graph replays of the eager step, tree growth and
    verify; the probe rounds are real rounds, which accept the mirrored draft's guesses."""
    target, draft = (m.cuda() for m in mirrored_pair())
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 9)]
    costs, acceptance = autoshape.measure_shapes(target, draft, prompts, top_ks=(4,), max_depth=3, tokens=(4, 8),
                                                 rounds=3, cuda_graphs=True)
    assert costs.step > 0 and set(costs.verify) == {4, 8} and costs.grow[4][0] > 0
    assert autoshape.predicted_tau(acceptance[4], 3, 8) > 2


def test_auto_shape_measures_once_and_reads_its_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_AUTO_CACHE", str(tmp_path / "cache"))
    calls = []
    costs = autoshape.ShapeCosts(step=1.0, verify={T: 0.5 + 0.1 * T for T in autoshape.AUTO_TOKENS},
                                 grow={4: (0.05, 0.05)}, other=0.1)
    monkeypatch.setattr(autoshape, "measure_shapes",
                        lambda *a, **k: calls.append(k) or (costs, {4: chain_probes(4, 8, accepted_len=5)}))
    key = dict(machine="test", model="m")
    first = autoshape.auto_shape(None, None, [[1, 2]], top_ks=(4,), cache_key=key, temperature=0.0)
    again = autoshape.auto_shape(None, None, [[1, 2]], top_ks=(4,), cache_key=key, temperature=0.0)
    assert first == again == dict(tree_top_k=4, tree_depth=5, tree_tokens=6) and len(calls) == 1
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the file, renamed whole: no partial one left
    autoshape.auto_shape(None, None, [[1, 2]], top_ks=(4,), cache_key=key, temperature=1.0)
    assert len(calls) == 2  # another temperature is another measurement
    with pytest.raises(ValueError, match="measures on prompts"):
        autoshape.auto_shape(None, None, [], top_ks=(4,))


def _args(**kw):
    """What generate.make_decoder reads of generate.check_args' Namespace."""
    defaults = dict(speculate="eagle2", temperature=0.0, top_k=None, top_p=None, compile=False, compile_prefill=False,
                    device="cpu", tree_file=None, tree_top_k=4, tree_depth=None, tree_tokens="auto", lookup=0,
                    adaptive=True, draft_dtype=None)
    return argparse.Namespace(**{**defaults, **kw})


@torch.no_grad()
def test_make_decoder_auto_falls_back_to_vanilla_or_builds_the_chosen_tree(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_AUTO_CACHE", str(tmp_path / "cache"))
    target, draft = mirrored_pair()
    save_draft(draft, tmp_path / "eagle")
    torch.save(target.state_dict(), tmp_path / "model.pth")
    prompt = [5, 7, 11, 13]
    expected = gen.generate(target, torch.tensor([prompt]), 20)[0]
    acceptance = {4: chain_probes(4, 8, accepted_len=3)}
    slow = autoshape.ShapeCosts(step=1.0, verify={T: 3.0 + T for T in autoshape.AUTO_TOKENS}, grow={4: (0.1, 0.1)},
                                other=0.1)
    monkeypatch.setattr(autoshape, "measure_shapes", lambda *a, **k: (slow, acceptance))
    args = _args(draft_checkpoint_path=tmp_path / "eagle", checkpoint_path=tmp_path / "model.pth")
    decode = gen.make_decoder(args, target, (), 64, [prompt])
    assert args.speculate == "none"
    ids, per_round = decode(prompt, 20)
    assert ids == expected and per_round is None  # vanilla decoding
    fast = slow._replace(verify={T: 0.5 + 0.1 * T for T in autoshape.AUTO_TOKENS}, grow={4: (0.05, 0.05)})
    monkeypatch.setattr(autoshape, "measure_shapes", lambda *a, **k: (fast, acceptance))
    monkeypatch.setenv("EAGLE_AUTO_CACHE", str(tmp_path / "another"))
    args = _args(draft_checkpoint_path=tmp_path / "eagle", checkpoint_path=tmp_path / "model.pth")
    decode = gen.make_decoder(args, target, (), 64, [prompt])
    assert args.speculate == "eagle2" and (args.tree_top_k, args.tree_depth, args.tree_tokens) == (4, 3, 4)
    ids, per_round = decode(prompt, 20)
    assert ids == expected and per_round is not None


def test_generate_cli_rejects_auto_for_the_static_tree(capsys):
    with pytest.raises(SystemExit):
        gen.parse_args(["--speculate", "eagle", "--tree", "auto", "--draft_checkpoint_path", str(ROOT)])
    assert "--tree TOP_K,DEPTH,TOKENS (or auto) sizes the dynamic trees of eagle2 and eagle3" in capsys.readouterr().err
