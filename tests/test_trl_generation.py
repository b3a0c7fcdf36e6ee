"""targets.trl_generation: fast generation inside TRL's GRPOTrainer: no recompilation across steps,
sampling log-probs vs TRL's recomputation, weights and trainer state untouched, CPU fallback,
the class-level wrap apply() installs, the graph loop through a training step."""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import FAST_GEN_ATTR, FastGenerationConfig, sampling_mode
from grpo_patches.targets import trl_generation
from grpo_patches.targets.trl_generation import enable_fast_generation
from tests.fastgen_helpers import VARIED, Counting, _counts, _fresh, gpu, greedy, make_trainer  # noqa: F401  (_fresh: autouse)
from tests.helpers import quiet


def _train_and_count(bucket, **config):
    counting = Counting()
    trainer = make_trainer(VARIED, max_steps=4, gradient_checkpointing=True)  # TRL's default is on
    state = enable_fast_generation(trainer, counting.config(bucket=bucket, **config))
    seen, caches = [], []
    original = trainer._tokenize_prompts
    trainer._tokenize_prompts = lambda prompts: (out := original(prompts), seen.append(len(out[0][0])))[0]
    get = state.pool.get
    state.pool.get = lambda *a: (cache := get(*a), caches.append(cache))[0]
    trainer.train()
    return trainer, state, counting, seen, caches


@pytest.mark.parametrize("release", [False, True])
def test_no_recompilation_across_steps_with_different_prompt_lengths(release):
    trainer, state, counting, seen, caches = _train_and_count(bucket=16, release_after_sampling=release)
    assert seen == [3, 6, 9, 5], "the steps must see different prompt lengths"
    assert state.calls == 4 and state.compiled
    assert counting.compiles == 1 and state.graphs_after_first_call == 0
    assert counting.runs >= 4 * 6, "decoding ran compiled at every step"
    assert len(caches) >= 4 and all(c.layers[0].max_cache_len == 16 + 8 for c in caches)
    if release:  # the cache is freed after every round (training gets the memory) and built again, same shape
        assert len({id(c) for c in caches}) == len(caches) and not state.pool.caches
        assert state.merged.flat is None and state.merged.allocations == 4
    else:  # one static cache, reset in place at every step: stable addresses for CUDA graphs
        assert all(c is caches[0] for c in caches) and len(state.pool.caches) == 1
        assert state.merged.flat is not None and state.merged.allocations == 1 and state.merged.refreshes == 4
    # the run did contain the upstream condition that would otherwise recompile at every step:
    # gradient checkpointing's input hooks pile up on the embeddings (TRL toggles it per generation)
    embeddings = trainer.model.get_input_embeddings()
    assert len(embeddings._forward_hooks) >= 4
    # meaningful: an unbucketed cache (length = prompt + new tokens, as transformers sizes it)
    # recompiles when a longer prompt arrives
    _, state1, counting1, _, _ = _train_and_count(bucket=1)
    assert counting1.compiles == 3 and state1.graphs_after_first_call == 2  # 3 -> 6 -> 9 tokens


@pytest.fixture(scope="module")
def recorded():
    """A trainer (LoRA dropout 0.05, temperature 0.7) sampling once through the compiled wrapper."""
    quiet()
    torch._dynamo.reset()
    counting = Counting()
    trainer = make_trainer(VARIED, temperature=0.7, max_completion_length=10)
    state = enable_fast_generation(trainer, counting.config(record_sampling_logprobs=True))
    model = trainer.model
    model.train()
    flags = {name: m.training for name, m in model.named_modules()}
    snapshot = {name: p.detach().clone() for name, p in model.named_parameters()}
    generation_config = trainer.generation_config
    torch.manual_seed(5)
    out = trainer._generate([VARIED[1]] * 4)
    return dict(trainer=trainer, state=state, counting=counting, out=out, flags=flags, snapshot=snapshot,
                generation_config=generation_config)


def _trl_logps(trainer, prompt_ids_list, completion_ids_list):
    from trl.trainer.utils import pad

    pad_id = trainer.processing_class.pad_token_id
    prompt = pad([torch.tensor(x) for x in prompt_ids_list], padding_value=pad_id, padding_side="left")
    pmask = pad([torch.ones(len(x), dtype=torch.long) for x in prompt_ids_list], padding_value=0, padding_side="left")
    completion = pad([torch.tensor(x) for x in completion_ids_list], padding_value=pad_id, padding_side="right")
    cmask = pad([torch.ones(len(x), dtype=torch.long) for x in completion_ids_list], padding_value=0,
                padding_side="right")
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt, completion], 1), torch.cat([pmask, cmask], 1), completion.size(1))
    return logps, cmask.bool()


