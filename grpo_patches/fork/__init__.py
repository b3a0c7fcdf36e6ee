"""The fork patch writer: ``patches/`` for teams that carry their own TRL and cannot import the kit.

Per tree one bundle patch adds a package next to the trainer (``trl/trainer/grpo_rank_local/`` for
TRL) holding copies of every module any release's adapter needs (:mod:`.bundle` walks the import
edges from each adapter: whatever the kit's source is at generation time is what the fork gets) and
an ``install`` shim (:mod:`.shim`) that wraps the trainer's methods as ``grpo_patches.apply()`` does;
it is the same bytes for every release. Per release one edit patch (:mod:`.edits`, tens of lines)
appends the call to ``install`` to the trainer's module, adds ``apply()``'s options (:mod:`.settings`)
to the config dataclass, and writes the bundle's ``_release.py`` naming the adapter the release takes.

Edits are made on the release's own text (located with ``ast``, never by line number) and written
as unified diffs with 3 lines of context, so each patch applies with no fuzz and no offset by
construction; :mod:`.check` proves it on freshly fetched sources (:mod:`.sources`). :mod:`.write`
writes the files, :mod:`.groups` groups the releases whose edit patches make the same edits, and
:mod:`.commands` is the command line. This package sits below the public face: it reads apply()'s
options from :mod:`grpo_patches.surface`, never from ``grpo_patches`` itself.
"""

from __future__ import annotations

from .bundle import BundleError, bundle_modules
from .check import CheckResult, check_patch, check_patches, exact_hunk_problems, stale_patches
from .groups import edit_groups, edits_only
from .layout import Bundle, Target, bundle_of, bundles, targets
from .paths import KIT, PATCHES, REPO
from .settings import Setting, settings
from .sources import unpack_release
from .write import generate, generate_bundle, make_patches

__all__ = [
    "KIT",
    "PATCHES",
    "REPO",
    "Bundle",
    "BundleError",
    "CheckResult",
    "Setting",
    "Target",
    "bundle_modules",
    "bundle_of",
    "bundles",
    "check_patch",
    "check_patches",
    "edit_groups",
    "edits_only",
    "exact_hunk_problems",
    "generate",
    "generate_bundle",
    "make_patches",
    "settings",
    "stale_patches",
    "targets",
    "unpack_release",
]
