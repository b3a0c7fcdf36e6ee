"""Fork mode: upstream TRL with its patch applied, in an environment where grpo_patches is NOT importable,
keeps the invariants: tests/matrix (I1-I6 on 2 ranks, each upstream first) runs there in fork mode
(``GRPO_PATCHES_MATRIX_MODE=fork``, tests/matrix/kit.py) for the newest supported release here;
``nox -t fork-groups`` (CI) runs it for one release of every group of equal edit patches, ``nox -t fork`` for
every release. The GRPOConfig settings a patch adds are probed here on the oldest and the newest release.

The upstream half of every check there is the fork's off switch, ``GRPOConfig(grpo_patches=False)``.
For the release this (kit) environment has, the fork's run is compared with the monkeypatch's run of the
same scenario here: the off switch gives what ``revert()``-ed, pristine TRL gives, and each setting gives
what ``apply()`` with that option gives (same samples, advantages, reward calls, refusals and errors).
GRPO_PATCHES_REQUIRE_FORK_TESTS=1 (CI) turns a missing uv into a failure instead of a skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from grpo_patches import fork as fork_patches
from tests.fork import env as fork_env
from tests.launch import describe
from tests.matrix.test_invariants import launched

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
FORK = ROOT / "tests" / "fork"
TRL_TARGETS = [t for t in fork_patches.targets() if t.release != "vendored"]
ENDS = [TRL_TARGETS[0], TRL_TARGETS[-1]]  # the oldest and the newest supported release
VENDORED = next(t for t in fork_patches.targets() if t.release == "vendored")
_envs: dict[str, Path] = {}


def fork_python(target, tmp_path_factory) -> Path:
    """A venv with the release's pinned set and pytest, its patch applied (built once per test session)."""
    if target.release not in _envs:
        try:
            _envs[target.release] = fork_env.patched(target.release,
                                                     tmp_path_factory.mktemp(f"fork-{target.release}") / "venv")
        except fork_env.EnvironmentUnavailable as exc:
            if os.environ.get("GRPO_PATCHES_REQUIRE_FORK_TESTS") == "1":
                raise
            pytest.skip(str(exc))
    return _envs[target.release]


def run_json(cmd, cwd, env=None) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**clean, **(env or {})}, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def monkeypatch_matrix() -> list[dict]:
    """tests/matrix's scenario through grpo_patches.apply() / revert() in this (kit) environment."""
    results = launched(2)  # the same launch tests/matrix/test_invariants.py reads, if it ran first
    assert all(r.returncode == 0 for r in results), describe(results)
    return [r.data for r in results]


_TIMING = {"seconds", "main_seconds", "stage_ends_s", "fault_started", "ended", "killed_after", "hung", "returncode"}
_PER_MODE = {"mode", "kit_importable", "wrapt_imported", "i6", "children"}