def test_sampling_logprobs_agree_with_trl_recomputed_logprobs(recorded):
    trainer, state = recorded["trainer"], recorded["state"]
    prompt_ids_list, completion_ids_list = recorded["out"][0], recorded["out"][1]
    assert state.compiled and recorded["counting"].runs > 0
    sampled = state.last_sampling_logprobs
    assert [len(r) for r in sampled] == [len(c) for c in completion_ids_list]
    assert sum(len(c) for c in completion_ids_list) >= 8
    rec = torch.zeros(len(sampled), max(len(r) for r in sampled))
    for i, row in enumerate(sampled):
        rec[i, :len(row)] = torch.tensor(row)

    model = trainer.model
    with sampling_mode(model):  # TRL's recomputation with dropout off: the sampling policy
        logps_eval, mask = _trl_logps(trainer, prompt_ids_list, completion_ids_list)
    err = (logps_eval - rec)[mask].abs().max().item()
    assert err < 1e-4, err
    # meaningful: the same recomputation with LoRA dropout on (training mode) differs, so the test
    # would catch sampling with dropout, and temperature / position errors move it further still
    model.train()
    torch.manual_seed(0)
    logps_train, _ = _trl_logps(trainer, prompt_ids_list, completion_ids_list)
    assert (logps_train - rec)[mask].abs().max().item() > 1e-3


def test_generation_leaves_weights_and_trainer_state_as_they_were(recorded):
    trainer, snapshot = recorded["trainer"], recorded["snapshot"]
    params = dict(trainer.model.named_parameters())
    base = [n for n in snapshot if "lora_" not in n]
    assert base and all(torch.equal(params[n], snapshot[n]) for n in snapshot)  # bit-identical, LoRA too
    assert trainer.generation_config is recorded["generation_config"]  # TRL's own object, unchanged
    assert trainer.generation_config.disable_compile is True
    assert trainer.pad_to_multiple_of is None
    assert {n: m.training for n, m in trainer.model.named_modules()} == recorded["flags"]


def test_trainer_with_bucketed_prompts_compiled_matches_upstream_greedy():
    """pad_prompts through TRL's own pad_to_multiple_of, compiled, vs stock TRL eager (greedy)."""
    prompts = [VARIED[0], VARIED[2], VARIED[3], VARIED[1]]
    stock = make_trainer(VARIED, lora_dropout=0.0, generation_kwargs={"do_sample": False})
    stock.model.eval()  # dropout is 0 here; eval only so stock and fast see the same modules
    expected = stock._generate(prompts)[1]
    fast = make_trainer(VARIED, lora_dropout=0.0, generation_kwargs={"do_sample": False})
    counting = Counting()
    enable_fast_generation(fast, counting.config(pad_prompts=True, bucket=16))
    fast.model.eval()
    assert fast._generate(prompts)[1] == expected
    assert counting.compiles == 1 and counting.runs > 0
    assert any(len(c) > 1 for c in expected), "completions long enough to compare"


