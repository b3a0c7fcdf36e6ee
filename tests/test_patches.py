"""patches/*.patch: per tree one bundle of the kit's code and per release one small edit patch, fresh (equal
to a new generation), applying together exactly to their releases, made by a bundler that follows import
edges and refuses what a fork could not run, and by a writer below the public face."""

from __future__ import annotations

import subprocess

import pytest

from grpo_patches import compat, fork

TARGETS = fork.targets()
BUNDLES = fork.bundles()


def test_one_patch_per_patched_release_and_the_vendored_trainer():
    releases = {t.release for t in TARGETS}
    free = set(compat.table().get("grpo_free", []))
    assert releases == (set(compat.table()["supported"]) - free) | {"vendored"}
    shipped = [t.patch_path.name for t in TARGETS] + [b.patch_path.name for b in BUNDLES]
    assert sorted(p.name for p in fork.PATCHES.glob("*.patch")) == sorted(shipped)
    assert [b.name for b in BUNDLES] == ["grpo_rank_local", "dsm_grpo_rank_local"]


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda b: b.name)
def test_checked_in_bundle_is_fresh_and_adds_files_only(bundle):
    text = fork.generate_bundle(bundle)
    assert bundle.patch_path.read_text() == text, (
        f"{bundle.patch_path.name} differs from a fresh generation: run `grpo-patches make-patches`")
    assert "\n--- a/" not in text  # new files only: the same bytes fit every release of the tree
    for target in bundle.members:  # every adapter any release takes is in it
        assert f"{bundle.package}/{target.adapter_module.replace('.', '/')}.py" in text


def test_edit_patches_touch_only_the_release_files_and_the_adapter_choice():
    for target in TARGETS:
        files = {line.split(" b/", 1)[1] for line in target.patch_path.read_text().splitlines()
                 if line.startswith("diff --git ")}
        assert files == {target.trainer_file, target.config_file, f"{target.package}/_release.py"}, target.name
        assert len(target.patch_path.read_text().splitlines()) < 120, target.name
    total = sum(len(p.read_text().splitlines()) for p in fork.PATCHES.glob("*.patch"))
    assert total < 25_000


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_checked_in_patch_is_fresh_and_applies_exactly(target):
    text = fork.generate(target)
    assert target.patch_path.read_text() == text, (
        f"{target.patch_path.name} differs from a fresh generation: run `grpo-patches make-patches`")
    result = fork.check_patch(target)
    assert result.ok, result.detail


def test_the_check_refuses_an_offset_that_git_apply_accepts(tmp_path):
    target = TARGETS[-2]  # the newest TRL release
    tree = fork.unpack_release(target, tmp_path / "tree")
    trainer = tree / target.trainer_file
    trainer.write_text("# one line more at the top\n" + trainer.read_text())
    env = {"GIT_CEILING_DIRECTORIES": str(tmp_path)}
    git = subprocess.run(["git", "apply", "--check", str(target.patch_path)], cwd=tree, capture_output=True,
                         env=env)
    assert git.returncode == 0, "git apply moves a hunk to a nearby offset silently"
    problems = fork.exact_hunk_problems(target.patch_path.read_text(), tree)
    assert problems == [f"{target.trainer_file}: the hunk at line "
                        f"{len(trainer.read_text().splitlines()) - 3} does not match the release's text there"]


def test_the_check_refuses_a_hand_edited_patch(tmp_path):
    target = TARGETS[0]
    edited = tmp_path / target.patch_path.name
    lines = target.patch_path.read_text().splitlines(keepends=True)
    hunk = lines.index(next(x for x in lines if x.startswith("@@ -") and not x.startswith("@@ -0,0")))
    lines[hunk + 1] = lines[hunk + 1].rstrip("\n") + "  # hand edit\n"  # a context line no release has
    edited.write_text("".join(lines))
    result = fork.check_patch(target, edited)
    assert not result.ok and "does not match" in result.detail


def test_the_check_applies_the_bundle_to_the_whole_release_tree(tmp_path):
    """A bundle file that the release already has is a conflict, found in the release's full trl/ tree."""
    target = TARGETS[-2]
    edited = tmp_path / "grpo_rank_local.patch"
    edited.write_text(fork.bundle_of(target).patch_path.read_text().replace(
        f"{target.package}/watchdog.py", "trl/trainer/utils.py"))
    result = fork.check_patch(target, bundle=edited)
    assert not result.ok and "trl/trainer/utils.py" in result.detail, result.detail


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
    assert fork.bundle_modules("a", pkg) == ["a", "b", "c", "sub", "sub.d"]


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
    with pytest.raises(fork.BundleError, match=complaint):
        fork.bundle_modules("a", pkg)


