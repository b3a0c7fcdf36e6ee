"""I6: apply / revert / double apply / import order / unsupported releases (ddtrace's ordering set)."""

from __future__ import annotations

import importlib

import pytest
import wrapt
from packaging.version import Version

import grpo_patches
from grpo_patches import registry

PATCHED = ("__init__", "_get_train_sampler", "_calculate_rewards")


@pytest.fixture(autouse=True)
def clean():
    grpo_patches.revert()
    yield
    grpo_patches.revert()


def originals():
    from trl.trainer.grpo_trainer import GRPOTrainer

    return {name: GRPOTrainer.__dict__[name] for name in PATCHED}


def test_apply_wraps_and_revert_restores_identical_objects():
    before = originals()
    assert grpo_patches.apply() is True and grpo_patches.is_applied()
    from trl.trainer.grpo_trainer import GRPOTrainer

    for name in PATCHED:
        assert isinstance(GRPOTrainer.__dict__[name], wrapt.FunctionWrapper)
        assert GRPOTrainer.__dict__[name].__wrapped__ is before[name]
    grpo_patches.revert()
    assert not grpo_patches.is_applied()
    after = originals()
    assert all(after[name] is before[name] for name in PATCHED)


def test_apply_twice_does_not_wrap_twice_and_updates_options():
    before = originals()
    grpo_patches.apply()
    grpo_patches.apply(reward_placement="main")
    from trl.trainer.grpo_trainer import GRPOTrainer

    from grpo_patches import options

    for name in PATCHED:
        assert GRPOTrainer.__dict__[name].__wrapped__ is before[name]  # one layer only
    assert options.active().reward_placement == "main"


def test_revert_twice_and_patch_revert_patch():
    before = originals()
    grpo_patches.revert()
    grpo_patches.apply()
    grpo_patches.revert()
    grpo_patches.revert()
    grpo_patches.apply()
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert GRPOTrainer.__dict__["_calculate_rewards"].__wrapped__ is before["_calculate_rewards"]


def test_import_before_apply_sees_the_patch():
    from trl import GRPOTrainer  # the user imported it first

    grpo_patches.apply()
    assert isinstance(GRPOTrainer.__dict__["_calculate_rewards"], wrapt.FunctionWrapper)
    import trl

    assert trl.GRPOTrainer is GRPOTrainer


def test_apply_then_import_sees_the_patch():
    grpo_patches.apply()
    trl = importlib.import_module("trl")
    assert isinstance(trl.GRPOTrainer.__dict__["_get_train_sampler"], wrapt.FunctionWrapper)


@pytest.mark.parametrize("bad", [
    {"reward_placement": "gpu1"},
    {"reward_chunk_size": 0},
    {"reward_chunk_size": 2.5},
    {"reward_timeout": -1},
    {"reward_timeout": float("inf")},
])
def test_bad_options_are_refused_at_apply_with_the_value(bad):
    with pytest.raises(ValueError) as info:
        grpo_patches.apply(**bad)
    assert repr(next(iter(bad.values())))[:4] in str(info.value)
    assert not grpo_patches.is_applied()


def test_unknown_future_release_is_refused_strictly(monkeypatch):
    monkeypatch.setattr(registry, "installed_trl_version", lambda: Version("9.0.0"))
    monkeypatch.setattr(grpo_patches, "installed_trl_version", lambda: Version("9.0.0"))
    with pytest.raises(grpo_patches.UnsupportedVersionError) as info:
        grpo_patches.apply()
    assert "9.0.0" in str(info.value) and "supported: trl" in str(info.value)
    assert not grpo_patches.is_applied()


def test_unknown_release_with_strict_false_warns_and_patches_nothing(monkeypatch):
    before = originals()
    monkeypatch.setattr(grpo_patches, "installed_trl_version", lambda: Version("9.0.0"))
    with pytest.warns(UserWarning, match="Nothing was patched"):
        assert grpo_patches.apply(strict=False) is False
    assert originals() == before and not grpo_patches.is_applied()


def test_release_whose_internals_moved_is_refused(monkeypatch):
    from trl.trainer.grpo_trainer import GRPOTrainer

    original = GRPOTrainer.__dict__["_calculate_rewards"]

    def _calculate_rewards(self, inputs, prompts, completions):  # a signature that moved upstream
        return original(self, inputs, prompts, completions, None)

    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", _calculate_rewards)
    with pytest.raises(grpo_patches.UnsupportedVersionError, match="_calculate_rewards"):
        grpo_patches.apply()
    assert GRPOTrainer.__dict__["_get_train_sampler"].__class__ is not wrapt.FunctionWrapper


def test_trl_014_is_left_unpatched_with_a_note(monkeypatch):
    monkeypatch.setattr(grpo_patches, "installed_trl_version", lambda: Version("0.14.0"))
    with pytest.warns(UserWarning, match="already rank-local"):
        assert grpo_patches.apply() is False
