"""patches/*.patch: fresh (equal to a new generation), applying exactly to their releases, and made by a
bundler that follows import edges and refuses what a fork could not run."""

from __future__ import annotations

import subprocess

import pytest

from grpo_patches import compat, patchgen

TARGETS = patchgen.targets()


def test_one_patch_per_patched_release_and_the_vendored_trainer():
    releases = {t.release for t in TARGETS}
    free = set(compat.table().get("grpo_free", []))
    assert releases == (set(compat.table()["supported"]) - free) | {"vendored"}
    assert sorted(p.name for p in patchgen.PATCHES.glob("*.patch")) == sorted(t.patch_path.name for t in TARGETS)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_checked_in_patch_is_fresh_and_applies_exactly(target):
    text = patchgen.generate(target)
    assert target.patch_path.read_text() == text, (
        f"{target.patch_path.name} differs from a fresh generation: run `grpo-patches make-patches`")
    result = patchgen.check_patch(target)
    assert result.ok, result.detail


def test_the_check_refuses_an_offset_that_git_apply_accepts(tmp_path):
    target = TARGETS[-2]  # the newest TRL release
    tree = patchgen.unpack_release(target, tmp_path / "tree")
    trainer = tree / target.trainer_file
    trainer.write_text("# one line more at the top\n" + trainer.read_text())
    env = {"GIT_CEILING_DIRECTORIES": str(tmp_path)}
    git = subprocess.run(["git", "apply", "--check", str(target.patch_path)], cwd=tree, capture_output=True,
                         env=env)
    assert git.returncode == 0, "git apply moves a hunk to a nearby offset silently"
    problems = patchgen.exact_hunk_problems(target.patch_path.read_text(), tree)
    assert problems == [f"{target.trainer_file}: the hunk at line "
                        f"{len(trainer.read_text().splitlines()) - 3} does not match the release's text there"]


def test_the_check_refuses_a_hand_edited_patch(tmp_path):
    target = TARGETS[0]
    edited = tmp_path / target.patch_path.name
    lines = target.patch_path.read_text().splitlines(keepends=True)
    hunk = lines.index(next(x for x in lines if x.startswith("@@ -") and not x.startswith("@@ -0,0")))
    lines[hunk + 1] = lines[hunk + 1].rstrip("\n") + "  # hand edit\n"  # a context line no release has
    edited.write_text("".join(lines))
    result = patchgen.check_patch(target, edited)
    assert not result.ok and "does not match" in result.detail


def _package(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_bundle_follows_relative_imports_at_any_depth(tmp_path):
    pkg = _package(tmp_path / "kit", {
        "__init__.py": "import wrapt\n",  # the package's own __init__ is never bundled
        "a.py": "from .b import x\n\ndef f():\n    from .sub import d\n",
        "b.py": "x = 1\n",
        "unused.py": "import grpo_patches\n",
        "sub/__init__.py": "",
        "sub/d.py": "from .. import c\nfrom ..b import x\nimport torch\n",
        "c.py": "",
    })
    assert patchgen.bundle_modules("a", pkg) == ["a", "b", "c", "sub", "sub.d"]


@pytest.mark.parametrize("source, complaint", [
    ("import grpo_patches.rewards\n", "imports grpo_patches.rewards"),
    ("from grpo_patches import apply\n", "imports from grpo_patches"),
    ("import wrapt\n", "imports wrapt"),
    ("def f():\n    import wrapt\n", "imports wrapt"),
    ("from . import apply\n", "imports 'apply' from kit/__init__.py"),
    ("from .missing import y\n", "no such module"),
])
def test_bundle_refuses_what_a_fork_cannot_run(tmp_path, source, complaint):
    pkg = _package(tmp_path / "kit", {"__init__.py": "", "a.py": "from . import b\n", "b.py": source})
    with pytest.raises(patchgen.BundleError, match=complaint):
        patchgen.bundle_modules("a", pkg)


def test_settings_are_apply_options_with_apply_defaults():
    import inspect

    import grpo_patches

    params = inspect.signature(grpo_patches.apply).parameters
    for target in (TARGETS[0], TARGETS[-2]):
        found = patchgen.settings(target.modules())
        # strict: a patch is made for one release; targets: the patched file is the choice of target
        assert [s.name for s in found] == [n for n in params if n not in ("strict", "targets")]
        assert all(s.default == params[s.name].default and s.help for s in found)
    dsm = patchgen.settings(TARGETS[-1].modules())
    assert "fast_generation" in [s.name for s in dsm] and {s.name for s in dsm} <= {s.name for s in found}


def test_an_unknown_release_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="no patch for release '9.9.9'.*grpo-patches versions"):
        patchgen.targets("9.9.9")


@pytest.fixture
def patched_vendored(tmp_path, monkeypatch):
    """The vendored trainer patched with dsm_grpo.patch in a scratch folder, imported in this process."""
    import shutil
    import sys

    shutil.copy(patchgen.KIT / "vendored" / "dsm_grpo.py", tmp_path)
    subprocess.run(["git", "apply", str(TARGETS[-1].patch_path)], cwd=tmp_path, check=True,
                   env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent), "PATH": "/usr/bin:/bin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "dsm_grpo" or m.startswith("dsm_grpo_rank_local")]:
        monkeypatch.delitem(sys.modules, name)
    import dsm_grpo
    import dsm_grpo_rank_local

    yield dsm_grpo, dsm_grpo_rank_local
    for name in [m for m in sys.modules if m == "dsm_grpo" or m.startswith("dsm_grpo_rank_local")]:
        del sys.modules[name]


def test_install_wraps_each_method_once_and_names_a_missing_one(patched_vendored):
    dsm_grpo, shim = patched_vendored
    cls = dsm_grpo.DSMGRPOTrainer
    wrapped = {name for name, v in vars(cls).items() if hasattr(v, "_self_wrapper")}
    assert wrapped == set(shim._ADAPTER.wrappers)  # what the adapter wraps under apply()
    before = {name: vars(cls)[name] for name in wrapped}
    shim.install(cls, dsm_grpo.DSMGRPOConfig)  # a second install (a reload of the hook) changes nothing
    assert {name: vars(cls)[name] for name in wrapped} == before
    assert all(not hasattr(inspect_unwrap(v), "_self_wrapper") for v in before.values())

    class Moved:  # a trainer whose wrapped method moved away
        def __init__(self):
            pass

    with pytest.raises(RuntimeError, match=r"Moved\.create_groups is missing; this patch was made for vendored"):
        shim.install(Moved, dsm_grpo.DSMGRPOConfig)
    assert not hasattr(vars(Moved)["__init__"], "_self_wrapper")  # refused before anything was wrapped


def test_fork_settings_turn_the_vendored_patch_on_and_off(patched_vendored):
    dsm_grpo, shim = patched_vendored
    assert shim.patch_options(dsm_grpo.DSMGRPOConfig(grpo_patches=False)) is None
    on = shim.patch_options(dsm_grpo.DSMGRPOConfig(fast_generation=True))
    assert on is not None and on.fast_generation is not None
    assert shim.patch_options(None).fast_generation is None  # defaults: apply()'s


def inspect_unwrap(fn):
    import inspect

    return inspect.unwrap(fn)
