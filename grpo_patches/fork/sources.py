"""Upstream sources: a TRL release's wheel from the package index (its ``trl/`` tree is the
repository's ``trl/`` at that tag), cached in ``GRPO_PATCHES_SOURCE_CACHE`` (default
``~/.cache/grpo-patches/trl-wheels``); the vendored trainer is the kit's own file."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from .layout import Target
from .paths import KIT

__all__ = ["CACHE_ENV", "cache_dir", "release_wheel", "source_files", "unpack_release"]

CACHE_ENV = "GRPO_PATCHES_SOURCE_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpo-patches" / "trl-wheels")


def release_wheel(version: str) -> Path:
    """The TRL release's wheel, fetched from the package index once into :func:`cache_dir`."""
    cache = cache_dir()
    found = sorted(cache.glob(f"trl-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           f"trl=={version}", "-d", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache.glob(f"trl-{version}-*.whl"))
    if done.returncode or not found:
        raise RuntimeError(f"could not download trl=={version} from the package index: {done.stderr.strip()[-2000:]}")
    return found[0]


def source_files(target: Target) -> dict[str, str]:
    """The upstream text of the files the edit patch changes, keyed by their path in the fork tree."""
    wanted = sorted({target.trainer_file, target.config_file})
    if target.release == "vendored":
        return {name: (KIT / "vendored" / name).read_text() for name in wanted}
    with zipfile.ZipFile(release_wheel(target.release)) as wheel:
        missing = [name for name in wanted if name not in wheel.namelist()]
        if missing:
            raise RuntimeError(f"trl {target.release}'s wheel has no {', '.join(missing)}: not a GRPO release")
        return {name: wheel.read(name).decode() for name in wanted}


def unpack_release(target: Target, into: Path) -> Path:
    """The release's tree under ``into``: every file of the wheel's ``trl/`` (so a bundle file that
    the release already has is a conflict), or the vendored trainer's file alone."""
    if target.release == "vendored":
        files = {name: text.encode() for name, text in source_files(target).items()}
    else:
        with zipfile.ZipFile(release_wheel(target.release)) as wheel:
            files = {n: wheel.read(n) for n in wheel.namelist() if n.startswith("trl/") and not n.endswith("/")}
    for name, data in files.items():
        path = into / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return into
