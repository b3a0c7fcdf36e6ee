"""``doctor --tune``: every layout at the user's completions per optimizer step, the memory of each, the pick."""

from __future__ import annotations

import json

import pytest

from grpo_patches.cli import main as cli_main
from grpo_patches.grouping import check_group_shape
from grpo_patches.preflight import preflight
from grpo_patches.preflight.report import GiB
from grpo_patches.preflight.tune import tune

USER = {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 32}  # 1024 completions per step


def test_a_1_5b_policy_on_24_gib_gets_a_micro_batch_that_fits_at_the_same_completions_per_step():
    t = tune("qwen2-1.5b", gpu_memory_gb=24, grpo_config=USER)
    best = t.best
    assert t.completions_per_step == 1024
    assert all(c.micro_batch * c.accumulation == 1024 for c in t.candidates)
    assert best is not None and best.required + 2 * GiB <= 24 * GiB
    # the rule: no fitting candidate has a larger micro-batch, nor the same one with a larger generation batch
    assert not [c for c in t.candidates if c.fits and (c.micro_batch, c.generation_batch)
                > (best.micro_batch, best.generation_batch)]
    # and something larger than the pick was tried and does not fit: the pick is the memory's limit, not the grid's
    assert [c for c in t.candidates if c.micro_batch > best.micro_batch and not c.fits]
    assert best.generation_batch == best.micro_batch * best.steps_per_generation
    assert not best.sample_ahead


