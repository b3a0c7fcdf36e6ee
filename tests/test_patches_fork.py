"""Fork mode: upstream TRL with its patch applied, in an environment where grpo_patches is NOT importable,
keeps the invariants (I1 split shape refused, I3 advantages equal upstream's, I4 main placement in
chunks, I5 a raising reward fails every rank with its message), for the oldest and the newest
supported release; ``nox -s fork-<release>`` runs the same driver for every release.

Each case shows upstream first, in the same environment: with ``GRPOConfig(grpo_patches=False)``
the fork runs the release's own code (split shape accepted, groups split across ranks).
GRPO_PATCHES_REQUIRE_FORK_TESTS=1 (CI) turns a missing uv into a failure instead of a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_patches import patchgen
from tests.fork import env as fork_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
FORK = ROOT / "tests" / "fork"
TRL_TARGETS = [t for t in patchgen.targets() if t.release != "vendored"]
ENDS = [TRL_TARGETS[0], TRL_TARGETS[-1]]  # the oldest and the newest supported release
VENDORED = next(t for t in patchgen.targets() if t.release == "vendored")
_envs: dict[str, Path] = {}


def fork_python(target, tmp_path_factory) -> Path:
    """A venv with the release's pinned set and its patch applied (built once per test session)."""
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
def monkeypatch_run(tmp_path_factory) -> list[dict]:
    """The scenario through grpo_patches.apply() / revert() in this (kit) environment: pristine TRL
    for the upstream half."""
    save = tmp_path_factory.mktemp("monkeypatch") / "ranks.json"
    done = subprocess.run([sys.executable, str(FORK / "drive.py"), "--mode", "monkeypatch", "--save", str(save)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-3000:]
    assert "monkeypatch mode" in done.stdout and "every invariant held" in done.stdout
    return json.loads(save.read_text())


def test_the_scenario_holds_in_monkeypatch_mode_too(monkeypatch_run):
    """The driver's switch in its other position: grpo_patches.apply() in this (kit) environment."""
    assert [d["mode"] for d in monkeypatch_run] == ["monkeypatch", "monkeypatch"]


@pytest.mark.parametrize("target", ENDS, ids=lambda t: t.name)
def test_patched_fork_keeps_the_invariants_without_the_kit(target, tmp_path_factory, monkeypatch_run):
    python = fork_python(target, tmp_path_factory)
    save = tmp_path_factory.mktemp(f"ranks-{target.release}") / "ranks.json"
    done = subprocess.run([str(python), str(FORK / "drive.py"), "--patch", str(target.patch_path), "--save",
                           str(save)], cwd=tmp_path_factory.getbasetemp(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-3000:]
    assert f"fork mode, trl {target.release}, 2 ranks" in done.stdout and "every invariant held" in done.stdout
    fork = json.loads(save.read_text())
    if fork[0]["trl"] == monkeypatch_run[0]["trl"]:
        # Same release as this environment's: the fork switched off is pristine upstream (grpo_patches
        # reverted), the fork with default settings gives upstream's advantages, and with each set of
        # options the fork does what apply() does: same reward calls, refusals and errors.
        for f, m in zip(fork, monkeypatch_run, strict=True):
            assert f["stock"] == m["stock"], "GRPOConfig(grpo_patches=False) differs from unpatched TRL"
            assert f["default"]["advantages"] == pytest.approx(m["stock"]["advantages"], abs=1e-6)
            for label in ("default", "local", "main"):
                assert f[label] == m[label], label
                assert f[f"{label}_refusal"] == m[f"{label}_refusal"], label
            assert [f["local_fault"], f["main_fault"]] == [m["local_fault"], m["main_fault"]]


@pytest.mark.parametrize("target", ENDS, ids=lambda t: t.name)
def test_apply_options_are_grpo_config_fields(target, tmp_path_factory):
    got = run_json([str(fork_python(target, tmp_path_factory)), str(FORK / "settings_probe.py")],
                   cwd=tmp_path_factory.getbasetemp())
    assert got["kit_importable"] is False
    assert got["defaults"] == {"grpo_patches": True, "reward_placement": "local", "reward_chunk_size": None,
                               "reward_timeout": 600.0, "fast_generation": False}
    assert got["parsed"] == {"grpo_patches": False, "reward_placement": "main", "reward_chunk_size": 8,
                             "reward_timeout": 30.0, "fast_generation": False}
    reward_site = "_prepare_inputs" if target.adapter_attr == "V015" else "_calculate_rewards"
    assert {"__init__", "_get_train_sampler", reward_site} <= set(got["wrapped"])
    assert "reward_placement='nowhere'" in got["bad_setting"] and "'local'" in got["bad_setting"]
    if target.adapter_attr == "V015":
        assert "_generate_single_turn" in got["fast_generation"]  # refused before 0.29, as apply() does
    else:
        assert got["fast_generation"] is True
    assert got["wrapt_imported"] is False


def test_patched_vendored_trainer_behaves_like_the_monkeypatch(tmp_path, tmp_path_factory):
    """dsm_grpo.patch on a copy of the vendored file, run where grpo_patches is not importable, gives the
    same step as grpo_patches.apply(fast_generation=...) on the kit's own copy (off, then on)."""
    folder = tmp_path / "fork"
    folder.mkdir()
    shutil.copy(patchgen.KIT / "vendored" / "dsm_grpo.py", folder)
    subprocess.run(["git", "apply", str(VENDORED.patch_path)], cwd=folder, check=True,
                   env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
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
