"""How a decode step picks the next token: transformers' temperature / top-k / top-p warping and the
sample (Gumbel-max) or greedy pick, on fixed shapes (no host synchronization), plus the EOS test."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Sampler", "eos_hit", "pick", "warp"]


@dataclass(frozen=True)
class Sampler:
    """What one decode step needs to pick the next token (Python constants of the compiled step)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos: tuple[int, ...]
    pad: int


def warp(logits: torch.Tensor, s: Sampler) -> torch.Tensor:
    """fp32 scores after transformers' Temperature -> TopK -> TopP warpers (min_tokens_to_keep=1)."""
    scores = logits.float()
    if not s.do_sample:
        return scores
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(max(s.top_k, 1), scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)  # ties with the k-th are kept
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(-1).cumsum(-1) <= (1 - s.top_p)
        remove[..., -1:] = False  # the most likely token is always kept
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -math.inf)
    return scores


def pick(scores: torch.Tensor, s: Sampler) -> torch.Tensor:
    """Greedy, or one sample of softmax(scores) (Gumbel-max: argmax(scores + Gumbel noise))."""
    if not s.do_sample:
        return scores.argmax(-1)
    u = torch.rand_like(scores).clamp_(min=torch.finfo(torch.float32).tiny)
    return (scores - torch.log(-torch.log(u))).argmax(-1)


def eos_hit(tokens: torch.Tensor, s: Sampler) -> torch.Tensor:
    hit = torch.zeros_like(tokens, dtype=torch.bool)
    for e in s.eos:
        hit = hit | (tokens == e)
    return hit
