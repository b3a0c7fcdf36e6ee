"""How a decode step picks the next token: transformers' temperature / top-k / top-p warping and the
sample (inverse CDF over vocabulary blocks) or greedy pick, on fixed shapes (no host synchronization), plus
the EOS test."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Sampler", "blocks_of", "eos_hit", "inverse_cdf", "nucleus", "order_keys", "pick", "search_blocks", "warp"]

BLOCK = 128  # vocabulary entries per block of the inverse-CDF sample


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
        keys, bits = order_keys(logits if logits.element_size() == 2 else scores)
        scores = scores.masked_fill(~nucleus(scores, keys, bits, s.top_p), -math.inf)
    return scores


def order_keys(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(keys, bits)``: int32 keys in the order of the float values ``x``, from their bit patterns, and how
    many bits they span (16 for 16-bit floats, else 32).

    ``logits.float() / temperature`` keeps the order of 16-bit logits and keeps distinct ones distinct, so
    their 16-bit keys order the scores exactly and halve the nucleus search."""
    short = x.element_size() == 2
    raw = (x.view(torch.int16) if short else x.float().view(torch.int32)).to(torch.int32)
    magnitude = raw & (0x7FFF if short else 0x7FFFFFFF)  # sign-magnitude: -0.0 and 0.0 both 0
    return torch.where(raw < 0, -magnitude, magnitude), 16 if short else 32


def nucleus(scores: torch.Tensor, keys: torch.Tensor, bits: int, top_p: float, ways: int = 4) -> torch.Tensor:
    """The tokens transformers' ``TopPLogitsWarper(top_p)`` keeps, found without sorting the vocabulary
    (``ways`` >= 2).

    A token is kept iff the probability mass of the tokens scoring strictly higher is below ``top_p`` (so the
    most likely one always): every token whose key is at or above one threshold. A search over the key range
    finds it on fixed shapes: each pass cuts the candidate interval into ``ways`` parts and, per cut, sums the
    mass on its smaller side (one reduction over the rows per cut). On an H200 at a 152k vocabulary the sort it
    replaces cost 14.5 ms per decode step at 1024 rows (the rest of the step ~11 ms), and its cumulative sum
    failed inductor's code generation at 8 rows; this search, at 4 cuts a pass, costs 3.1 and 0.6 ms (2 and 16
    cuts were slower). Differences from the sort: tokens tied with the threshold are kept together (the sort
    keeps an arbitrary part of such a tie), and a boundary mass within fp32 rounding of ``top_p`` may fall the
    other way.
    """
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # unnormalized softmax; -inf scores weigh 0
    total = weights.sum(-1)
    tail = top_p > 0.5  # sum the smaller side (the tail at or below a cut, or the mass above it): less rounding
    target = (1 - top_p) * total if tail else top_p * total
    lo = torch.full_like(total, -(2 ** (bits - 1)), dtype=torch.int64)
    size = 2 ** bits
    while size > 1:
        part = -(-size // ways)  # the last part may be shorter: it only reaches past the key range
        past = []  # per cut: does the threshold lie above it (the mass above the cut still at least top_p)?
        for i in range(1, -(-size // part)):
            cut = (lo + i * part - 1).unsqueeze(-1)
            if tail:
                past.append((torch.where(keys <= cut, weights, 0.0).sum(-1) <= target).long())
            else:
                past.append((torch.where(keys > cut, weights, 0.0).sum(-1) >= target).long())
        lo = lo + sum(past) * part  # the threshold's part: the first whose upper cut leaves less than top_p above
        size = part
    return keys >= lo.unsqueeze(-1)


def pick(scores: torch.Tensor, s: Sampler) -> torch.Tensor:
    """Greedy, or one sample of softmax(scores) per row (:func:`inverse_cdf` of one uniform per row)."""
    if not s.do_sample:
        return scores.argmax(-1)
    return inverse_cdf(scores, torch.rand(scores.shape[0], 1, device=scores.device))


def inverse_cdf(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose interval of softmax(scores)'s cumulative mass holds ``u`` ([B, 1] in [0, 1)): the first
    token whose cumulative weight exceeds ``u`` times the row's total, so never one of weight 0 (-inf scores).

    One random number per row, where a Gumbel-max pick draws one per vocabulary entry: on an H200 that pick
    cost ~0.9 ms per decode step at 1024 rows of a 152k vocabulary, bound by its Philox draws. Here one pass
    over the scores takes each block of ``BLOCK`` entries' maximum and its weights' sum against that maximum
    (rescaled to the row's maximum afterwards: the row's maximum first would read the scores twice, 0.63
    against 0.46 ms a compiled pick at 1024 rows on an H100), a cumulative sum over the blocks finds the
    block, and one over its ``BLOCK`` entries the token (no scan over the whole vocabulary: inductor's split
    scan fails at that length)."""
    padded = blocks_of(scores)
    peaks = padded.amax(-1)  # [B, blocks]; -inf for a block of weight 0
    finite = torch.where(peaks == -math.inf, 0.0, peaks)  # no -inf - -inf (NaN) in such a block
    local = torch.exp(padded - finite.unsqueeze(-1)).sum(-1)
    top = peaks.amax(-1, keepdim=True)
    sums = local * torch.exp(peaks - top)  # [B, blocks], against the row's maximum
    return search_blocks(padded, top, sums, u)


def blocks_of(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` ([B, V]) as ``[B, blocks, BLOCK]``, the last block padded with -inf (weight 0)."""
    rows, vocab = scores.shape
    blocks = -(-vocab // BLOCK)
    padded = scores if vocab == blocks * BLOCK else torch.nn.functional.pad(scores, (0, blocks * BLOCK - vocab),
                                                                           value=-math.inf)
    return padded.view(rows, blocks, BLOCK)


def search_blocks(padded: torch.Tensor, top: torch.Tensor, sums: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`inverse_cdf`'s token from the blocked scores, the row's maximum ``top`` ([B, 1]) and each block's
    weights' sum against it (``sums``, [B, blocks])."""
    rows = padded.shape[0]
    ends = sums.cumsum(-1)
    target = u * ends[:, -1:]
    # the first block ending past target; where ``u * total`` rounds up to the total, the last of positive weight
    block = torch.minimum((ends <= target).sum(-1, keepdim=True), _last_positive(sums))
    left = target - (ends.gather(-1, block) - sums.gather(-1, block))  # what remains inside that block
    inner = torch.exp(padded.gather(1, block.unsqueeze(-1).expand(rows, 1, BLOCK)).squeeze(1) - top)
    index = (inner.cumsum(-1) <= left).sum(-1, keepdim=True)
    # rounding (the block's sum and its cumulative sum add in other orders) can leave ``left`` past the block:
    # then its last token of positive weight, as above
    return (block * BLOCK + torch.minimum(index, _last_positive(inner))).squeeze(-1)


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """Per row ([B, n]), the index of the last positive weight ([B, 1]; 0 where none is)."""
    return torch.where(weights > 0, torch.arange(weights.shape[-1], device=weights.device), 0).amax(-1, keepdim=True)


def eos_hit(tokens: torch.Tensor, s: Sampler) -> torch.Tensor:
    hit = torch.zeros_like(tokens, dtype=torch.bool)
    for e in s.eos:
        hit = hit | (tokens == e)
    return hit
