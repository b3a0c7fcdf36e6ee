"""generation.fast: ``fast_generate`` compiled vs eager on the same weights (fp32 tokens, bf16 logits),
fresh weights after an optimizer step, a presized cache, prompts left-padded to a bucket."""

from __future__ import annotations

import pytest
import torch

from grpo_patches.generation import FastGenerationConfig, fast_generate
from tests.fastgen_helpers import (  # noqa: F401  (_fresh: autouse)
    Counting,
    _counts,
    _fresh,
    batch,
    eager_generate,
    eos_prone_policy,
    gpu,
    greedy,
    lora_policy,
)


def test_compiled_greedy_equals_eager_fp32_tokens():
    model = lora_policy()
    counting = Counting()
    config = counting.config()
    for lengths in ([5, 9, 7, 3], [11, 4, 8, 6]):
        ids, mask = batch(lengths, seed=sum(lengths))
        eager = eager_generate(model, ids, mask)
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(fast, eager), lengths
    assert counting.compiles == 1, "one compiled decode graph for both prompt lengths"
    assert counting.runs >= 2 * 11, "every decode step after the prefill ran compiled"
    # meaningful: the tokens depend on the LoRA adapter and are not degenerate
    with model.disable_adapter():
        base = eager_generate(model, ids, mask)
    assert not torch.equal(base, eager)
    assert len(set(eager[:, ids.shape[1]:].flatten().tolist())) > 3


def test_compiled_bf16_logits_match_eager_within_tolerance():
    model = lora_policy(dtype=torch.bfloat16)
    ids, mask = batch([6, 9, 4, 8])
    counting = Counting()
    kw = dict(output_logits=True, return_dict_in_generate=True)
    eager = eager_generate(model, ids, mask, **kw)
    fast = fast_generate(model, ids, mask, generation_config=greedy(), config=counting.config(), **kw)
    assert counting.compiles == 1 and counting.runs > 0
    width = ids.shape[1]

    def worst(a, b, seqs_a, seqs_b):
        """Largest logit difference over the steps where both runs decoded the same prefix."""
        diffs, compared = [], 0
        for t in range(min(len(a.logits), len(b.logits))):
            same = (seqs_a[:, width:width + t] == seqs_b[:, width:width + t]).all(dim=1)
            if same.any():
                diffs.append((a.logits[t][same].float() - b.logits[t][same].float()).abs().max())
                compared += int(same.sum())
        return max(diffs), compared

    scale = max(lg.float().abs().max() for lg in eager.logits)
    tol = 0.05 * scale + 2e-2  # bf16: a few ulps of the logits (measured: 0.008 at scale 0.4)
    err, compared = worst(fast, eager, fast.sequences, eager.sequences)
    assert compared >= 4 and err <= tol, (err, tol)
    # meaningful: the adapter moves the logits by far more than the tolerance
    with model.disable_adapter():
        base = eager_generate(model, ids, mask, **kw)
    err_base, _ = worst(base, eager, base.sequences, eager.sequences)
    assert err_base > 5 * tol, (err_base, tol)


def test_presized_cache_without_reuse_is_correct_and_compiles_once():
    """max_prompt_length sizes the cache up front (bucket 1 would otherwise grow it per length);
    reuse_cache=False lets transformers allocate a new static cache per call."""
    model = lora_policy()
    counting = Counting()
    config = counting.config(bucket=1, max_prompt_length=16, reuse_cache=False)
    for lengths in ([5, 9, 7, 3], [11, 4, 8, 13]):
        ids, mask = batch(lengths, seed=len(lengths) + max(lengths))
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(fast, eager_generate(model, ids, mask)), lengths
    assert counting.compiles == 1 and counting.runs > 0


@pytest.mark.parametrize("decode_loop", ["transformers", "graph"])
def test_compiled_path_uses_weights_changed_by_an_optimizer_step(decode_loop):
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    counting = Counting()
    config = counting.config(decode_loop=decode_loop)
    before = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    assert torch.equal(before, eager_generate(model, ids, mask))
    compiles = counting.compiles

    # a real optimizer step on the LoRA weights (the base weights are frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.05)
    model.train()
    targets = torch.randint(4, 19, before.shape, generator=torch.Generator().manual_seed(3))
    full_mask = torch.cat([mask, torch.ones_like(before[:, ids.shape[1]:])], dim=1)
    model(input_ids=before, attention_mask=full_mask, labels=targets).loss.backward()
    opt.step()
    opt.zero_grad()

    after_eager = eager_generate(model, ids, mask)
    assert not torch.equal(after_eager, before), "the step must change greedy output, or staleness is invisible"
    after_fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    assert torch.equal(after_fast, after_eager)
    assert counting.compiles == compiles, "the same compiled graph ran with the new weights"


def test_left_padding_to_a_bucket_gives_identical_greedy_tokens_fp32():
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    eager = eager_generate(model, ids, mask)
    padded = fast_generate(model, ids, mask, generation_config=greedy(),
                           config=FastGenerationConfig(compile=False, pad_prompts=True, bucket=16))
    assert padded.shape[1] == 16 + 12
    assert torch.equal(padded[:, 16:], eager[:, ids.shape[1]:])
    # meaningful: the same pads, attended (mask 1), change the tokens
    wide = torch.cat([torch.zeros(4, 16 - ids.shape[1], dtype=torch.long), ids], 1)
    attended = eager_generate(model, wide, torch.ones_like(wide))
    assert not torch.equal(attended[:, 16:], eager[:, ids.shape[1]:])


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("decode_loop", ["transformers", "graph"])
def test_gpu_default_config_equals_eager_no_stale_weights_no_recompile(decode_loop):
    # the graph loop on an EOS-prone policy: early stops, pads after EOS and the trim are checked too
    model = (lora_policy() if decode_loop == "transformers" else eos_prone_policy()).cuda()
    # inductor, reduce-overhead (CUDA graphs), static, bucket 64
    config = FastGenerationConfig(decode_loop=decode_loop, check_every=4)
    graphs0, skips0 = _counts()
    warm = None
    for step, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6], [2, 13, 9, 9])):
        ids, mask = (t.cuda() for t in batch(lengths, seed=step))
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(fast, eager_generate(model, ids, mask)), lengths
        warm = warm if warm is not None else _counts()[0]
    assert _counts()[0] == warm > graphs0, "no recompilation after the first call"
    # optimizer step, then the same graph must use the new weights
    before = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    model(input_ids=before, labels=torch.randint(4, 19, before.shape, device="cuda")).loss.backward()
    opt.step()
    after_eager = eager_generate(model, ids, mask)
    assert not torch.equal(after_eager, before)
    assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config), after_eager)
    assert _counts() == (warm, skips0), "no recompilation, no CUDA-graph skip"
