"""generation.sampler: the compiled decode step's warping. Its top-p keeps exactly the tokens transformers'
``TopPLogitsWarper`` keeps (a threshold search instead of a sort of the vocabulary), ties at the boundary
kept whole; on the GPU the fused loop samples with it at a real vocabulary, compiled. Its sample is the
token whose cumulative-mass interval holds one uniform per row, as a search over the whole vocabulary's
cumulative sum finds it."""

from __future__ import annotations

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import FastGenerationConfig, fast_generate
from grpo_patches.generation.sampler import BLOCK, Sampler, inverse_cdf, nucleus, order_keys, pick, warp
from tests.fastgen_helpers import batch, gpu, transformers_warped


def _sampler(temperature=1.0, top_k=0, top_p=1.0):
    return Sampler(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, eos=(1,), pad=0)


def _transformers_kept(logits, temperature, top_k, top_p):
    """The tokens transformers' warpers (Temperature -> TopK -> TopP, as generate builds them) keep."""
    return transformers_warped(logits, temperature, top_k, top_p) > -float("inf")


def _mass_above(scores):
    """Per token, the float64 probability mass of the tokens scoring strictly higher (the definition)."""
    probs = scores.double().softmax(-1)
    ordered, order = scores.double().sort(-1, descending=True)
    cum = probs.gather(-1, order).cumsum(-1)
    # tokens tied with a token share its mass-above: the cumulative mass before the first of the tie
    first = torch.searchsorted(-ordered, -ordered, right=False)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], -1).gather(-1, first)
    return torch.empty_like(before).scatter_(-1, order, before)


@pytest.mark.parametrize("top_k", [0, 50])
@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9, 0.95])
def test_warp_keeps_what_transformers_warpers_keep_fp32(top_k, top_p):
    torch.manual_seed(top_k + int(top_p * 100))
    logits = torch.randn(64, 1000) * 1.5
    kept = warp(logits, _sampler(0.7, top_k, top_p)) > -float("inf")
    expected = _transformers_kept(logits, 0.7, top_k, top_p)
    assert torch.equal(kept, expected), (kept ^ expected).nonzero()[:5]
    # meaningful: the truncation removed tokens, and by a different amount in different rows
    counts = kept.sum(-1)
    assert counts.max() < 1000 and counts.min() >= 1 and len(counts.unique()) > 3


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_bf16_top_p_is_the_definition_with_ties_kept_whole(top_p):
    """bf16 logits tie often: a token is kept iff the mass scoring strictly above it is below top_p, so a
    tie at the boundary is kept whole. transformers' sort keeps an arbitrary part of such a tie; elsewhere
    the two agree."""
    torch.manual_seed(0)
    logits = (torch.randn(256, 4096) * 3).bfloat16()
    s = _sampler(0.7, 0, top_p)
    kept = warp(logits, s) > -float("inf")
    above = _mass_above(logits.float() / 0.7)
    definition = above < top_p
    close = (above - top_p).abs() < 1e-5  # within fp32 rounding of the boundary: either way is right
    assert torch.equal(kept & ~close, definition & ~close)
    assert not (kept ^ definition)[close.logical_not()].any()
    differs = kept ^ _transformers_kept(logits, 0.7, 0, top_p)
    assert (differs & ~kept).sum() == 0, "never drops a token transformers keeps"
    # what it keeps beyond transformers are tokens tied with the last one transformers keeps
    scores = logits.float() / 0.7
    last_kept = scores.masked_fill(~_transformers_kept(logits, 0.7, 0, top_p), float("inf")).amin(-1, keepdim=True)
    assert torch.equal(differs, differs & (scores == last_kept))
    assert differs.any(), "meaningful: some boundary tie was split by the sort"


def test_order_keys_order_the_values_exactly():
    torch.manual_seed(0)
    specials = torch.tensor([-float("inf"), -65504.0, -3.5, -1.0, -1e-30, 0.0, 1e-30, 0.75, 2.0, 65504.0, float("inf")])
    x = torch.cat([specials, torch.randn(2000) * 5, torch.randn(500) * 1e-3])
    for dtype, bits in ((torch.float32, 32), (torch.bfloat16, 16), (torch.float16, 16)):
        v = x.to(dtype)
        keys, got_bits = order_keys(v)
        assert got_bits == bits and keys.dtype == torch.int32
        assert int(keys.min()) >= -(2 ** (bits - 1)) and int(keys.max()) < 2 ** (bits - 1)
        less, same = v[:, None] < v[None, :], v[:, None] == v[None, :]
        assert torch.equal(keys[:, None] < keys[None, :], less), dtype
        assert torch.equal(keys[:, None] == keys[None, :], same), dtype