@pytest.mark.parametrize(("world_size", "num_generations"), [(1, 4), (2, 6), (4, 16)])
def test_every_candidate_holds_whole_groups_per_rank_per_round(world_size, num_generations):
    user = {"per_device_train_batch_size": 12, "gradient_accumulation_steps": 4, "num_generations": num_generations}
    t = tune("qwen2.5-0.5b", gpu_memory_gb=80, grpo_config=user, world_size=world_size, allow_sample_ahead=True)
    assert t.candidates
    for c in t.candidates:
        check_group_shape(per_device_batch_size=c.micro_batch, steps_per_generation=c.steps_per_generation,
                          num_generations=num_generations, world_size=world_size)
        assert c.micro_batch * c.accumulation == 48
    # each layout of 48 per rank whose rounds hold whole groups is listed (none dropped but those that cut one)
    listed = {(c.micro_batch, c.steps_per_generation) for c in t.candidates}
    expected = {(b, s) for b in range(1, 49) if 48 % b == 0
                for s in [d for d in range(1, 48 // b + 1) if (48 // b) % d == 0] + [2 * 48 // b, 4 * 48 // b]
                if (b * s) % num_generations == 0}
    assert listed == expected


def test_sampling_ahead_only_when_allowed_and_its_extra_pass_counted():
    plain = tune("qwen2.5-0.5b", gpu_memory_gb=80, grpo_config=USER)
    ahead = tune("qwen2.5-0.5b", gpu_memory_gb=80, grpo_config=USER, allow_sample_ahead=True)
    assert not [c for c in plain.candidates if c.steps_per_generation > c.accumulation]
    extra = [c for c in ahead.candidates if c.steps_per_generation > c.accumulation]
    assert extra and all(c.sample_ahead and c.passes == 2 * c.accumulation for c in extra)
    assert all(c.passes == c.accumulation for c in plain.candidates)


def test_doctor_tune_prints_every_candidate_and_the_pick(capsys):
    argv = ["doctor", "--model", "qwen2-1.5b", "--gpu-memory-gb", "24", "--tune",
            "--set", "per_device_train_batch_size=32", "--set", "gradient_accumulation_steps=32"]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "pick: per_device_train_batch_size=" in text and "generation batch" in text and "<- pick" in text
    assert cli_main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pick = data["pick"]
    assert data["completions_per_step"] == 1024 and pick["fits"]
    assert pick["per_device_train_batch_size"] * pick["gradient_accumulation_steps"] == 1024
    assert pick["generation_batch_size"] == pick["per_device_train_batch_size"] * pick["steps_per_generation"]
    assert len(data["candidates"]) == len(tune("qwen2-1.5b", gpu_memory_gb=24, grpo_config=USER).candidates)


def test_nothing_fitting_exits_1_naming_the_closest(capsys):
    argv = ["doctor", "--model", "qwen2-1.5b", "--gpu-memory-gb", "6", "--tune",
            "--set", "per_device_train_batch_size=8", "--set", "gradient_accumulation_steps=2"]
    assert cli_main(argv) == 1
    text = capsys.readouterr().out
    t = tune("qwen2-1.5b", gpu_memory_gb=6, grpo_config={"per_device_train_batch_size": 8,
                                                        "gradient_accumulation_steps": 2})
    closest = min(t.candidates, key=lambda c: c.required)
    assert t.best is None and "none fits" in text
    assert (f"closest: per_device_train_batch_size={closest.micro_batch}, gradient_accumulation_steps="
            f"{closest.accumulation}, steps_per_generation={closest.steps_per_generation}") in text
    assert cli_main([*argv, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["pick"] is None and data["closest"]["required_gib"] == round(closest.required / GiB, 3)


def test_tune_needs_the_gpu_memory(capsys):
    assert cli_main(["doctor", "--model", "qwen2-1.5b", "--tune"]) == 2
    assert "--tune needs --gpu-memory-gb" in capsys.readouterr().err


def test_the_micro_batch_comes_before_the_generation_batch():
    """Where the largest micro-batch cannot reach the largest generation batch that fits, it still wins."""
    import dataclasses

    t = tune("qwen2-1.5b", gpu_memory_gb=24, grpo_config=USER)
    top = t.best
    fitting_gens = {c.generation_batch for c in t.candidates if c.fits and c.micro_batch == top.micro_batch}
    # drop the pick's own largest generation batch: a smaller micro-batch still reaches it
    grid = dataclasses.replace(t, candidates=[c for c in t.candidates if c is not top])
    assert [c for c in grid.candidates if c.fits and c.generation_batch == top.generation_batch]
    assert grid.best.micro_batch == top.micro_batch
    assert grid.best.generation_batch == max(fitting_gens - {top.generation_batch})


#: The H200 grid's setup (benchmarks/bench_grpo.py --grid): 1.5B policy, a 0.5B reward model, 32-token prompts,
#: 256-token completions, 1024 completions per step, apply(speed=True), a 24 GiB cap.
GRID = {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 32, "max_completion_length": 256}
GRID_KW = {"reward_models": ["qwen2.5-0.5b"], "prompt_length": 32, "fast_generation": True, "lean_lora": True}


def grid_report(micro: int, settings: dict | None = None, **kw):
    """``preflight``'s report for the grid's layout at micro-batch ``micro`` (one generation round of 1024), as
    ``tune`` builds each candidate's; ``settings`` override GRPO settings, ``kw`` the preflight options."""
    rounds = 1024 // micro
    config = {**GRID, "per_device_train_batch_size": micro, "gradient_accumulation_steps": rounds,
              "steps_per_generation": rounds, **(settings or {})}
    return preflight("qwen2-1.5b", grpo_config=config, gpu_memory_gb=24, raise_on_error=False, warn=False,
                     **{**GRID_KW, **kw})


def test_the_training_phase_predicts_the_h200_grid():
    """The training phase's own peak, H200 grid (benchmarks/results/2026-12-03-h200-grid/): the training phase at 128
    compiled, 64 with Liger's kernels in place of compile_training (eager memory), and stock TRL at 128; and at 64
    compiled, a micro-batch the factor was not fitted on (benchmarks/results/2026-12-03-h200-aten-rng/)."""
    for micro, kw, measured in ((128, {"compile_training": True}, 13.47), (64, {}, 8.08),
                                (128, {"fast_generation": False, "lean_lora": False}, 15.31),
                                (64, {"compile_training": True}, 8.88)):
        predicted = grid_report(micro, **kw).ranks[0].phases["training"] / GiB
        assert predicted == pytest.approx(measured, rel=0.07), (micro, kw, predicted)


def test_compiled_training_is_counted_and_the_pick_stays_below_the_measured_out_of_memory():
    """On the H200, micro-batches of 256 with compile_training ran out of memory in the compiled backward under
    24 GiB (the eager-calibrated estimate said 19.58 GiB): counted, the pick is the next micro-batch down, the
    layout the grid measured fastest."""
    eager = tune("qwen2-1.5b", gpu_memory_gb=24, grpo_config=GRID, **GRID_KW)
    compiled = tune("qwen2-1.5b", gpu_memory_gb=24, grpo_config=GRID, compile_training=True, **GRID_KW)
    by_layout = {(c.micro_batch, c.steps_per_generation): c for c in eager.candidates}
    for c in compiled.candidates:
        e = by_layout[(c.micro_batch, c.steps_per_generation)].report.ranks[0]
        r = c.report.ranks[0]
        assert r.phases["generation"] == e.phases["generation"]  # sampling runs the eager layers
        assert r.components["activations"] > e.components["activations"]
    assert eager.best.micro_batch == 256  # what the eager model picks: the layout that ran out of memory
    assert not next(c for c in compiled.candidates if (c.micro_batch, c.steps_per_generation) == (256, 4)).fits
    assert (compiled.best.micro_batch, compiled.best.generation_batch) == (128, 1024)


def test_doctor_speed_is_the_three_options(capsys):
    argv = ["doctor", "--model", "qwen2-1.5b", "--gpu-memory-gb", "24", "--tune", "--json", "--prompt-length", "32",
            "--reward-model", "qwen2.5-0.5b", *[f"--set={k}={v}" for k, v in GRID.items()]]
    assert cli_main([*argv, "--speed"]) == 0
    speed = json.loads(capsys.readouterr().out)
    assert cli_main([*argv, "--fast-generation", "--lean-lora", "--compile-training"]) == 0
    assert json.loads(capsys.readouterr().out) == speed
    assert cli_main([*argv, "--fast-generation", "--lean-lora"]) == 0
    assert json.loads(capsys.readouterr().out)["pick"] != speed["pick"]


def test_the_report_s_activation_line_is_the_run_s_layers():
    """The "activations: ... with gradient checkpointing" line reads what the table's activations row holds."""
    for kw in ({}, {"compile_training": True}, {"lean_lora": False, "fast_generation": False}):
        for ckpt in (True, False):
            report = grid_report(128, {"gradient_checkpointing": ckpt}, **kw)
            line = report.activations_checkpointed if ckpt else report.activations_full
            assert line == report.ranks[0].components["activations"], (kw, ckpt)


def test_the_generation_phase_counts_the_sampler_and_predicts_the_h200_rows():
    """transformers' warpers keep more of the last token's logits than the kit's compiled sampler: per logit of
    the generation batch, 2 (the model's bf16 logits) + 4 (their fp32 copy) + 8 (probabilities, multinomial's
    noise); + 4 for temperature's copy; top-p sorts every row: 24 (values, indices, the sort's scratch) in
    place of the 8. Against the sampling phase's peak measured on the H200 (benchmarks/results/
    2026-12-04-h200-top-p/, micro-batch 128): stock with the pinned sampler at generation batch 512 took
    11.70 GiB (three fp32 copies predicted 9.97, 15% short), stock plain at 1024 17.49; the kit pinned 18.42."""
    plain, pinned = {"temperature": 1.0, "top_p": 1.0}, {"temperature": 0.7, "top_p": 0.9}
    stock = {"fast_generation": False, "lean_lora": False}

    def generation(micro, rounds, settings, **kw):
        config = {**settings, "steps_per_generation": rounds}
        report = preflight("qwen2-1.5b", grpo_config={**GRID, "per_device_train_batch_size": micro,
                                                      "gradient_accumulation_steps": 1024 // micro, **config},
                           gpu_memory_gb=24, raise_on_error=False, warn=False, **{**GRID_KW, **kw})
        return report.ranks[0]

    vocab = 151936
    for rows, rounds in ((512, 4), (1024, 8)):
        a, b = generation(128, rounds, plain, **stock), generation(128, rounds, pinned, **stock)
        assert b.components["generation_transient"] - a.components["generation_transient"] == rows * vocab * 20
        t_only = generation(128, rounds, {"temperature": 0.7, "top_p": 1.0}, **stock)
        assert t_only.components["generation_transient"] - a.components["generation_transient"] == rows * vocab * 4
        k_only = generation(128, rounds, {"temperature": 1.0, "top_p": 1.0, "top_k": 50}, **stock)
        assert k_only.components["generation_transient"] == t_only.components["generation_transient"]
        # the kit's graph loop: the same for every sampler
        fast = [generation(128, rounds, s).components["generation_transient"] for s in (plain, pinned)]
        assert fast[0] == fast[1]
    for settings, rounds, kw, measured in ((pinned, 4, stock, 11.70), (plain, 8, stock, 17.49), (pinned, 8, {}, 18.42)):
        predicted = generation(128, rounds, settings, **kw).phases["generation"] / GiB
        assert predicted == pytest.approx(measured, rel=0.08), (settings, rounds, kw, predicted)
    assert generation(128, 4, pinned, **stock).phases["generation"] / GiB == pytest.approx(11.70, rel=0.02)


def test_a_sampler_setting_out_of_range_is_refused_naming_it():
    for name, value in (("temperature", 0), ("temperature", "hot"), ("top_p", 1.5), ("top_p", -0.1), ("top_k", -1)):
        with pytest.raises(ValueError, match=f"{name}="):
            preflight("qwen2-1.5b", grpo_config={**GRID, name: value}, gpu_memory_gb=24, warn=False)


def test_a_grpo_config_without_top_p_samples_without_it():
    """TRL < 0.19's GRPOConfig has no top_p (it samples without); a dict leaving it out gets the pinned 0.9."""
    import dataclasses

    from grpo_patches.preflight.settings import resolve_settings

    @dataclasses.dataclass
    class OldConfig:  # GRPOConfig's shape before top_p
        per_device_train_batch_size: int = 8
        temperature: float = 0.9

    kw = dict(lora_config=None, world_size=1, gpu_memory_gb=24, reward_placement="local", prompt_length=32,
              dtype=None, logits_mode="full")
    assert resolve_settings(OldConfig(), **kw).sampler == (0.9, 0, 1.0)
    assert resolve_settings({"per_device_train_batch_size": 8}, **kw).sampler == (0.7, 0, 0.9)
