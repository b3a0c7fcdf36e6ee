"""``apply(speed=True)``: one switch for the measured-fastest GPU path (fast_generation, lean_lora,
compile_training, compile_reward_models, freeze_gc, overlap_micro_batches), each still set by its own option when
given."""

from __future__ import annotations

import pytest

import grpo_patches
from grpo_patches import options
from grpo_patches.generation import FastGenerationConfig

VENDORED = ("vendored",)  # the vendored trainer alone: no TRL import needed to read the options back


@pytest.fixture(autouse=True)
def clean():
    grpo_patches.revert()
    yield
    grpo_patches.revert()


def applied(**kwargs) -> tuple:
    assert grpo_patches.apply(targets=VENDORED, **kwargs)
    opts = options.active()
    return (opts.fast_generation, opts.lean_lora, opts.compile_training, opts.compile_reward_models, opts.freeze_gc,
            opts.overlap_micro_batches)


def test_off_by_default_and_the_switch_turns_on_all_six():
    assert applied() == (None, False, False, False, False, False)
    assert applied(speed=True) == (FastGenerationConfig(), True, True, True, True, True)


@pytest.mark.parametrize(("given", "expected"), [
    ({"compile_training": False}, (FastGenerationConfig(), True, False, True, True, True)),
    ({"compile_reward_models": False}, (FastGenerationConfig(), True, True, False, True, True)),
    ({"freeze_gc": False}, (FastGenerationConfig(), True, True, True, False, True)),
    ({"overlap_micro_batches": False}, (FastGenerationConfig(), True, True, True, True, False)),
    ({"lean_lora": False}, (FastGenerationConfig(), False, True, True, True, True)),
    ({"fast_generation": False}, (None, True, True, True, True, True)),
    ({"fast_generation": {"keep_graph": True}}, (FastGenerationConfig(keep_graph=True), True, True, True, True, True)),
])
def test_an_option_given_wins_over_the_switch(given, expected):
    assert applied(speed=True, **given) == expected


def test_without_the_switch_each_option_is_as_given():
    assert applied(lean_lora=True) == (None, True, False, False, False, False)
    assert applied(compile_training=True, fast_generation=True) == (FastGenerationConfig(), False, True, False, False, False)
    assert applied(compile_reward_models=True) == (None, False, False, True, False, False)
    assert applied(freeze_gc=True) == (None, False, False, False, True, False)
    assert applied(overlap_micro_batches=True) == (None, False, False, False, False, True)


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_a_bad_switch_is_refused_with_its_value(bad):
    with pytest.raises(TypeError, match=r"speed=.* must be True"):
        grpo_patches.apply(targets=VENDORED, speed=bad)
    assert not grpo_patches.is_applied()


def test_a_piece_that_cannot_apply_is_named_and_can_be_dropped(monkeypatch):
    import grpo_patches.lean_lora as lean

    class OldLinear:  # peft < 0.15: the LoRA layer casts its input unconditionally, no switch to turn
        pass

    monkeypatch.setattr(lean, "_lora_linear", lambda: OldLinear)
    with pytest.raises(ValueError, match=r"speed=True turns on lean_lora.*peft >= 0\.15.*Pass lean_lora=False"):
        grpo_patches.apply(targets=VENDORED, speed=True)
    assert not grpo_patches.is_applied()
    assert applied(speed=True, lean_lora=False) == (FastGenerationConfig(), False, True, True, True, True)


def test_options_not_given_are_off():
    """A fork's config passes ``None`` (the option's default) straight to PatchOptions: off, as apply() without speed."""
    opts = options.PatchOptions(lean_lora=None, compile_training=None, compile_reward_models=None, freeze_gc=None,
                                overlap_micro_batches=None)
    assert (opts.lean_lora, opts.compile_training, opts.compile_reward_models, opts.freeze_gc,
            opts.overlap_micro_batches) == (False,) * 5
