"""attention.py: the CPU forms of attention equal SDPA's, and use_attention sets a module's kernel."""
import pytest
import torch
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx

from attention import LIVE_BLOCK, MATMUL_ATTENTION_MAX_SCORES, _grouped_sdpa, _matmul_attention, cpu_attention, use_attention
from conftest import random_draft, tiny_target
from model import TreeMask, sdpa


@pytest.mark.parametrize("T, S", [(5, 30), (256, 1024)])
def test_cpu_half_precision_attention_path_equals_sdpa(T, S):
    """bf16/fp16 attention on CPU runs as plain matmuls up to MATMUL_ATTENTION_MAX_SCORES scores
    (SDPA is slow there for few rows), as SDPA past it: the same result either way."""

    assert (2 * 6 * T * S < MATMUL_ATTENTION_MAX_SCORES) == (T == 5)  # one case on each side
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, T, 16), torch.randn(2, 2, S, 16), torch.randn(2, 2, S, 16)
    mask = torch.rand(2, T, S) > 0.3
    mask[..., 0] = True  # every query sees something
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(_matmul_attention(q, k, v, mask), reference, atol=1e-5, rtol=1e-5)
    half = cpu_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    torch.testing.assert_close(half.float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("T", [1, 7])
@torch.no_grad()
def test_cpu_gqa_attention_stacks_query_heads_and_equals_sdpa(T):
    """On a CPU the query heads that share a KV head go to SDPA as rows of one call (its GQA mode
    is slow there): the same attention as enable_gqa, head by head and query by query, each row
    with its own mask, compiled too (the path generate.py --compile takes)."""

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, T, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.rand(2, T, 40) > 0.3
    mask[..., 0] = True  # every query sees something
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(_grouped_sdpa(q, k, v, mask), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_attention(q, k, v, mask), reference, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(cpu_attention, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask).float(), reference,
                               atol=3e-2, rtol=3e-2)
    torch._dynamo.reset()


@pytest.mark.parametrize("compiled", [False, True])
@torch.no_grad()
def test_cpu_attention_reads_only_the_live_slots_and_a_trees_region(compiled):
    """On a CPU the kernel cuts the cache to the slots some query sees (a dense mask's last visible
    slot, a TreeMask's live prefix and region), compiled in whole LIVE_BLOCKs with one graph for
    every length: the same attention as over the whole cache, and NaN in the slots cut changes nothing."""
    torch.manual_seed(0)
    S = 3 * LIVE_BLOCK
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16)
    poisoned = [t.clone() for t in (k, v)]
    for t in poisoned:
        t[:, :, 2 * LIVE_BLOCK:S - 3] = float("nan")  # past the live blocks, before a tree's region
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)
    attend = torch.compile(cpu_attention, backend=inductor, fullgraph=True) if compiled else cpu_attention
    visible = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    try:
        for end in (20, LIVE_BLOCK + 20):
            causal = torch.arange(S) <= end + torch.arange(3)[:, None]
            torch.testing.assert_close(attend(q, *poisoned, causal[None]), sdpa(q, k, v, causal[None]))
            tree = TreeMask(torch.tensor([end]), visible)
            torch.testing.assert_close(attend(q, *poisoned, tree), sdpa(q, k, v, tree))
    finally:
        torch._dynamo.reset()
    assert len(graphs) == (2 if compiled else 0)  # a dense mask's and a TreeMask's


def test_use_attention_sets_the_kernel_of_every_attention_and_checks_the_backend():
    target = tiny_target()
    draft = random_draft(target)
    assert use_attention(target, "sdpa") == "sdpa" and use_attention(draft) == "sdpa"
    assert all(m.attend is cpu_attention for m in (*[layer.attention for layer in target.layers], draft.layer.attention))
    with pytest.raises(ValueError, match="auto, sdpa or triton"):
        use_attention(target, "flash")
