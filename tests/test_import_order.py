"""I6 ordering set in the style of ddtrace's ``PatchTestCase``: each case in a fresh interpreter.

A test process that has already imported TRL cannot tell "import TRL, then apply" from "apply, then
import TRL", so every case below runs in its own ``python -c`` and reports what it saw as JSON. Each
case asserts something a bug can break: a trainer built after ``apply()`` is patched (its sampler is
the kit's; the options of the latest ``apply()`` hold: a chunk size that cuts groups is refused), one
built after ``revert()`` is stock (TRL's own sampler), each method carries one wrapper layer, and after
``revert()`` every attribute of the patched class is the identical original object. (A shape that
splits groups cannot tell the two apart in one process: TRL's own global-batch check refuses it there.) The cases run concurrently (one interpreter each, two at a time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import json, sys
from tests.helpers import grpo_args, prompt_dataset, quiet, tiny_policy, tiny_tokenizer
quiet()
OUT = {}

def snapshot():
    from trl.trainer.grpo_trainer import GRPOTrainer
    return dict(vars(GRPOTrainer))

def layers(name):
    # how many wrapt layers sit on GRPOTrainer.<name>
    import wrapt
    from trl.trainer.grpo_trainer import GRPOTrainer
    attr, n = GRPOTrainer.__dict__[name], 0
    while isinstance(attr, wrapt.FunctionWrapper):
        attr, n = attr.__wrapped__, n + 1
    return n

def build(cls, **shape):
    return cls(model=tiny_policy(), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
               args=grpo_args(**shape), train_dataset=prompt_dataset(8), processing_class=tiny_tokenizer())

def probe(cls):
    # which sampler a trainer built now gets: the kit's RankLocalGroupSampler, or TRL's own
    import inspect
    trainer = build(cls, per_device_train_batch_size=4, num_generations=4)
    takes_dataset = "dataset" in inspect.signature(trainer._get_train_sampler).parameters
    sampler = trainer._get_train_sampler(trainer.train_dataset) if takes_dataset else trainer._get_train_sampler()
    return {"sampler": type(sampler).__name__}

def same(before, after):
    return sorted(k for k in set(before) | set(after) if before.get(k, "<absent>") is not after.get(k, "<absent>"))
"""

CASES = {
    "import_trl_then_apply": """
        import trl
        from trl.trainer.grpo_trainer import GRPOTrainer
        before = snapshot()
        import grpo_patches
        grpo_patches.apply()
        OUT["patched"] = probe(trl.GRPOTrainer)
        grpo_patches.revert()
        OUT["changed"] = same(before, snapshot())
    """,
    "apply_then_import_trl": """
        import grpo_patches
        OUT["trl_imported_by_grpo_patches"] = "trl" in sys.modules
        grpo_patches.apply()
        import trl
        OUT["patched"] = probe(trl.GRPOTrainer)
    """,
    "from_trl_import_before_apply": """
        from trl import GRPOTrainer
        import grpo_patches
        grpo_patches.apply()
        OUT["patched"] = probe(GRPOTrainer)  # the name bound before apply() sees the patch
    """,
    "apply_twice": """
        import grpo_patches
        from grpo_patches import options
        grpo_patches.apply(reward_chunk_size=4)
        grpo_patches.apply(reward_chunk_size=3)
        OUT["layers"] = {name: layers(name) for name in ("__init__", "_get_train_sampler")}
        from trl import GRPOTrainer
        try:  # the second call's options hold: chunks of 3 would cut groups of 4
            build(GRPOTrainer, per_device_train_batch_size=4, num_generations=4)
            OUT["refused"] = None
        except ValueError as exc:
            OUT["refused"] = str(exc)
        OUT["chunk"] = options.active().reward_chunk_size
    """,
    "revert_twice": """
        import grpo_patches
        from trl import GRPOTrainer
        before = snapshot()
        grpo_patches.revert()
        grpo_patches.apply()
        grpo_patches.revert()
        grpo_patches.revert()
        OUT["changed"] = same(before, snapshot())
        OUT["stock"] = probe(GRPOTrainer)
        OUT["applied"] = grpo_patches.is_applied()
    """,
    "apply_revert_apply": """
        import grpo_patches
        from trl import GRPOTrainer
        before = snapshot()
        grpo_patches.apply()
        grpo_patches.revert()
        grpo_patches.apply()
        OUT["layers"] = {name: layers(name) for name in ("__init__", "_get_train_sampler")}
        OUT["patched"] = probe(GRPOTrainer)
        grpo_patches.revert()
        OUT["changed"] = same(before, snapshot())
    """,
}


def run_case(name: str) -> dict:
    script = PRELUDE + textwrap.dedent(CASES[name]) + "\nprint('RESULT ' + json.dumps(OUT))\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, f"{name} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def outcomes():
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(run_case, CASES), strict=True))


def assert_patched(seen: dict) -> None:
    assert seen["sampler"] == "RankLocalGroupSampler", seen


def assert_stock(seen: dict) -> None:
    assert seen["sampler"] in ("RepeatSampler", "RepeatRandomSampler"), seen


def test_import_trl_then_apply(outcomes):
    assert_patched(outcomes["import_trl_then_apply"]["patched"])
    assert outcomes["import_trl_then_apply"]["changed"] == []


def test_apply_then_import_trl(outcomes):
    seen = outcomes["apply_then_import_trl"]
    assert seen["trl_imported_by_grpo_patches"] is False, "import grpo_patches must not import trl"
    assert_patched(seen["patched"])


def test_from_trl_import_grpotrainer_before_apply(outcomes):
    assert_patched(outcomes["from_trl_import_before_apply"]["patched"])


def test_apply_twice_wraps_once_and_takes_the_new_options(outcomes):
    seen = outcomes["apply_twice"]
    assert seen["layers"] == {"__init__": 1, "_get_train_sampler": 1}
    assert seen["chunk"] == 3
    assert "reward_chunk_size=3" in (seen["refused"] or ""), seen


def test_revert_twice_leaves_stock_trl(outcomes):
    seen = outcomes["revert_twice"]
    assert seen["changed"] == [] and seen["applied"] is False
    assert_stock(seen["stock"])


def test_apply_revert_apply_patches_again_once(outcomes):
    seen = outcomes["apply_revert_apply"]
    assert seen["layers"] == {"__init__": 1, "_get_train_sampler": 1}
    assert_patched(seen["patched"])
    assert seen["changed"] == []
