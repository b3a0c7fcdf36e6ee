"""apply()'s options as a user passes them: NumPy scalars (read from a config or computed) mean the Python
value they stand for; strings, bools where a number belongs, and out-of-range values are refused naming the
option and the value."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_patches.options import MAX_REWARD_TIMEOUT, PatchOptions, resolve_speed

INTS = (np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint64)
FLOATS = (np.float32, np.float64)


@settings(max_examples=60, deadline=None)
@given(chunk=st.integers(1, 120), timeout=st.floats(0.5, MAX_REWARD_TIMEOUT / 2), int_type=st.sampled_from(INTS),
       float_type=st.sampled_from(FLOATS), flag=st.booleans())
def test_numpy_scalars_mean_the_python_value(chunk, timeout, int_type, float_type, flag):
    plain = PatchOptions(reward_chunk_size=chunk, reward_timeout=float(float_type(timeout)), strict=flag,
                         lean_lora=False, compile_training=flag)
    numpy = PatchOptions(reward_chunk_size=int_type(chunk), reward_timeout=float_type(timeout), strict=np.bool_(flag),
                         lean_lora=np.bool_(False), compile_training=np.bool_(flag))
    assert numpy == plain
    assert type(numpy.reward_chunk_size) is int and type(numpy.strict) is bool
    assert type(numpy.compile_training) is bool and type(numpy.reward_timeout) is float
    assert PatchOptions(reward_timeout=int_type(min(chunk, 100))).reward_timeout == min(chunk, 100)
    assert resolve_speed(np.bool_(flag), fast_generation=None, lean_lora=False, compile_training=None) == \
        resolve_speed(flag, fast_generation=None, lean_lora=False, compile_training=None)


@pytest.mark.parametrize("name,value", [
    ("reward_chunk_size", "8"), ("reward_chunk_size", 8.0), ("reward_chunk_size", np.float64(8)),
    ("reward_chunk_size", True), ("reward_chunk_size", np.bool_(True)), ("reward_chunk_size", 0),
    ("reward_timeout", "600"), ("reward_timeout", True), ("reward_timeout", np.bool_(True)),
    ("reward_timeout", float("nan")), ("reward_timeout", np.float64("inf")), ("reward_timeout", 0),
    ("reward_timeout", MAX_REWARD_TIMEOUT * 2), ("strict", "False"), ("strict", 0), ("lean_lora", "true"),
    ("lean_lora", 1), ("compile_training", np.int64(1)), ("compile_reward_models", "on"), ("freeze_gc", 1), ("overlap_micro_batches", "yes"),
    ("reward_placement", "Main"),
    ("reward_failure", "drop"),
])
def test_values_a_user_may_type_by_mistake_are_refused_with_the_name(name, value):
    with pytest.raises((TypeError, ValueError)) as info:
        PatchOptions(**{name: value})
    assert f"{name}=" in str(info.value)


@pytest.mark.parametrize("raw,allowed", [("1", True), ("yes", True), ("True", True), ("0", False), ("", False),
                                         ("off", False)])
def test_allow_unknown_takes_yes_and_no_words(monkeypatch, raw, allowed):
    from grpo_patches import registry

    monkeypatch.setenv(registry.ALLOW_UNKNOWN_ENV, raw)
    assert registry._env_flag(registry.ALLOW_UNKNOWN_ENV) is allowed


@pytest.mark.parametrize("raw", ["2", "maybe", "1.0"])
def test_allow_unknown_refuses_other_values_naming_the_variable(monkeypatch, raw):
    from grpo_patches import registry

    monkeypatch.setenv(registry.ALLOW_UNKNOWN_ENV, raw)
    with pytest.raises(ValueError, match=f"GRPO_PATCHES_ALLOW_UNKNOWN={raw!r}"):
        registry._env_flag(registry.ALLOW_UNKNOWN_ENV)


@pytest.mark.parametrize("raw", ["99999", "14", "SIGALRM", "sigalrm", "NOPE", "0"])
def test_watchdog_signal_refuses_what_it_cannot_use_naming_the_variable(monkeypatch, raw):
    """A number outside the platform's signals, or SIGALRM by number or name (left to math_verify), is refused
    at once, naming GRPO_PATCHES_WATCHDOG_SIGNAL, not later by signal.signal without the variable's name."""
    from grpo_patches import watchdog

    monkeypatch.setenv(watchdog.SIGNAL_ENV, raw)
    with pytest.raises(ValueError, match="GRPO_PATCHES_WATCHDOG_SIGNAL"):
        watchdog._wake_signal()


def test_watchdog_signal_takes_names_and_numbers(monkeypatch):
    import signal

    from grpo_patches import watchdog

    for raw, want in (("SIGUSR2", signal.SIGUSR2), ("sigusr1", signal.SIGUSR1), (str(int(signal.SIGUSR2)), signal.SIGUSR2),
                      ("none", None)):
        monkeypatch.setenv(watchdog.SIGNAL_ENV, raw)
        assert watchdog._wake_signal() == want