def test_nucleus_edge_cases():
    # uniform row: every token ties, all kept; one dominant token: it alone; -inf tokens never
    rows = torch.tensor([[0.0] * 8,
                         [9.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                         [1.0, 1.0, -float("inf"), 0.5, -float("inf"), 0.2, 0.1, 0.0]])
    for top_p in (0.01, 0.5, 0.9, 0.999):
        kept = warp(rows, _sampler(1.0, 0, top_p)) > -float("inf")
        assert kept[0].all()
        assert kept[1, 0] and kept[1, 1:].sum() == 0  # 0.9991 of the mass
        assert kept[2, :2].all() and not kept[2, [2, 4]].any()
        assert torch.equal(kept[1:], _transformers_kept(rows[1:], 1.0, 0, top_p) | (rows[1:] == rows[1:].amax(-1, True)))
    # top_k=1 with top_p: the argmax (and its ties) only
    kept = warp(rows, _sampler(1.0, 1, 0.9)) > -float("inf")
    assert kept.sum(-1).tolist() == [8, 1, 2]
    # the threshold search at every number of cuts a pass
    scores = torch.randn(32, 500) * 2
    keys, bits = order_keys(scores)
    expected = _transformers_kept(scores, 1.0, 0, 0.8)
    for ways in (2, 3, 4, 16):
        assert torch.equal(nucleus(scores, keys, bits, 0.8, ways), expected), ways


@pytest.mark.parametrize("vocab", [BLOCK * 3, BLOCK * 2 + 45, 7])
def test_inverse_cdf_is_the_search_of_the_whole_cumulative_sum(vocab):
    torch.manual_seed(vocab)
    scores = torch.randn(256, vocab) * 3
    scores[:, ::5] = -float("inf")  # weight 0: never picked
    scores[:8, 0], scores[:8, 1:] = 0.0, -float("inf")  # a single token left in a row
    u = torch.rand(256, 1)
    u[:4], u[4:8] = 0.0, 1 - 2 ** -24  # the ends of [0, 1)
    expected = torch.searchsorted(scores.double().softmax(-1).cumsum(-1), u.double(), right=True).squeeze(-1)
    got = inverse_cdf(scores, u)
    assert torch.equal(got, expected.clamp(max=vocab - 1))
    assert torch.isfinite(scores.gather(-1, got.unsqueeze(-1))).all()
    assert (got[:8] == 0).all()
    # u x total can round up to the total (u = 1 - 2**-24): never a weight-0 token after the last positive one
    tail = torch.randn(4, vocab)
    tail[:, vocab // 3:] = -float("inf")
    last = inverse_cdf(tail, torch.ones(4, 1))
    assert torch.isfinite(tail.gather(-1, last.unsqueeze(-1))).all() and (last == vocab // 3 - 1).all()
    # ties: a uniform at a token's upper cumulative bound belongs to the next token
    tied = torch.zeros(1, 4)
    assert inverse_cdf(tied, torch.tensor([[0.5]])).item() == 2 and inverse_cdf(tied, torch.tensor([[0.49]])).item() == 1


def test_pick_samples_softmax_and_greedy_takes_the_argmax():
    torch.manual_seed(0)
    scores = torch.randn(1, BLOCK + 100) * 2
    n = 40000
    freq = torch.bincount(pick(scores.expand(n, -1), _sampler()), minlength=scores.shape[-1]).double() / n
    probs = scores.double().softmax(-1)[0]
    assert (freq - probs).abs().max().item() < 4.5 * (probs.max().item() / n) ** 0.5
    greedy = Sampler(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, eos=(1,), pad=0)
    assert torch.equal(pick(scores, greedy), scores.argmax(-1))


def _real_vocab_policy(vocab=151936, seed=0):
    """A two-layer Llama at a real vocabulary (hidden 64) with LoRA, peaked logits: top-p truncates."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "v_proj"]))


def _sampled_outside_the_nucleus(device, config, seeds, vocab=151936):
    """Sample with the pinned sampler (temperature 0.7, top-p 0.9) at batch 8 over ``vocab`` tokens through
    the fused loop; ``(tokens outside the nucleus of the logits they were drawn from, tokens, truncated rows)``."""
    from transformers import GenerationConfig

    model = _real_vocab_policy(vocab).to(device).eval()
    gc = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9, top_k=0,
                          pad_token_id=0, eos_token_id=[], disable_compile=True)
    stats = generation.GRAPH_STATS
    calls0, fused0 = stats.calls, stats.fused.calls
    violations = tokens = truncated = 0
    for seed in range(seeds):
        ids, mask = (t.to(device) for t in batch([5, 9, 7, 3, 11, 4, 8, 6], seed=seed))
        torch.manual_seed(seed)
        out = fast_generate(model, ids, mask, generation_config=gc, config=config)
        with torch.no_grad():
            full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:])], 1)
            positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: as the decode loop counts them
            logits = model(input_ids=out, attention_mask=full_mask, position_ids=positions).logits
            logits = logits[:, ids.shape[1] - 1:-1].float()
        scores = logits.reshape(-1, logits.shape[-1]) / 0.7
        picked = out[:, ids.shape[1]:].reshape(-1, 1)
        above = _mass_above(scores)
        violations += int((above.gather(-1, picked) > 0.9 + 1e-3).sum())  # margin: step vs full forward rounding
        tokens += picked.numel()
        truncated += int(((above < 0.9).sum(-1) < scores.shape[-1] // 2).sum())
    assert stats.calls == calls0 + seeds and stats.fused.calls == fused0 + seeds, "the fused graph loop sampled"
    assert stats.fused.last_reason == ""
    return violations, tokens, truncated


def test_fused_loop_samples_inside_the_nucleus():
    from tests.fastgen_helpers import Counting

    counting = Counting()
    violations, tokens, truncated = _sampled_outside_the_nucleus("cpu", counting.config(decode_loop="graph"), 2,
                                                                 vocab=16384)
    assert counting.compiles == 1 and counting.runs > 0, "the decode step ran compiled"
    assert violations == 0, f"{violations} of {tokens} tokens outside the nucleus"
    assert truncated > tokens // 2, "meaningful: top-p removed most of the vocabulary"


@gpu
@pytest.mark.slow
def test_gpu_fused_loop_samples_inside_the_nucleus_at_a_real_vocabulary():
    """The same through inductor and a CUDA graph at a real vocabulary: the top-p search compiles (a sort's cumulative sum failed
    inductor's code generation at these shapes)."""
    violations, tokens, truncated = _sampled_outside_the_nucleus("cuda", FastGenerationConfig(decode_loop="graph"), 6)
    assert generation.GRAPH_STATS.fused.capture_errors == []
    assert violations == 0, f"{violations} of {tokens} tokens outside the nucleus"
    assert truncated > tokens // 2, "meaningful: top-p removed most of the vocabulary"
