"""Which patch files the kit ships: per tree, one bundle of the kit's code (the same bytes for every
release) and, per release, one small patch of edits to the release's own files."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

from .bundle import BundleError, bundle_modules
from .paths import PATCHES

__all__ = ["Bundle", "Target", "bundle_of", "bundles", "targets"]


@dataclass(frozen=True)
class Target:
    """One release's edit patch: which adapter it takes, where the bundle lives, which files it edits."""

    name: str  # patch file stem
    release: str  # the upstream release (TRL version, or "vendored")
    adapter_module: str  # dotted, relative to grpo_patches: "targets.trl_v019"
    adapter_attr: str  # the Adapter object's name in that module
    package: str  # the bundle's path in the fork tree
    trainer_file: str
    trainer_class: str
    config_file: str
    config_class: str

    @property
    def adapter(self):
        return getattr(importlib.import_module(f"grpo_patches.{self.adapter_module}"), self.adapter_attr)

    @property
    def aliased(self) -> tuple[str, ...]:
        """The adapter's target module where it lives inside the kit (the vendored trainer)."""
        module = self.adapter.module
        return (module.removeprefix("grpo_patches."),) if module.startswith("grpo_patches.") else ()

    @property
    def made_for(self) -> str:
        """The releases this edit's adapter was made for, as the fork's refusal names them."""
        if self.release == "vendored":
            return "vendored"
        return f"trl {','.join(sorted(map(str, self.adapter.releases), reverse=True))} (adapter {self.adapter.key})"

    def modules(self) -> list[str]:
        return bundle_modules(self.adapter_module, aliased=self.aliased)

    @property
    def patch_path(self) -> Path:
        return PATCHES / f"{self.name}.patch"


@dataclass(frozen=True)
class Bundle:
    """The kit's code for one kind of tree (TRL, the vendored trainer): every module any of its
    releases' adapters needs, added as one package; a release's edit patch picks the adapter."""

    package: str  # path in the fork tree
    members: tuple[Target, ...]

    @property
    def name(self) -> str:
        return self.package.rsplit("/", 1)[-1]

    @property
    def patch_path(self) -> Path:
        return PATCHES / f"{self.name}.patch"

    def modules(self) -> list[str]:
        return sorted({m for t in self.members for m in t.modules()})


def _adapter_location(adapter) -> tuple[str, str]:
    """(module relative to grpo_patches, attribute) of an Adapter object, found by identity."""
    for module_name in sorted(m for m in sys.modules if m.startswith("grpo_patches.targets")):
        module = importlib.import_module(module_name)
        for attr, value in sorted(vars(module).items()):
            if value is adapter and not attr.startswith("_"):
                return module_name.removeprefix("grpo_patches."), attr
    raise BundleError(f"adapter {adapter.key!r} is not a public module attribute under grpo_patches.targets")


def _all_targets() -> list[Target]:
    from packaging.version import Version

    from .. import compat, registry
    from ..targets.dsm import ADAPTER as DSM

    out = []
    for version in sorted(compat.table()["supported"], key=Version):
        if version in compat.table().get("grpo_free", []):
            continue
        era = compat.table()["supported"][version]["era"]
        adapter = next((a for a in registry.ADAPTERS if a.key == era), None)
        if adapter is None:
            continue  # an era without adapter: apply() refuses it, and there is no patch either
        module, attr = _adapter_location(adapter)
        out.append(Target(f"trl-{version}", version, module, attr, "trl/trainer/grpo_rank_local",
                          "trl/trainer/grpo_trainer.py", "GRPOTrainer", "trl/trainer/grpo_config.py", "GRPOConfig"))
    module, attr = _adapter_location(DSM)
    out.append(Target("dsm_grpo", "vendored", module, attr, "dsm_grpo_rank_local", "dsm_grpo.py", DSM.class_name,
                      "dsm_grpo.py", "DSMGRPOConfig"))
    return out


def targets(release: str | None = None) -> list[Target]:
    """Every edit patch the kit ships: one per tested TRL release with an adapter, and the vendored trainer."""
    out = _all_targets()
    if release is not None:
        out = [t for t in out if release in (t.release, t.name)]
        if not out:
            raise ValueError(f"no patch for release {release!r}: supported releases are in grpo_patches/compat.json "
                             f"(run `grpo-patches versions`); the vendored trainer is 'dsm_grpo'.")
    return out


def bundles() -> list[Bundle]:
    """The bundles: one per fork tree (TRL's, the vendored trainer's folder), in the order of targets()."""
    by_package: dict[str, list[Target]] = {}
    for target in _all_targets():
        by_package.setdefault(target.package, []).append(target)
    return [Bundle(package, tuple(members)) for package, members in by_package.items()]


def bundle_of(target: Target) -> Bundle:
    return next(b for b in bundles() if b.package == target.package)
