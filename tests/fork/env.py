"""An era-true environment for one TRL release, with NO grpo_patches in it: the fork-mode tests' ground.

The same resolve as the nox matrix sessions (noxfile.py): CPU torch first (uncapped), then TRL and its
pinned transformers / accelerate / peft / datasets from grpo_patches/compat.json, every other
dependency capped at the day after the release (``uv pip install --exclude-newer``), then pytest. The
kit itself is not installed; a fork-mode rank checks that ``import grpo_patches`` fails.

Runs on the host's Python with the standard library only (the pytest side calls it; so can a shell).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPAT = json.loads((ROOT / "grpo_patches" / "compat.json").read_text())
PINNED = ("transformers", "accelerate", "peft", "datasets")
TORCH = "torch==2.13.0"
NO_TORCH = "torch; sys_platform == 'never'\n"  # keeps the torch installed first out of the capped resolve
TEST_TOOLS = ("pytest>=8",)  # tests/matrix runs under pytest in the fork venv (nothing of this repo)


class EnvironmentUnavailable(RuntimeError):
    """A tool the fork environment needs (uv) is missing here."""


def uv_command() -> list[str]:
    found = shutil.which("uv")
    if found:
        return [found]
    if importlib.util.find_spec("uv") is not None:
        return [sys.executable, "-m", "uv"]
    raise EnvironmentUnavailable("the fork-mode tests build their environments with uv: pip install uv")


def _find_links() -> list[str]:
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            dirs += value.strip().strip("'\"").split()
    return [d.removeprefix("file://") for d in dict.fromkeys(dirs)]


def torch_requirement() -> list[str]:
    """GRPO_PATCHES_TORCH, else the local CPU wheel from pip's find-links, else the PyTorch CPU index."""
    explicit = os.environ.get("GRPO_PATCHES_TORCH")
    if explicit:
        return [explicit]
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for folder in _find_links():
        wheels = sorted(Path(folder).glob(f"torch-2.13.0+cpu-{tag}-{tag}-*.whl"))
        if wheels:
            return [str(wheels[-1])]
    return ["torch==2.13.0+cpu", "--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def cap(released: str) -> str:
    day = datetime.date.fromisoformat(released) + datetime.timedelta(days=1)
    return f"{day.isoformat()}T00:00:00Z"


def release_requirements(release: str) -> list[str]:
    row = COMPAT["supported"][release]
    return [f"trl=={release}", *(f"{name}=={row[name]}" for name in PINNED)]


def build(release: str, dest: Path) -> Path:
    """A venv at ``dest`` with TRL ``release`` and its pinned set; returns its python."""
    uv = uv_command()
    dest = Path(dest)
    subprocess.run([*uv, "venv", "--quiet", "--python", sys.executable, str(dest)], check=True)
    python = dest / "bin" / "python"
    install = [*uv, "pip", "install", "--quiet", "--python", str(python)]
    subprocess.run([*install, *torch_requirement()], check=True)
    override = dest / "no-torch.txt"
    override.write_text(NO_TORCH)
    subprocess.run([*install, *release_requirements(release), "--exclude-newer",
                    cap(COMPAT["supported"][release]["released"]), "--override", str(override)], check=True)
    subprocess.run([*install, *TEST_TOOLS, "--override", str(override)], check=True)
    return python


def patched(release: str, dest: Path) -> Path:
    """:func:`build`, then ``patches/grpo_rank_local.patch`` (the kit's bundle) and
    ``patches/trl-<release>.patch`` (the release's edits) applied to that venv's TRL; returns its python.

    The matrix in fork mode: ``GRPO_PATCHES_MATRIX_MODE=fork PYTHON -m pytest tests/matrix`` from the
    checkout (its ranks start through tests/fork/drive.py's ``launch``, with this python).
    """
    python = build(release, dest)
    subprocess.run([str(python), str(ROOT / "tests" / "fork" / "drive.py"),
                    "--patch", str(ROOT / "patches" / "grpo_rank_local.patch"),
                    "--patch", str(ROOT / "patches" / f"trl-{release}.patch"), "--apply-only"], check=True, cwd=dest)
    return python


if __name__ == "__main__":  # python tests/fork/env.py RELEASE DEST: a patched venv
    print(patched(sys.argv[1], Path(sys.argv[2])))
