"""generation.decode: the graph loop (``decode_loop="graph"``, one compiled step per token): greedy
tokens equal eager decoding's, the sampling distribution equals transformers' warpers, fresh noise
per step, fallbacks, and the pooled cache's resets."""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import FastGenerationConfig, fast_generate, sampling_mode
from grpo_patches.targets.trl_generation import enable_fast_generation
from tests.fastgen_helpers import (  # noqa: F401  (_fresh: autouse)
    VARIED,
    Counting,
    _fresh,
    batch,
    eager_generate,
    eos_prone_policy,
    gpu,
    graph_config,
    greedy,
    lora_policy,
    make_trainer,
    transformers_warped,
)


def test_graph_loop_greedy_equals_eager_generate_with_eos_pads_and_trim():
    model = eos_prone_policy()
    counting = Counting()
    config = graph_config(counting, check_every=4)
    stats0 = generation.GRAPH_STATS.calls
    ended_early = trimmed = full = 0
    for seed, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6], [2, 13, 9, 9], [6, 6, 10, 12])):
        ids, mask = batch(lengths, seed=seed)
        eager = eager_generate(model, ids, mask)
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert fast.shape == eager.shape and torch.equal(fast, eager), (lengths, fast, eager)
        completion = eager[:, ids.shape[1]:]
        has_eos = (completion == 1).any(1)
        ended_early += int(has_eos.sum())
        full += int((~has_eos).sum())
        trimmed += completion.shape[1] < 12
    assert generation.GRAPH_STATS.calls == stats0 + 4, "the graph loop ran (no fallback)"
    # meaningful: rows ended with EOS then pads, rows ran to max_new_tokens, and a batch ended early (trim)
    assert ended_early >= 2 and full >= 2 and trimmed >= 1, (ended_early, full, trimmed)
    assert counting.compiles == 1, "one compiled decode step for every prompt length"
    assert counting.runs >= 4 * 3, "the decode steps ran compiled"


def test_graph_loop_prefill_computes_the_last_logits_with_one_plain_matmul():
    """transformers' ``logits_to_keep=1`` hands the LM head a strided ``[B, 1, H]`` slice, which the head runs as a
    batched matmul over an expanded weight (every row reads the whole head: 155 ms at 1024 rows of a 152k vocabulary
    on an H100); the prefill asks for the last position by index, so the head is one ``mm`` over the rows."""
    from torch.profiler import ProfilerActivity, profile

    model = lora_policy()
    vocab = model.config.vocab_size
    ids, mask = batch([5, 9, 7, 3])
    config = graph_config(Counting())
    fast_generate(model, ids, mask, generation_config=greedy(new=3), config=config)  # compiled and warm
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = fast_generate(model, ids, mask, generation_config=greedy(new=3), config=config)
    assert torch.equal(out, eager_generate(model, ids, mask)[:, :ids.shape[1] + 3])
    heads = [(e.name, e.input_shapes) for e in prof.events()
             if e.name in ("aten::mm", "aten::bmm", "aten::addmm") and e.input_shapes and e.input_shapes[-1]
             and e.input_shapes[-1][-1] == vocab]
    assert heads and all(name != "aten::bmm" for name, _ in heads), heads
    assert ("aten::mm", [[4, model.config.hidden_size], [model.config.hidden_size, vocab]]) in heads, heads


def test_graph_loop_prefills_each_repeated_prompt_once_and_decodes_every_row_as_eager():
    """TRL lays out a prompt's G copies as consecutive rows: the prefill runs once per run of equal rows (ids and
    mask) and writes its keys and values to every row of the run; the tokens equal eager decoding's. Equal ids
    under another mask, and a copy that is not next to its prompt, are prefilled on their own."""
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 9], seed=3)
    ids[3], mask[3] = ids[1], mask[1]  # a copy of row 1, not next to it
    rows = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
    ids, mask = ids[rows], mask[rows].clone()
    mask[9, -9:-3] = 0  # the last row: row 3's ids under another mask (its first six tokens masked out)
    seen = []
    embed = model.get_base_model().model.embed_tokens
    hook = embed.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    try:
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(Counting()))
    finally:
        hook.remove()
    assert seen[:1] == [5], f"prefill rows {seen[:1]}: one per run of equal rows (0, 1, 2, 3, 3 under its mask)"
    eager = eager_generate(model, ids, mask)
    assert torch.equal(fast, eager), (fast, eager)
    assert not torch.equal(fast[8, 9:], fast[9, 9:]), "the other mask gave another completion (the case is meaningful)"