def test_settings_are_apply_options_with_apply_defaults():
    import inspect

    import grpo_patches

    params = inspect.signature(grpo_patches.apply).parameters
    for target in (TARGETS[0], TARGETS[-2]):
        found = fork.settings(target.modules())
        # strict: a patch is made for one release; targets: the patched file is the choice of target;
        # speed: apply() resolves it into the three options it turns on, which a fork's config sets itself
        assert [s.name for s in found] == [n for n in params if n not in ("strict", "targets", "speed")]
        assert all(s.default == params[s.name].default and s.help for s in found)
    dsm = fork.settings(TARGETS[-1].modules())
    assert "fast_generation" in [s.name for s in dsm] and {s.name for s in dsm} <= {s.name for s in found}


def test_an_unknown_release_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="no patch for release '9.9.9'.*grpo-patches versions"):
        fork.targets("9.9.9")


@pytest.fixture
def patched_vendored(tmp_path, monkeypatch):
    """The vendored trainer patched with dsm_grpo.patch in a scratch folder, imported in this process."""
    import shutil
    import sys

    shutil.copy(fork.KIT / "vendored" / "dsm_grpo.py", tmp_path)
    subprocess.run(["git", "apply", str(BUNDLES[-1].patch_path), str(TARGETS[-1].patch_path)], cwd=tmp_path,
                   check=True, env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent), "PATH": "/usr/bin:/bin"})
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


def test_the_bundle_alone_says_which_patch_is_missing(tmp_path, monkeypatch):
    import sys

    subprocess.run(["git", "apply", str(BUNDLES[-1].patch_path)], cwd=tmp_path, check=True,
                   env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent), "PATH": "/usr/bin:/bin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("dsm_grpo_rank_local")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        with pytest.raises(ImportError, match="_release.py is missing; apply the release's edit patch"):
            import dsm_grpo_rank_local  # noqa: F401
    finally:
        for name in [m for m in sys.modules if m.startswith("dsm_grpo_rank_local")]:
            del sys.modules[name]


def test_edit_groups_drop_context_and_positions_only():
    def edit(at, context, added):
        return (f"preamble naming release {at}\n\ndiff --git a/f.py b/f.py\n--- a/f.py\n+++ b/f.py\n"
                f"@@ -{at},2 +{at},3 @@\n {context}\n+{added}\n-old\n+new\n")

    same = {"1.0": edit(10, "x", "hook()"), "1.1": edit(99, "y", "hook()"), "1.2": edit(10, "x", "other()")}
    assert fork.edit_groups(same) == [["1.0", "1.1"], ["1.2"]]
    # a removed line is an edit too, though the added ones match
    assert fork.edits_only(edit(1, "x", "h()")) != fork.edits_only(edit(1, "x", "h()").replace("-old", "-older"))


def test_checked_in_edit_patches_group_by_adapter_era():
    from grpo_patches.fork.commands import release_groups

    groups = release_groups()
    era = {t.release: (t.adapter_module, t.adapter_attr) for t in TARGETS}
    assert sorted(r for g in groups for r in g) == sorted(t.release for t in TARGETS if t.release != "vendored")
    for group in groups:  # one adapter per group: what a fork test of one member exercises
        assert len({era[r] for r in group}) == 1, group


def test_the_writer_reads_the_options_below_the_face():
    """grpo_patches/fork imports nothing from grpo_patches/__init__.py (the face sits above it), and the
    options it turns into config fields are apply()'s, name for name and default for default."""
    import ast
    import inspect

    import grpo_patches
    from grpo_patches import surface

    for path in sorted((fork.KIT / "fork").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module is None:
                names = [a.name for a in node.names]
                assert all((fork.KIT / f"{n}.py").is_file() or (fork.KIT / n).is_dir() for n in names), (
                    f"{path.name}:{node.lineno} imports {names} from grpo_patches/__init__.py")
            elif isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert "grpo_patches" not in modules, f"{path.name}:{node.lineno} imports the face"
    params = inspect.signature(grpo_patches.apply).parameters
    assert [(o.name, o.default) for o in surface.OPTIONS] == [(p.name, p.default) for p in params.values()]
    assert all(o.help.split(" ")[0] in inspect.getdoc(grpo_patches.apply) for o in surface.OPTIONS)
    assert grpo_patches.__version__ == surface.VERSION