@pytest.mark.parametrize("merge", [False, True])
def test_cpu_without_force_warns_once_runs_eager_with_dropout_off(merge):
    trainer = make_trainer(VARIED)
    state = enable_fast_generation(trainer, {"merge_lora": merge})
    model = trainer.model
    model.train()
    seen = []
    dropout = next(m for n, m in model.named_modules() if n.endswith("lora_dropout.default"))
    dropout.register_forward_pre_hook(lambda m, a: seen.append(m.training))
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        trainer._generate([VARIED[0]] * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # TRL's own read of transformers >= 5.24's deprecated alias, stock's on every sampling call too
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        trainer._generate([VARIED[1]] * 4)
    assert state.compiled is False and state.calls == 2 and "cpu" in state.reason
    if merge:  # sampled from the merged buffer: the adapter's dropout is not even on the path
        with sampling_mode(model):
            mergeable = len(generation.mergeable_layers(model))
        assert seen == [] and state.merged_layers == mergeable > 0
    else:
        assert seen and not any(seen), "LoRA dropout was on while sampling"
    assert dropout.training and model.training, "training flags restored"
    seen.clear()
    model(input_ids=torch.tensor([[5, 6, 7]]))
    assert seen == [True], "the loss's forward keeps LoRA dropout"


def test_disabled_and_config_coercion():
    assert FastGenerationConfig.coerce(False) is None and FastGenerationConfig.coerce(None) is None
    assert FastGenerationConfig.coerce(True) == FastGenerationConfig()
    assert FastGenerationConfig.coerce({"bucket": 32}).bucket == 32
    with pytest.raises(ValueError):
        FastGenerationConfig(bucket=0)
    with pytest.raises(TypeError):
        FastGenerationConfig.coerce("fast")
    trainer = make_trainer(VARIED)
    enable_fast_generation(trainer, True)
    enable_fast_generation(trainer, False)
    assert not hasattr(trainer, FAST_GEN_ATTR)
    trainer._generate([VARIED[0]] * 4)  # wrapper present, state gone: upstream path


def test_class_level_wrap_as_apply_installs_it():
    """What the adapter does: wrap GRPOTrainer._generate_single_turn once; enable per trainer."""
    import wrapt
    from trl import GRPOTrainer

    original = GRPOTrainer.__dict__["_generate_single_turn"]
    wrapt.wrap_function_wrapper(GRPOTrainer, "_generate_single_turn", trl_generation.wrap_generate)
    try:
        assert trl_generation.class_wrapped(GRPOTrainer)
        trainer = make_trainer(VARIED)
        counting = Counting()
        state = enable_fast_generation(trainer, counting.config())
        assert "_generate_single_turn" not in vars(trainer), "no second, instance-level wrapper"
        trainer._generate([VARIED[2]] * 4)
        assert state.calls == 1 and counting.compiles == 1 and counting.runs > 0
        plain = make_trainer(VARIED)  # built without fast generation: upstream path, no state
        plain._generate([VARIED[2]] * 4)
        assert not hasattr(plain, FAST_GEN_ATTR) and counting.compiles == 1
    finally:
        GRPOTrainer._generate_single_turn = original
    assert GRPOTrainer.__dict__["_generate_single_turn"] is original


@gpu
@pytest.mark.slow
def test_gpu_trainer_steps_compile_once():
    trainer = make_trainer(VARIED, max_steps=4, gradient_checkpointing=True, use_cpu=False)
    state = enable_fast_generation(trainer, True)
    _, skips0 = _counts()
    trainer.train()
    assert state.compiled and state.calls == 4
    assert state.graphs_compiled >= 1 and state.graphs_after_first_call == 0
    assert state.pool.built == 4 and not state.pool.caches, "the cache is released after every round"
    assert state.merged_layers > 0 and state.merged.refreshes == 4 and state.merged.flat is None
    assert _counts()[1] == skips0, "no CUDA-graph skip"


def test_graph_loop_trainer_step_through_apply():
    import grpo_patches

    grpo_patches.apply(fast_generation={"decode_loop": "graph", "force_compile": True, "backend": "aot_eager"})
    try:
        trainer = make_trainer(VARIED, max_steps=2, gradient_checkpointing=True, max_completion_length=8)
        state = getattr(trainer, FAST_GEN_ATTR)
        assert state.config.decode_loop == "graph"
        seen = []
        original = trainer._generate_single_turn

        def spy(*a, **k):
            out = original(*a, **k)
            seen.append(out)
            return out

        trainer._generate_single_turn = spy
        trainer.train()
    finally:
        grpo_patches.revert()
    assert state.compiled and state.calls == 2
    assert state.graph.calls == 2 and state.graph.fallbacks == 0 and state.graph.steps > 0
    assert state.graphs_after_first_call == 0
    for completion_ids, logprobs in seen:
        assert len(completion_ids) == 4 and logprobs is None
        assert all(1 <= len(c) <= 8 for c in completion_ids)
        assert all(1 not in c[:-1] for c in completion_ids), "nothing after a row's EOS"
    assert trainer.state.global_step == 2


@gpu
@pytest.mark.slow
def test_gpu_graph_loop_trainer_steps_compile_once():
    trainer = make_trainer(VARIED, max_steps=4, gradient_checkpointing=True, use_cpu=False)
    state = enable_fast_generation(trainer, FastGenerationConfig(decode_loop="graph"))
    _, skips0 = _counts()
    trainer.train()
    assert state.compiled and state.calls == 4
    assert state.graph.calls == 4 and state.graph.fallbacks == 0
    assert state.graphs_compiled >= 1 and state.graphs_after_first_call == 0
    assert state.pool.built == 4 and not state.pool.caches, "the cache is released after every round"
    assert state.merged_layers > 0 and state.merged.refreshes == 4 and state.merged.flat is None
    assert _counts()[1] == skips0, "no CUDA-graph skip"