def test_graph_loop_passes_the_cache_by_the_name_the_models_forward_takes(monkeypatch):
    """transformers 5.24 renamed a forward's ``past_key_values`` to ``cache`` (the old name warns on every call and
    leaves the forwards in 5.40): the prefill, each prompt's once and every row's, and the decode steps pass the
    cache by the name the model's forward takes; here a forward that takes only ``cache``."""
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 9], seed=3)
    ids, mask = ids[[0, 0, 1, 2, 3]], mask[[0, 0, 1, 2, 3]]  # rows 0 and 1 repeat: the once-per-prompt prefill
    eager = eager_generate(model, ids, mask)
    base = model.get_base_model()
    stock, seen = type(base), []

    class Renamed(stock):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
            assert "past_key_values" not in kwargs, "the cache came by its old name"
            seen.append(cache is not None)
            return stock.forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=cache, **kwargs)

    monkeypatch.setattr(base, "__class__", Renamed)
    fast = fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(Counting()))
    assert torch.equal(fast, eager) and len(seen) > 2 and all(seen), seen
    monkeypatch.setattr(generation.decode, "repeated_rows", lambda *a: None)  # every row prefilled on its own
    seen.clear()
    assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(Counting())),
                       eager)
    assert len(seen) > 2 and all(seen), seen


def test_graph_loop_prefills_every_row_where_the_distinct_prefill_cached_other_layers(monkeypatch):
    """Where the once-per-prompt prefill's cache holds other layers than the static cache (a model that caches
    some layers elsewhere), nothing of it is written: every row is prefilled as before, same tokens."""
    import transformers

    class SkipsLastLayer(transformers.DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == model.config.num_hidden_layers - 1:
                return key_states, value_states  # attends to the prompt, caches nothing
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    model = lora_policy()
    ids, mask = batch([5, 9, 7], seed=4)
    ids, mask = ids[[0, 0, 1, 1, 2, 2]], mask[[0, 0, 1, 1, 2, 2]]
    monkeypatch.setattr(transformers, "DynamicCache", SkipsLastLayer)
    seen = []
    hook = model.get_base_model().model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[0]))
    try:
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(Counting()))
    finally:
        hook.remove()
    assert seen[:2] == [3, 6], f"prefill rows {seen[:2]}: the distinct rows, then every row"
    monkeypatch.undo()
    assert torch.equal(fast, eager_generate(model, ids, mask))


def test_graph_loop_no_recompilation_across_prompt_lengths_in_a_bucket():
    model = lora_policy()
    counting = Counting()
    config = graph_config(counting, bucket=16)
    for lengths in ([3, 5, 2, 4], [9, 4, 8, 6], [14, 13, 16, 1], [7, 7, 7, 7]):
        ids, mask = batch(lengths, seed=len(lengths) + max(lengths))
        fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    assert counting.compiles == 1 and counting.runs >= 4 * 11
    # meaningful: a prompt above the bucket grows the cache, which recompiles the step
    ids, mask = batch([17, 3, 5, 9])
    assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config),
                       eager_generate(model, ids, mask))
    assert counting.compiles == 2


def _warped_probs(logits, temperature, top_k, top_p):
    """transformers' own warpers (Temperature -> TopK -> TopP), as generate builds them."""
    return transformers_warped(logits, temperature, top_k, top_p).softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 6, 1.0), (1.4, 0, 0.7), (0.8, 10, 0.85)])
def test_graph_loop_sampling_distribution_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers import GenerationConfig

    model = lora_policy()
    with torch.no_grad():
        model.get_base_model().lm_head.weight.mul_(8.0)  # peaked logits: temperature / truncation matter
    n = 6000
    prompt = torch.tensor([[5, 9, 4, 12, 7]])
    ids, mask = prompt.expand(n, -1).contiguous(), torch.ones(n, 5, dtype=torch.long)
    gc = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                          pad_token_id=0, eos_token_id=[], disable_compile=True)
    counting = Counting()
    torch.manual_seed(0)
    out = fast_generate(model, ids, mask, generation_config=gc, config=graph_config(counting))
    assert counting.compiles == 1 and counting.runs == 1, "the second token came from the compiled step"
    assert out.shape == (n, 7)
    vocab = model.config.vocab_size

    def check(tokens, logits, meaningful=True):
        probs = _warped_probs(logits, temperature, top_k, top_p)[0].double()
        freq = torch.bincount(tokens, minlength=vocab).double() / len(tokens)
        bound = 4.5 * ((probs * (1 - probs)).max().item() / len(tokens)) ** 0.5 + 1e-3  # 4.5 sigma
        dev = (freq - probs).abs().max().item()
        assert dev < bound, (dev, bound)
        assert freq[probs == 0].sum() == 0, "a token outside top-k / top-p was sampled"
        assert (probs > 0).sum() >= 2, "a real sample, not a forced token"
        if not meaningful:
            return probs
        # meaningful: a wrong temperature, or no truncation, is far outside the bound
        wrong_t = _warped_probs(logits, 1.0, top_k, top_p)[0].double()
        assert (wrong_t - probs).abs().max().item() > 2 * bound
        assert logits.float().softmax(-1)[0][probs == 0].sum().item() > 2 * bound
        return probs

    with torch.no_grad(), sampling_mode(model):
        first_logits = model(input_ids=prompt).logits[:, -1]
    check(out[:, 5], first_logits)  # prefill sample
    first = torch.bincount(out[:, 5], minlength=vocab).argmax()  # second token, given the likeliest first one
    rows = out[:, 5] == first
    assert rows.sum() >= 1000
    with torch.no_grad(), sampling_mode(model):
        second_logits = model(input_ids=torch.cat([prompt, first.view(1, 1)], 1)).logits[:, -1]
    check(out[rows, 6], second_logits, meaningful=False)  # fewer rows: checked by the first token


