"""Proves the checked-in patches: each release's edit patch together with its tree's bundle applies
to the release's fetched source with ``git apply`` and ``patch -F0``, every hunk at exactly the line
it names (no fuzz, no offset); and every file equals a fresh generation."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .layout import Target, bundle_of, bundles, targets
from .paths import PATCHES
from .sources import unpack_release
from .write import generate, generate_bundle

__all__ = ["CheckResult", "check_patch", "check_patches", "exact_hunk_problems", "stale_patches"]


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def exact_hunk_problems(patch_text: str, tree: Path) -> list[str]:
    """Each hunk's old side must sit in the file at exactly the line it names (no offset, no fuzz)."""
    problems: list[str] = []
    path: str | None = None
    lines = patch_text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("--- "):
            name = line[4:].strip()
            path = None if name == "/dev/null" else name.removeprefix("a/")
            continue
        m = _HUNK.match(line)
        if not m:
            continue
        start, old_n = int(m.group(1)), int(m.group(2) or "1")
        new_n = int(m.group(4) or "1")
        old: list[str] = []
        seen_old = seen_new = 0
        while i < len(lines) and (seen_old < old_n or seen_new < new_n):
            body = lines[i]
            i += 1
            if body.startswith("\\"):
                continue
            if body[:1] in (" ", "-"):
                old.append(body[1:].rstrip("\n"))
                seen_old += 1
            if body[:1] in (" ", "+"):
                seen_new += 1
        if path is None:
            continue
        file = tree / path
        have = file.read_text().splitlines() if file.is_file() else None
        if have is None:
            problems.append(f"{path}: missing in the release")
        elif have[start - 1: start - 1 + old_n] != old if old_n else False:
            problems.append(f"{path}: the hunk at line {start} does not match the release's text there")
    return problems


def _git_apply_check(patches: list[Path], tree: Path) -> str:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))  # never the repo around the tree
    # --whitespace=error-all: a fork whose git is set to refuse whitespace errors must apply it too
    done = subprocess.run(["git", "apply", "--check", "-v", "--whitespace=error-all", *map(str, patches)], cwd=tree,
                          capture_output=True, text=True, env=env)
    return "" if done.returncode == 0 else (done.stderr or done.stdout).strip()


def _patch_dry_run(patches: list[Path], tree: Path) -> str:
    if shutil.which("patch") is None:
        return ""
    out = ""
    for patch in patches:  # disjoint files: each one checked on the release's text
        done = subprocess.run(["patch", "-p1", "--dry-run", "-F0", "-i", str(patch)], cwd=tree, capture_output=True,
                              text=True)
        text = done.stdout + done.stderr
        if done.returncode or re.search(r"offset|fuzz", text, re.IGNORECASE):
            out += f"{patch.name}: {text.strip()}\n"
    return out.strip()


def check_patch(target: Target, patch: Path | None = None, bundle: Path | None = None) -> CheckResult:
    """``target``'s edit patch (default: the checked-in one) applied with its bundle to the release."""
    patch = patch or target.patch_path
    bundle = bundle or bundle_of(target).patch_path
    for path in (bundle, patch):
        if not path.is_file():
            return CheckResult(target.name, False, f"{path} is missing (run grpo-patches make-patches)")
    with tempfile.TemporaryDirectory(prefix=f"grpo-check-{target.name}-") as tmp:
        try:
            tree = unpack_release(target, Path(tmp) / "tree")
        except RuntimeError as exc:  # the release could not be fetched
            return CheckResult(target.name, False, str(exc))
        problems = [p for path in (bundle, patch) for p in exact_hunk_problems(path.read_text(), tree)]
        for check in (_git_apply_check, _patch_dry_run):
            msg = check([bundle, patch], tree)
            if msg:
                problems.append(f"{check.__name__.strip('_')}: {msg[-1500:]}")
    detail = "; ".join(problems) or f"applies with {bundle.name} cleanly (no fuzz, no offset)"
    return CheckResult(target.name, not problems, detail)


def check_patches(release: str | None = None) -> list[CheckResult]:
    """Apply-check every checked-in edit patch, with its bundle, against its release's fetched source;
    also flag strays."""
    chosen = targets(release)
    results = [check_patch(t) for t in chosen]
    if release is None:
        known = {t.patch_path.name for t in chosen} | {b.patch_path.name for b in bundles()}
        results += [CheckResult(p.stem, False, "no such release in grpo_patches/compat.json (stale file)")
                    for p in sorted(PATCHES.glob("*.patch")) if p.name not in known]
    return results


def stale_patches(release: str | None = None) -> list[str]:
    """Names of patches whose checked-in text differs from a fresh generation (or that are missing):
    the bundles of the chosen releases, then their edit patches."""
    chosen = targets(release)
    out = [b.name for b in bundles() if any(t in b.members for t in chosen)
           and (not b.patch_path.is_file() or b.patch_path.read_text() != generate_bundle(b))]
    return out + [t.name for t in chosen if not t.patch_path.is_file() or t.patch_path.read_text() != generate(t)]