def comparable(rank: dict) -> dict:
    """A rank's record without what differs by mode or by run: timings, scratch paths, the gloo
    transport's wording; of the fault children, what the failing ranks raised (the peers of an upstream
    failure lose the cause in ways that depend on timing)."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in _TIMING}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, str):
            return re.sub(r"^.*/(rm-rank\d+/)", r"\1", value)
        return value

    out = clean({k: v for k, v in rank.items() if k not in _PER_MODE})
    out["children"] = {name: {k: child.get(k) for k in ("raised", "remote", "error")}
                       for name, child in rank["children"].items()
                       if name.startswith("patched_") or rank["rank"] == 1}  # rank 1 is upstream's failing rank
    return out


@pytest.mark.parametrize("target", ENDS[-1:], ids=lambda t: t.name)  # every edit group: nox -t fork-groups
def test_patched_fork_keeps_the_invariants_without_the_kit(target, tmp_path_factory, request):
    python = fork_python(target, tmp_path_factory)
    save = tmp_path_factory.mktemp(f"ranks-{target.release}") / "ranks.json"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/matrix"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**clean, "GRPO_PATCHES_MATRIX_MODE": "fork", "GRPO_PATCHES_MATRIX_SAVE": str(save),
                               "GRPO_PATCHES_TRL_VERSION": target.release})
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-3000:]
    assert re.search(r"\b\d+ passed\b", done.stdout) and "failed" not in done.stdout, done.stdout[-3000:]
    fork = json.loads(save.read_text())
    assert [(d["mode"], d["trl"], d["kit_importable"]) for d in fork] == [("fork", target.release, False)] * 2
    if target.release == version("trl"):
        # Same release as this environment's: GRPOConfig(grpo_patches=False) is pristine upstream
        # (grpo_patches reverted) on every upstream half, and every setting does what apply() does.
        kit = request.getfixturevalue("monkeypatch_matrix")
        for f, m in zip(fork, kit, strict=True):
            got, want = comparable(f), comparable(m)
            for key in sorted(set(got) | set(want)):
                assert got.get(key) == want.get(key), f"rank {f['rank']}: {key} differs, fork vs monkeypatch"


@pytest.mark.parametrize("target", ENDS, ids=lambda t: t.name)
def test_apply_options_are_grpo_config_fields(target, tmp_path_factory):
    got = run_json([str(fork_python(target, tmp_path_factory)), str(FORK / "settings_probe.py")],
                   cwd=tmp_path_factory.getbasetemp())
    assert got["kit_importable"] is False
    assert got["defaults"] == {"grpo_patches": True, "reward_placement": "local", "reward_chunk_size": None,
                               "reward_timeout": 600.0, "fast_generation": None}
    assert got["parsed"] == {"grpo_patches": False, "reward_placement": "main", "reward_chunk_size": 8,
                             "reward_timeout": 30.0, "fast_generation": None}
    reward_site = "_prepare_inputs" if target.adapter_attr == "V015" else "_calculate_rewards"
    assert {"__init__", "_get_train_sampler", reward_site} <= set(got["wrapped"])
    assert "reward_placement='nowhere'" in got["bad_setting"] and "'local'" in got["bad_setting"]
    if target.adapter_attr == "V015":
        assert "_generate_single_turn" in got["fast_generation"]  # refused before 0.29, as apply() does
    else:
        assert got["fast_generation"] is True
    assert got["wrapt_imported"] is False


def test_patched_vendored_trainer_behaves_like_the_monkeypatch(tmp_path, tmp_path_factory):
    """dsm_grpo_rank_local.patch + dsm_grpo.patch on a copy of the vendored file, run where grpo_patches is not
    importable, give the same step as grpo_patches.apply(fast_generation=...) on the kit's own copy (off, then on)."""
    folder = tmp_path / "fork"
    folder.mkdir()
    shutil.copy(fork_patches.KIT / "vendored" / "dsm_grpo.py", folder)
    subprocess.run(["git", "apply", str(fork_patches.bundle_of(VENDORED).patch_path), str(VENDORED.patch_path)], cwd=folder,
                   check=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    python = fork_python(ENDS[-1], tmp_path_factory)  # the newest release's set: the kit's own pins
    fork = run_json([str(python), str(FORK / "dsm_step.py"), str(folder)], cwd=tmp_path,
                    env={"GRPO_PATCHES_KIT_MODE": "fork"})
    kit = run_json([sys.executable, "-c", "import runpy, sys; sys.argv = ['dsm_step', '-']; "
                    f"runpy.run_path({str(FORK / 'dsm_step.py')!r}, run_name='__main__')"], cwd=ROOT,
                   env={"GRPO_PATCHES_KIT_MODE": "monkeypatch"})
    assert fork["kit_importable"] is False and kit["kit_importable"] is True
    assert fork["wrapt_imported"] is False
    assert fork["off"]["fast_calls"] is None and kit["off"]["fast_calls"] is None  # unpatched sampling
    assert fork["on"]["fast_calls"] == 1 and kit["on"]["fast_calls"] == 1  # sample() went the fast way
    for label in ("off", "on"):
        assert fork[label]["metrics"] == pytest.approx(kit[label]["metrics"], abs=1e-6), label


def test_the_kit_free_smoke_script_passes_on_the_patched_fork_and_fails_on_stock(tmp_path_factory, tmp_path):
    """examples/fork_smoke.py, what a fork maintainer runs: OK with the patched release and no kit; with this
    environment's stock TRL (and the kit importable) it names what is missing."""
    script = str(ROOT / "examples" / "fork_smoke.py")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    fork = subprocess.run([str(fork_python(ENDS[-1], tmp_path_factory)), script, "--timeout", "240"], cwd=tmp_path,
                          capture_output=True, text=True, env=clean, timeout=300)
    assert fork.returncode == 0 and "fork smoke: OK" in fork.stdout, fork.stdout[-3000:] + fork.stderr[-3000:]
    stock = subprocess.run([sys.executable, script, "--timeout", "240"], cwd=tmp_path, capture_output=True, text=True,
                           env=clean, timeout=300)
    assert stock.returncode == 1 and "fork smoke: FAILED" in stock.stdout, stock.stdout[-3000:]
    assert "trl.trainer.grpo_rank_local is missing" in stock.stdout and "grpo_patches is importable" in stock.stdout
