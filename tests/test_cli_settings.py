"""The public preflight surface as a user calls it, misspelt settings, and one
steps_per_generation rule shared by preflight, ``doctor --set`` and defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_patches.cli import main as cli_main
from grpo_patches.grouping import resolve_steps_per_generation
from grpo_patches.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(per_device_train_batch_size=4, steps_per_generation=1, num_generations=4, max_completion_length=64)

# Each order a user may import in; every snippet calls grpo_patches.preflight(...) twice.
ORDERS = {
    "package attribute first": "import grpo_patches\nf = lambda: grpo_patches.preflight",
    "import grpo_patches.preflight first": "import grpo_patches.preflight\nf = lambda: grpo_patches.preflight",
    "from-import of the function first": "from grpo_patches.preflight import preflight as g\nimport grpo_patches\n"
                                         "f = lambda: grpo_patches.preflight",
    "from grpo_patches import preflight": "from grpo_patches import preflight\nf = lambda: preflight",
    "attribute, then the submodule import": "import grpo_patches\nfirst = grpo_patches.preflight\n"
                                            "import grpo_patches.preflight\nf = lambda: grpo_patches.preflight",
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_preflight_is_callable_twice_after_each_import_order(order):
    code = ORDERS[order] + textwrap.dedent(f"""
        from grpo_patches.preflight import PreflightReport
        for _ in range(2):
            report = f()("qwen2.5-0.5b", grpo_config={SMALL!r}, warn=False)
            assert isinstance(report, PreflightReport), type(report)
        import inspect
        assert "grpo_config" in inspect.signature(f()).parameters
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_misspelt_setting_is_a_type_error_with_close_matches():
    with pytest.raises(TypeError, match=r"'num_generation' \(did you mean num_generations"):
        preflight("qwen2.5-0.5b", grpo_config=dict(SMALL, num_generation=3), warn=False)
    import types

    with pytest.raises(TypeError, match="per_device_train_batchsize"):
        preflight("qwen2.5-0.5b", grpo_config=types.SimpleNamespace(per_device_train_batchsize=2), warn=False)


def test_cli_set_misspelt_name_exits_2_with_close_matches(capsys):
    assert cli_main(["doctor", "--model", "qwen2.5-0.5b", "--set", "num_generation=3"]) == 2
    err = capsys.readouterr().err
    assert "'num_generation'" in err and "num_generations" in err
    # a real TRL field that preflight does not model is accepted
    assert cli_main(["doctor", "--model", "qwen2.5-0.5b", "--set", "num_generations=4",
                     "--set", "learning_rate=1e-5"]) == 0


def test_generation_batch_size_is_honoured():
    # per rank: 2 per micro-batch x (16 / (2 x 2)) = 8 completions: whole groups of 8. Before the fix the
    # generation batch was ignored (steps = gradient_accumulation_steps = 1: 2 completions) and refused.
    shape = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, generation_batch_size=16,
                 num_generations=8, max_completion_length=64)
    report = preflight("qwen2.5-0.5b", grpo_config=shape, world_size=2, warn=False)
    assert report.ok and report.settings["steps_per_generation"] == 4
    from grpo_patches.cli import main

    assert main(["doctor", "--model", "qwen2.5-0.5b", "--world-size", "2"]
                + [f"--set={k}={v}" for k, v in shape.items()]) == 0
    with pytest.raises(ValueError, match="both set"):
        preflight("qwen2.5-0.5b", grpo_config=dict(shape, steps_per_generation=4), world_size=2, warn=False)
    with pytest.raises(ValueError, match="multiple of the global batch"):
        preflight("qwen2.5-0.5b", grpo_config=dict(shape, generation_batch_size=10), world_size=2, warn=False)


@pytest.mark.parametrize(("batch", "accum", "steps", "gen_batch"), [
    (1, 4, None, None), (2, 3, None, None), (2, 1, 4, None), (4, 2, None, 16), (3, 1, None, 12), (2, 2, None, 3),
    (1, 1, 2, 2),
])
def test_steps_per_generation_equals_trls_own_derivation(tmp_path, batch, accum, steps, gen_batch):
    """The same rule as trl.GRPOConfig.__post_init__ (world size 1 here), refusals included."""
    import trl

    settings = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                    steps_per_generation=steps, generation_batch_size=gen_batch)
    try:
        config = trl.GRPOConfig(str(tmp_path), num_generations=2, use_cpu=True, bf16=False, **settings)
    except ValueError as refusal:
        assert "generation_batch_size" in str(refusal) or "steps_per_generation" in str(refusal), refusal
        with pytest.raises(ValueError):
            resolve_steps_per_generation(settings, world_size=1)
        return
    assert resolve_steps_per_generation(settings, world_size=1) == config.steps_per_generation
    assert resolve_steps_per_generation(config, world_size=1) == config.steps_per_generation


def test_defaults_use_the_same_rule(tmp_path, monkeypatch):
    import warnings

    from grpo_patches.defaults import grpo_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="both set"):
            grpo_config(str(tmp_path), per_device_train_batch_size=2, steps_per_generation=4,
                        generation_batch_size=16, num_generations=8, use_cpu=True)