def test_graph_loop_unsupported_config_falls_back_and_warns_once():
    from transformers import GenerationConfig

    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, repetition_penalty=1.2, pad_token_id=0,
                          disable_compile=True)
    counting = Counting()
    config = graph_config(counting)
    fallbacks = generation.GRAPH_STATS.fallbacks
    with pytest.warns(RuntimeWarning, match="falls back.*repetition_penalty"):
        fast = fast_generate(model, ids, mask, generation_config=gc, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = fast_generate(model, ids, mask, generation_config=gc, config=config)
    assert generation.GRAPH_STATS.fallbacks == fallbacks + 2 and torch.equal(fast, again)
    assert counting.compiles == 1 and counting.runs > 0, "transformers' compiled loop ran"
    with torch.no_grad(), sampling_mode(model):
        eager = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    assert torch.equal(fast, eager)
    # meaningful: the penalty changes the tokens, so running the graph loop would have been wrong
    assert not torch.equal(eager, eager_generate(model, ids, mask)[:, :eager.shape[1]])


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 6, 1.0), (1.4, 0, 0.7)])
def test_gpu_graph_loop_sampling_distribution(temperature, top_k, top_p):
    from transformers import GenerationConfig

    model = lora_policy().cuda()
    with torch.no_grad():
        model.get_base_model().lm_head.weight.mul_(8.0)
    n = 8000
    prompt = torch.tensor([[5, 9, 4, 12, 7]], device="cuda")
    ids, mask = prompt.expand(n, -1).contiguous(), torch.ones(n, 5, dtype=torch.long, device="cuda")
    gc = GenerationConfig(max_new_tokens=3, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                          pad_token_id=0, eos_token_id=[], disable_compile=True)
    config = FastGenerationConfig(decode_loop="graph")
    torch.manual_seed(0)
    fast_generate(model, ids, mask, generation_config=gc, config=config)  # warm-up (records the graph)
    out = fast_generate(model, ids, mask, generation_config=gc, config=config).cpu()
    vocab = model.config.vocab_size
    first = torch.bincount(out[:, 5], minlength=vocab).argmax()
    rows = out[:, 5] == first
    with torch.no_grad(), sampling_mode(model):
        logits = model(input_ids=torch.cat([prompt, first.view(1, 1).cuda()], 1)).logits[:, -1].cpu()
    probs = _warped_probs(logits, temperature, top_k, top_p)[0].double()
    freq = torch.bincount(out[rows, 6], minlength=vocab).double() / int(rows.sum())
    bound = 4.5 * ((probs * (1 - probs)).max().item() / int(rows.sum())) ** 0.5 + 1e-3
    assert (freq - probs).abs().max().item() < bound
    assert freq[probs == 0].sum() == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.slow])])
