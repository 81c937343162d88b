"""research/acceptance_bound.py: its search finds the n most probable paths (against enumerating
every path), the sum it reports is what speculative.accept's walk accepts on average, and the
script runs end to end on the tiny checkpoint."""
import json
from pathlib import Path

import pytest
import torch

import acceptance_bound
from conftest import mirrored_pair, tiny_target
from sampling import logits_to_probs
from speculative import Speculator, accept
from trees import Tree, tree_structure

CONTEXT = [3, 1, 4, 1, 2]


def every_path(model, temperature, depth, top_k=None):
    """{path: probability} of every continuation of CONTEXT up to depth tokens (each token among
    its parent's top_k), each distribution from a plain causal forward over the whole sequence."""
    model.setup_caches(1, 32)
    probs, frontier = {(): 1.0}, [()]
    for _ in range(depth):
        nxt = []
        for path in frontier:
            ids = torch.tensor([CONTEXT + list(path)])
            p = logits_to_probs(model(ids, torch.arange(ids.size(1)))[0, -1], temperature)
            tokens = p.topk(top_k).indices.tolist() if top_k else range(p.numel())
            for t in tokens:
                probs[path + (t,)] = probs[path] * p[t].item()
                nxt.append(path + (t,))
        frontier = nxt
    del probs[()]
    return probs


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.3, None), (0.3, 2)])
def test_best_paths_are_the_most_probable(temperature, top_k):
    model = tiny_target(vocab_size=5)
    depth, n = 4, 12
    truth = every_path(model, temperature, depth, top_k)
    want = sorted(truth.items(), key=lambda kv: -kv[1])[:n]
    got = acceptance_bound.best_paths(model, CONTEXT, n, temperature, top_k, max_depth=depth)
    assert [path for _, path in got] == [path for path, _ in want]
    torch.testing.assert_close(torch.tensor([p for p, _ in got]), torch.tensor([p for _, p in want]))
    if temperature == 0.3 and top_k is None:  # a sharp target: the best tree is deeper than one level
        assert max(len(path) for _, path in got) >= 3


def test_the_bound_is_what_the_acceptance_walk_accepts():
    """Build the tree of the best paths, let speculative.accept walk it many times at T=1, and
    compare the mean accepted length with the sum of the path probabilities."""
    torch.manual_seed(0)
    model = tiny_target(vocab_size=6)
    best = acceptance_bound.best_paths(model, CONTEXT, 7, 1.0)
    paths = [()] + sorted((path for _, path in best), key=len)  # parents before children, the root first
    index = {path: i for i, path in enumerate(paths)}
    parents = torch.tensor([[-1] + [index[path[:-1]] for path in paths[1:]]])
    tokens = torch.tensor([[CONTEXT[-1]] + [path[-1] for path in paths[1:]]])
    model(torch.tensor([CONTEXT[:-1]]), torch.arange(len(CONTEXT) - 1))  # the prefix; the root is in the tree
    logits = acceptance_bound._tree_forward(model, CONTEXT, paths)
    B = 40_000
    tree = Tree(tokens.expand(B, -1), parents.expand(B, -1),
                *tree_structure(parents.expand(B, -1), max(len(p) for p in paths)))
    _, n_accepted, _ = accept(tree, logits[None].expand(B, -1, -1), 1.0)
    expected = sum(p for p, _ in best)
    spread = n_accepted.float().std().item() / B ** 0.5
    assert abs(n_accepted.float().mean().item() - expected) < 4 * spread
    assert acceptance_bound.tau_bounds([p for p, _ in best], [8])[8] == pytest.approx(1 + expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_head_tree_tau_is_what_the_round_accepts(temperature):
    """head_tree_tau's sum over the head's tree equals the mean accepted length of
    speculative.accept's walk over that tree (exactly at T=0), and the tree grows from the
    context's own last token."""
    torch.manual_seed(0)
    target, draft = mirrored_pair(sharpness=2.0)
    spec = Speculator(target, draft, tree_top_k=3, tree_depth=4, tree_tokens=12, temperature=temperature)
    context = [3, 1, 4, 1, 5, 9, 2, 6]
    tau = acceptance_bound.head_tree_tau(spec, context)
    tree = spec.grow(spec.catch_up())  # the same round again: the catch-up rewrites the same entries
    logits, _ = spec.verify(tree)
    assert tree.tokens[0, 0].item() == context[-1]
    plain = target.setup_caches(1, 32) or target(torch.tensor([context]), torch.arange(len(context)))
    torch.testing.assert_close(logits[0, 0], plain[0, -1], atol=1e-4, rtol=1e-4)
    B = 1 if temperature == 0 else 40_000
    _, n_accepted, _ = accept(Tree(*(t.expand(B, *t.shape[1:]) for t in tree)), logits.expand(B, -1, -1), temperature)
    if temperature == 0:
        assert tau == 1 + n_accepted.item() and tau > 2  # the mirrored draft's guesses are mostly right
    else:
        spread = n_accepted.float().std().item() / B ** 0.5
        assert abs(1 + n_accepted.float().mean().item() - tau) < 4 * spread


def test_script_on_the_tiny_checkpoint(tiny_checkpoint, tmp_path):
    checkpoint, questions = tiny_checkpoint
    out = tmp_path / "bound"
    acceptance_bound.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions),
                           "--num_questions", "2", "--max_new_tokens", "12", "--stride", "4", "--sizes", "4", "8",
                           "--restricted_tokens", "8", "--top_k", "2", "--max_depth", "3", "--head",
                           str(checkpoint.parent / "eagle"), "--out", str(out)])
    overall = json.loads(Path(str(out) + ".json").read_text())["by_category"]["overall"]
    assert overall["contexts"] >= 2
    assert 1.0 <= overall["tau_max_4"] <= overall["tau_max_8"] <= 8.0
    assert 1.0 <= overall["tau_max_8_top2_depth3"] <= overall["tau_max_8"] + 1e-9
    # No head's tree of that shape holds more than the best one (the mirrored head's guesses get accepted).
    assert 1.0 < overall["head_8_top2_depth3"] <= overall["tau_max_8_top2_depth3"] + 1e-6
    assert 0.0 < overall["first_guess_accepted"] <= 1.0
    assert "| overall |" in Path(str(out) + ".md").read_text()


@pytest.mark.parametrize("bad", [["--temperature", "0"], ["--stride", "0"], ["--sizes", "1"],
                                 ["--restricted_tokens", "1"], ["--top_k", "0"]])
def test_bad_arguments_are_refused(bad, tmp_path):
    with pytest.raises(SystemExit):
        acceptance_bound.parse_args(["--out", str(tmp_path / "x"), *bad])


@pytest.mark.parametrize("head, shape", [("missing", []), ("eagle", ["--restricted_tokens", "60", "--top_k", "2",
                                                                      "--max_depth", "3"])])
def test_a_bad_head_is_refused_in_one_line(tiny_checkpoint, tmp_path, head, shape):
    """No head there, or a tree shape the Speculator cannot grow (60 tokens from 2 children a node
    over 3 levels): a one-line error before any decoding."""
    checkpoint, questions = tiny_checkpoint
    with pytest.raises(SystemExit, match="--head: "):
        acceptance_bound.main(["--checkpoint_path", str(checkpoint), "--question_file", str(questions),
                               "--head", str(checkpoint.parent / head), *shape, "--out", str(tmp_path / "x")])

