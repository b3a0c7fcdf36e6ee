"""I6: apply / revert / double apply / unsupported releases, on the attributes the adapter declares.

The wrapped attributes are read from the selected adapter (``registry.select(...).available()``),
never listed here, and revert is checked on the whole class ``__dict__``: an attribute left wrapped,
or one added and not removed, fails. Import-order cases need a fresh interpreter each: see
tests/test_import_order.py.
"""

from __future__ import annotations

import pytest
import wrapt
from packaging.version import Version

import grpo_patches
from grpo_patches import registry
from grpo_patches.targets.dsm import ADAPTER as DSM


@pytest.fixture(autouse=True)
def clean():
    grpo_patches.revert()
    yield
    grpo_patches.revert()


def declared() -> dict[type, list[str]]:
    """Every (class, attribute) the adapters for the installed release declare they wrap."""
    out: dict[type, list[str]] = {}
    for adapter in (registry.select(registry.installed_trl_version()), DSM):
        out.setdefault(adapter.target_class(), []).extend(adapter.available())
    return out


def snapshot() -> dict[type, dict]:
    return {cls: dict(vars(cls)) for cls in declared()}


def changed(before: dict[type, dict]) -> list[str]:
    out = []
    for cls, attrs in before.items():
        now = dict(vars(cls))
        out += [f"{cls.__name__}.{k}" for k in set(attrs) | set(now) if attrs.get(k, "<absent>") is not now.get(k, "<absent>")]
    return out


def originals():
    from trl.trainer.grpo_trainer import GRPOTrainer

    return dict(vars(GRPOTrainer))


def test_the_adapter_declares_the_methods_it_replaces():
    names = {cls.__name__: names for cls, names in declared().items()}
    assert {"__init__", "_get_train_sampler"} <= set(names["GRPOTrainer"])  # every era wraps these two
    assert len(names["GRPOTrainer"]) >= 3 and names["DSMGRPOTrainer"]


def test_apply_wraps_every_declared_attribute_and_revert_restores_identical_objects():
    before = snapshot()
    assert grpo_patches.apply() is True and grpo_patches.is_applied()
    for cls, names in declared().items():
        for name in names:
            attr = cls.__dict__[name]
            assert isinstance(attr, wrapt.FunctionWrapper), f"{cls.__name__}.{name} is not wrapped"
            assert not isinstance(attr.__wrapped__, wrapt.FunctionWrapper)
            assert attr.__wrapped__ is before[cls].get(name, getattr(cls.__mro__[1], name, None))
    grpo_patches.revert()
    assert not grpo_patches.is_applied()
    assert changed(before) == []


def test_apply_twice_does_not_wrap_twice_and_updates_options():
    before = snapshot()
    grpo_patches.apply()
    grpo_patches.apply(reward_placement="main")
    from grpo_patches import options

    for cls, names in declared().items():
        for name in names:  # one layer only
            assert cls.__dict__[name].__wrapped__ is before[cls].get(name, getattr(cls.__mro__[1], name, None))
    assert options.active().reward_placement == "main"
    grpo_patches.revert()
    assert changed(before) == []


def test_revert_twice_and_patch_revert_patch():
    before = snapshot()
    grpo_patches.revert()
    grpo_patches.apply()
    grpo_patches.revert()
    grpo_patches.revert()
    assert changed(before) == []
    grpo_patches.apply()
    for cls, names in declared().items():
        for name in names:
            assert cls.__dict__[name].__wrapped__ is before[cls].get(name, getattr(cls.__mro__[1], name, None))
    grpo_patches.revert()
    assert changed(before) == []


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
