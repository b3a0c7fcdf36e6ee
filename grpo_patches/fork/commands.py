"""``grpo-patches make-patches | check-patches | edit-groups`` (registered by :mod:`grpo_patches.cli`)."""

from __future__ import annotations

import sys

from .bundle import BundleError
from .check import check_patches, stale_patches
from .groups import edit_groups, representatives
from .layout import targets
from .paths import REPO
from .sources import CACHE_ENV
from .write import make_patches

__all__ = ["add_subcommands", "release_groups"]


def _make_cmd(args) -> int:
    try:
        written = make_patches(args.release)
    except (BundleError, RuntimeError) as exc:  # cannot bundle, or no source: one line, exit 2
        print(f"grpo-patches make-patches: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


def _check_cmd(args) -> int:
    failed = 0
    for result in check_patches(args.release):
        print(f"{'ok  ' if result.ok else 'FAIL'} {result.name}: {result.detail}")
        failed += not result.ok
    if args.fresh:
        for name in stale_patches(args.release):
            print(f"FAIL {name}: differs from a fresh generation (run grpo-patches make-patches)")
            failed += 1
    return 1 if failed else 0


def release_groups() -> list[list[str]]:
    """The TRL releases grouped by the edits of their checked-in edit patches (oldest first)."""
    trl = [t for t in targets() if t.release != "vendored"]
    missing = [t.name for t in trl if not t.patch_path.is_file()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)}.patch missing: run grpo-patches make-patches")
    return edit_groups({t.release: t.patch_path.read_text() for t in trl})


def _groups_cmd(args) -> int:
    adapters = {t.release: f"{t.adapter_module}.{t.adapter_attr}" for t in targets()}
    groups = release_groups()
    for n, group in enumerate(groups, 1):
        print(f"fork-edits-{n}  {adapters[group[0]]}  {' '.join(group)}")
    newest = [t.release for t in targets() if t.release != "vendored"][-1]  # targets() is oldest first
    print(f"fork-groups  {' '.join(representatives(groups, newest))}   (one release of each group and the newest)")
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("make-patches", help="write patches/*.patch for forks from the kit's source",
                       description="Generate patches/grpo_rank_local.patch (the kit's code, the same for every "
                       "TRL release), patches/trl-<release>.patch (that release's edits) for every supported TRL "
                       "release, and the vendored trainer's pair (dsm_grpo_rank_local.patch, dsm_grpo.patch) from "
                       "the kit's own source; deterministic.")
    p.add_argument("--release", help="only this TRL release (e.g. 1.16.0), or dsm_grpo (and its bundle)")
    p.set_defaults(func=_make_cmd)
    p = sub.add_parser("check-patches", help="check that every patch applies to its release (no fuzz, no offset)",
                       description="Fetch each release's source from the package index (cached in "
                       f"${CACHE_ENV}), apply its edit patch together with the bundle with git apply --check, "
                       "patch --dry-run -F0 and an exact hunk-position check; exit 1 on any failure.")
    p.add_argument("--release", help="only this TRL release (e.g. 1.16.0), or dsm_grpo")
    p.add_argument("--fresh", action="store_true", help="also fail where a patch differs from a fresh generation")
    p.set_defaults(func=_check_cmd)
    p = sub.add_parser("edit-groups", help="group the TRL releases whose edit patches make the same edits",
                       description="Print the TRL releases grouped by their checked-in edit patches' added and "
                       "removed lines (context and hunk positions dropped), as the fork nox sessions' tags "
                       "fork-edits-<n>, and the fork-groups pick: one release of each group and the newest.")
    p.set_defaults(func=_groups_cmd)