def test_graph_loop_draws_fresh_noise_at_every_step(device):
    """Uniform logits (a zero lm_head): every step samples uniformly over the vocabulary. A compiled
    step (or a CUDA-graph replay) that reused its random numbers would repeat the previous token in
    every row; fresh noise repeats it with probability 1 / vocab."""
    from transformers import GenerationConfig

    model = lora_policy().to(device)
    with torch.no_grad():
        model.get_base_model().lm_head.weight.zero_()
    vocab = model.config.vocab_size
    ids, mask = batch([5, 9, 7, 3] * 16)
    gc = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          pad_token_id=0, eos_token_id=[], disable_compile=True)
    config = (FastGenerationConfig(decode_loop="graph") if device == "cuda"
              else FastGenerationConfig(decode_loop="graph", force_compile=True, backend="aot_eager"))
    outs = [fast_generate(model, ids.to(device), mask.to(device), generation_config=gc, config=config).cpu()
            for _ in range(2)]  # the second call replays what the first recorded
    for out in outs:
        new = out[:, ids.shape[1]:]
        repeats = (new[:, 2:] == new[:, 1:-1]).double().mean().item()  # compiled steps only
        assert repeats < 4 / vocab + 0.02, f"adjacent tokens equal in {repeats:.1%} of steps"
        assert len(set(new[:, -1].tolist())) > vocab // 4, "rows must draw independently"
    assert not torch.equal(outs[0], outs[1]), "two calls must not replay the same samples"


def test_graph_loop_greedy_with_a_list_of_eos_ids_and_no_pad_id():
    from transformers import GenerationConfig

    model = eos_prone_policy()
    ids, mask = batch([5, 9, 7, 3], seed=1)
    # pad_token_id unset: generate pads with the first EOS id (transformers' rule), as the graph loop does
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=[18, 1], disable_compile=True)
    with torch.no_grad(), sampling_mode(model):
        eager = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    counting = Counting()
    calls = generation.GRAPH_STATS.calls
    fast = fast_generate(model, ids, mask, generation_config=gc, config=graph_config(counting, check_every=2))
    assert generation.GRAPH_STATS.calls == calls + 1 and counting.runs > 0
    assert torch.equal(fast, eager)
    completion = eager[:, ids.shape[1]:]
    assert (completion == 18).any() and completion.shape[1] < 12, "the second EOS id ended rows early"


def _count_resets(monkeypatch):
    from transformers import StaticCache

    resets = []
    original = StaticCache.reset
    monkeypatch.setattr(StaticCache, "reset", lambda self: (resets.append(self), original(self))[1])
    return resets


def test_graph_loop_resets_the_pooled_cache_once_per_call(monkeypatch):
    """A reset writes the whole cache (1.3 GiB at batch 144 of the 1.5B policy): one per call. The
    trainer path used to fetch the pooled cache for the fallback and again for the graph loop."""
    resets = _count_resets(monkeypatch)
    counting = Counting()
    trainer = make_trainer(VARIED, max_steps=3, max_completion_length=8)
    state = enable_fast_generation(trainer, graph_config(counting, release_after_sampling=False))
    trainer.train()
    assert state.graph.calls == 3 and state.graph.fallbacks == 0
    # a new cache is built, not reset, at the first call: one reset at each later call
    assert len(resets) == 2 and all(c is resets[0] for c in resets), len(resets)
    assert state.pool.built == 1
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    del resets[:]
    for _ in range(3):
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(),
                                         config=graph_config(counting, release_after_sampling=False)),
                           eager_generate(model, ids, mask))
    assert len(resets) == 2
    # released after every call (the default): built anew each time, never reset
    del resets[:]
    released = make_trainer(VARIED, max_steps=3, max_completion_length=8)
    state = enable_fast_generation(released, graph_config(counting))
    released.train()
    assert state.pool.built == 3 and resets == [] and not state.pool.caches


def test_graph_loop_without_cache_reuse_builds_a_cache_per_call(monkeypatch):
    from transformers import StaticCache

    built = []
    original = StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *a, **k: (built.append(self), original(self, *a, **k))[1])
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    counting = Counting()
    for _ in range(2):
        fast = fast_generate(model, ids, mask, generation_config=greedy(),
                             config=graph_config(counting, reuse_cache=False))
        assert torch.equal(fast, eager_generate(model, ids, mask))
    assert len(built) == 2 and built[0] is not built[1]
    assert not generation._POOLS[model].caches, "reuse_cache=False keeps no pooled cache"


def test_graph_loop_leaves_a_call_with_its_own_cache_to_transformers():
    """The graph loop prefills from position 0, so it must not run on a caller's cache (which may
    hold a prefix): such a call falls back to transformers' loop, on that cache."""
    from transformers import StaticCache

    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    counting = Counting()
    own = StaticCache(config=model.config, max_cache_len=64)
    fallbacks, calls = generation.GRAPH_STATS.fallbacks, generation.GRAPH_STATS.calls
    with pytest.warns(RuntimeWarning, match="past_key_values"):
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(counting),
                             past_key_values=own)
    assert generation.GRAPH_STATS.fallbacks == fallbacks + 1 and generation.GRAPH_STATS.calls == calls
    assert torch.equal(fast, eager_generate(model, ids, mask))
    assert own.get_seq_length() > 0, "transformers' loop decoded into the caller's cache"
