"""What every decoder shares, so that vanilla and speculative decoding emit the same tokens:
the processed distribution a token is drawn from, the draw itself, and where an answer stops.

Speculative decoding draws from exactly the distribution vanilla decoding does, which is what
makes it lossless: keep every transformation of the logits inside logits_to_probs."""
from typing import Optional

import torch
from torch import Tensor


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                    top_p: Optional[float] = None) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus), then renormalise. logits [..., V] -> probs."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix of the sorted tokens whose mass reaches top_p: a token is dropped
        # when the tokens ranked above it already hold top_p. The top token is always kept.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: Tensor) -> Tensor:
    """One draw from each row of probs [..., V] (unnormalised is fine) without a host sync, by
    inverting the CDF: the first index whose cumulative mass exceeds u * total, u ~ U[0, 1), is i
    with probability p_i / total. The threshold stays below the total even where u * total rounds up
    to it, so p_i > 0. (gpt-fast's exponential race draws V exponentials a row: much slower on a CPU.)"""
    cdf = probs.float().cumsum(-1)
    total = cdf[..., -1:]
    threshold = torch.minimum(torch.rand_like(total) * total, torch.nextafter(total, torch.zeros_like(total)))
    return (cdf <= threshold).sum(-1).clamp(max=probs.size(-1) - 1)


def sample(logits: Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float]) -> Tensor:
    """Next token from logits [..., V]; temperature 0 is greedy."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return sample_from(logits_to_probs(logits, temperature, top_k, top_p))


def is_stop(tokens: Tensor, stop: Tensor) -> Tensor:
    """Which of tokens (any shape) are stop tokens (stop: a 1-D tensor of ids), elementwise. Not
    torch.isin: past a handful of ids it sorts, a host sync that CUDA-graph capture cannot record."""
    return (tokens[..., None] == stop).any(-1)


def cut_at_stop(ids: list, stop_ids) -> list:
    """ids up to and including the first stop token."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids
