"""Version matrix: one nox session per TRL release in ``grpo_patches/compat.json``, plus a canary.

    nox -l                              # list sessions
    nox -s trl-0.19.1                   # pytest -x -q tests/matrix against TRL 0.19.1's pinned set
    nox -s trl-0.19.1 -- python -c "import trl; print(trl.__version__)"   # any command instead
    nox                                 # every release in the table (same as: nox -t matrix)
    nox -t v019                         # the releases of one adapter era
    nox -s canary                       # the newest TRL on PyPI that is not in the table (if any)
    nox -s mutations                    # planted bugs (tests/mutations.toml) must each fail their guards
    nox -t fork                         # every release's fork patch, applied, grpo_patches absent
    nox -s fork-0.15.2                  # tests/matrix in fork mode against one release's patched TRL
    nox -t fork-groups                  # the same for one release per group of equal edit patches + the newest
    nox -t fork-edits-5                 # every release of one such group (`grpo-patches edit-groups` lists them)

Each session builds a fresh uv venv (hard links from uv's cache: about 2 s per release once the cache
is warm) that sees one shared CPU torch (``.nox/.torch``, built on first use, through a ``.pth``; uncapped:
torch is never part of the pinned set), then installs TRL and
its pinned transformers / accelerate / peft / datasets with every other dependency capped at the
day after that TRL release (``uv pip install --exclude-newer``: the same era-true resolve the table
was made with), then this repo (editable, no deps) and the test tools.
The matrix and fork sessions run their tests through one fixed path, ``<envdir>/.session`` (a link to the
session's venv; nox's envdir, ``.nox`` by default), with bytecode under ``<envdir>/.pycache``: files the
releases share compile once (``_stable_run``).

Environment variables:
    GRPO_PATCHES_TORCH       torch to install: a wheel path or a requirement (default: the local
                             torch-2.13.0+cpu wheel from pip's find-links, else torch==2.13.0 from
                             the PyTorch CPU index)
    GRPO_PATCHES_CANARY_TRL  the TRL release the canary installs (default: newest on PyPI)
Every session exports GRPO_PATCHES_TRL_VERSION (the TRL release under test) to the command it runs.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
COMPAT = json.loads((ROOT / "grpo_patches" / "compat.json").read_text())
PINNED = ("transformers", "accelerate", "peft", "datasets")
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Test tools and the kit's own runtime deps (the repo itself is installed with --no-deps).
TEST_DEPS = ("pytest>=8", "hypothesis>=6", "wrapt>=1.16", "packaging")
# uv drops a requirement whose marker never holds: this takes torch out of the capped resolve, so the
# torch installed first is kept (a date cap older than the torch wheel could not reach it otherwise).
NO_TORCH = "torch; sys_platform == 'never'\n"
DEFAULT_COMMAND = ("pytest", "-x", "-q", "tests/matrix")
FORK_TEST_DEPS = ("pytest>=8", "packaging")  # the fork sessions' test tools: no wrapt, no kit

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True


def _find_links() -> list[str]:
    """pip's find-links folders (env and config): where this machine keeps its local wheels."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            dirs += value.strip().strip("'\"").split()
    return [d.removeprefix("file://") for d in dict.fromkeys(dirs)]


def _torch_args(session: nox.Session) -> list[str]:
    explicit = os.environ.get("GRPO_PATCHES_TORCH")
    if explicit:
        return [explicit]
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"  # sessions run on nox's own interpreter
    for folder in _find_links():
        wheels = sorted(Path(folder).glob(f"torch-{TORCH_VERSION}+cpu-{tag}-{tag}-*.whl"))
        if wheels:
            return [str(wheels[-1])]
    return [f"torch=={TORCH_VERSION}+cpu", "--extra-index-url", TORCH_CPU_INDEX]


def _shared_torch(session: nox.Session) -> None:
    """Give the session the one shared CPU torch instead of a copy: a ``.pth`` line puts the site-packages of
    ``.nox/.torch`` (built on first use) after the session's own. Linking torch's ~15k files into every venv,
    and compiling its modules again in each, cost ~5 s a session; torch is never part of a pinned set (the
    ``--override`` below keeps it out of every resolve, so the session's own packages still win)."""
    base = ROOT / ".nox" / ".torch"
    python = base / "bin" / "python"
    marker = base / "installed.txt"
    wanted = " ".join(_torch_args(session))
    if not marker.exists() or marker.read_text() != wanted:
        session.run("uv", "venv", "--allow-existing", "--python", sys.executable, str(base), external=True)
        session.run("uv", "pip", "install", "--python", str(python), *_torch_args(session), external=True)
        marker.write_text(wanted)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    own = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                      silent=True, log=False).strip()
    Path(own, "_grpo_patches_shared_torch.pth").write_text(site + "\n")


def _cap(released: str) -> str:
    """The resolve cap: midnight UTC after the release day (a bare date means end of that day to uv)."""
    day = datetime.date.fromisoformat(released) + datetime.timedelta(days=1)
    return f"{day.isoformat()}T00:00:00Z"


def _no_torch_override(session: nox.Session) -> str:
    path = Path(session.create_tmp()) / "no-torch.txt"
    path.write_text(NO_TORCH)
    return str(path)


def _install(session: nox.Session, trl: str, pins: dict[str, str] | None, cap: str | None) -> None:
    _shared_torch(session)
    requirements = [f"trl=={trl}", "peft", "datasets"]
    if pins:
        requirements = [f"trl=={trl}"] + [f"{name}=={pins[name]}" for name in PINNED]
    capped = ["--exclude-newer", cap] if cap else []
    session.install(*requirements, *capped, "--override", _no_torch_override(session))
    session.install(*TEST_DEPS, "setuptools>=68")
    # Build the editable install with the venv's setuptools: an isolated build env costs ~2 s a session.
    session.install("--no-deps", "--no-build-isolation", "-e", ".")


def _versions(session: nox.Session) -> None:
    """Log what was installed, without importing it (importing trl costs ~10 s on a 2-core machine)."""
    session.run(
        "python",
        "-c",
        "from importlib.metadata import version as v; print(' '.join(f'{p}=={v(p)}' for p in "
        "('trl', 'torch', 'transformers', 'accelerate', 'peft', 'datasets')))",
        log=False,
    )


def _stable_run(session: nox.Session, command: list[str], env: dict[str, str]) -> None:
    """Run ``command`` with the session's Python reached through one fixed path, ``<envdir>/.session`` (a link
    to this session's venv), and every bytecode file kept under ``<envdir>/.pycache``. Python keys a cached
    ``.pyc`` by the source's path and checks it against the source's mtime and size; uv links each file from
    its cache, so a file every release shares (numpy, pandas, a repeated transformers or peft pin, this repo)
    is compiled once for the whole matrix instead of once per session (~2-3 s of a session on 2 cores). A file
    that differs was linked from another cache entry, with its own mtime, and is compiled again. While another
    nox process holds the link, the session runs from its own path, without the shared bytecode."""
    import fcntl

    venv = Path(session.virtualenv.location).resolve()
    link = venv.parent / ".session"  # in nox's envdir: .nox unless --envdir says otherwise
    with open(venv.parent / ".session.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            session.log(f"another nox process holds {link}: this session compiles its own bytecode")
            session.run(*command, env=env)
            return
        link.unlink(missing_ok=True)
        link.symlink_to(venv, target_is_directory=True)
        python = str(link / "bin" / "python")
        if command[0] == "python":
            command = [python, *command[1:]]
        elif command[0] == "pytest":
            command = [python, "-m", *command]
        session.run(*command, env={**env, "PYTHONPYCACHEPREFIX": str(venv.parent / ".pycache")}, external=True)


def _run(session: nox.Session, trl: str) -> None:
    _stable_run(session, session.posargs or list(DEFAULT_COMMAND), {"GRPO_PATCHES_TRL_VERSION": trl})


def _matrix_session(trl: str, row: dict[str, str]) -> None:
    @nox.session(name=f"trl-{trl}", tags=["matrix", row["era"]], reuse_venv=False)
    def matrix(session: nox.Session) -> None:
        _install(session, trl, {name: row[name] for name in PINNED}, _cap(row["released"]))
        _versions(session)
        _run(session, trl)

    matrix.__doc__ = (
        f"TRL {trl} ({row.get('era', '?')}) with transformers {row['transformers']}, "
        f"accelerate {row['accelerate']}, peft {row['peft']}, datasets {row['datasets']}"
    )


for _trl, _row in COMPAT["supported"].items():
    _matrix_session(_trl, _row)


def _edit_groups(releases: list[str]) -> tuple[dict[str, int], list[str]]:
    """Each release's group of equal edit patches (1-based, oldest first) and the releases ``fork-groups``
    runs: one per group plus the newest. The bundle is the same for every release, so a group's members
    run the same patched code on their own TRL. grpo_patches/fork/groups.py is standard library only:
    loaded by its path, without importing the kit (and torch) into nox."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_edit_groups", ROOT / "grpo_patches" / "fork" / "groups.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    texts = {r: (ROOT / "patches" / f"trl-{r}.patch").read_text() for r in releases
             if (ROOT / "patches" / f"trl-{r}.patch").is_file()}
    groups = module.edit_groups(texts)
    number = {r: n for n, group in enumerate(groups, 1) for r in group}
    return number, module.representatives(groups, releases[-1]) if releases else []


_FORK_RELEASES = sorted((r for r in COMPAT["supported"] if r not in COMPAT.get("grpo_free", [])),
                        key=lambda r: tuple(int(x) for x in r.split(".")))
_FORK_GROUP, _FORK_PICKS = _edit_groups(_FORK_RELEASES)


def _fork_session(trl: str, row: dict[str, str]) -> None:
    tags = ["fork", f"fork-{row['era']}", f"fork-edits-{_FORK_GROUP.get(trl, 0)}"]
    tags += ["fork-groups"] if trl in _FORK_PICKS else []

    @nox.session(name=f"fork-{trl}", tags=tags, reuse_venv=False, default=False)
    def fork(session: nox.Session) -> None:
        # The release's pinned set, pytest, and NOTHING of this repo: tests/fork/drive.py applies
        # patches/grpo_rank_local.patch (the kit's code) and patches/trl-<release>.patch (the release's
        # edits) to this venv's TRL, then tests/matrix runs in fork mode (I1-I6 on 2 ranks started from a
        # scratch folder, where grpo_patches is not importable; tests/matrix/kit.py).
        _shared_torch(session)
        requirements = [f"trl=={trl}"] + [f"{name}=={row[name]}" for name in PINNED]
        session.install(*requirements, "--exclude-newer", _cap(row["released"]), "--override",
                        _no_torch_override(session))
        session.install(*FORK_TEST_DEPS, "--override", _no_torch_override(session))
        _versions(session)
        session.run("python", "tests/fork/drive.py", "--patch", "patches/grpo_rank_local.patch",
                    "--patch", f"patches/trl-{trl}.patch", "--apply-only")
        # posargs: any other command in the patched venv instead of the matrix
        command = session.posargs or ["python", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/matrix"]
        _stable_run(session, command, {"GRPO_PATCHES_TRL_VERSION": trl, "GRPO_PATCHES_MATRIX_MODE": "fork"})

    fork.__doc__ = (f"TRL {trl} with patches/grpo_rank_local.patch + trl-{trl}.patch applied, grpo_patches not "
                    "installed: tests/matrix (I1-I6) in fork mode")


for _trl in _FORK_RELEASES:
    _fork_session(_trl, COMPAT["supported"][_trl])


def _newest_trl(session: nox.Session) -> str:
    forced = os.environ.get("GRPO_PATCHES_CANARY_TRL")
    if forced:
        return forced
    wanted = Path(session.create_tmp()) / "newest-trl.in"
    wanted.write_text("trl\n")
    out = session.run(
        "uv",
        "pip",
        "compile",
        str(wanted),
        "--no-header",
        "--no-annotate",
        "--python",
        sys.executable,
        silent=True,
        log=False,
        external=True,
    )
    found = re.search(r"^trl==(\S+)$", out or "", re.MULTILINE)
    if not found:
        session.error(f"could not find the newest trl on the index: {out!r}")
    return found.group(1)


@nox.session(tags=["mutations"], reuse_venv=False, default=False)
def mutations(session: nox.Session) -> None:
    """Each planted bug in tests/mutations.toml, applied to a copy of the package, must make its guard
    tests fail (tests/mutations.py); run against the newest tested TRL release and its pins.

    The repo itself is not installed: every mutant imports its own copy (checked by the script).
    ``nox -s mutations -- --only ID[,ID]`` runs some; ``-- --list`` lists them.
    """
    trl = max(COMPAT["supported"], key=lambda v: tuple(int(p) for p in v.split(".")))
    row = COMPAT["supported"][trl]
    _shared_torch(session)
    session.install(f"trl=={trl}", *(f"{name}=={row[name]}" for name in PINNED), "--exclude-newer",
                    _cap(row["released"]), "--override", _no_torch_override(session))
    # triton: the decode-attention kernel's guards run it in Triton's interpreter (skipped without it)
    session.install(*TEST_DEPS, "triton; sys_platform == 'linux'")
    _versions(session)
    session.run("python", "tests/mutations.py", *session.posargs, env={"GRPO_PATCHES_TRL_VERSION": trl})


@nox.session(tags=["canary"], reuse_venv=False, default=False)
def canary(session: nox.Session) -> None:
    """The newest TRL on PyPI that is not in compat.json, with today's dependencies (uncapped).

    Expected outcome: apply() refuses it clearly (strict). With GRPO_PATCHES_CANARY_INVARIANTS=1 the
    invariants also run against it through the nearest adapter (GRPO_PATCHES_ALLOW_UNKNOWN=1), so a
    maintainer learns at once whether the release can be added to the table.
    """
    trl = _newest_trl(session)
    if trl in COMPAT["supported"]:
        session.skip(f"the newest trl ({trl}) is already in compat.json; nothing new to try")
    session.log(f"canary: trl {trl} (not in compat.json), uncapped dependencies")
    _install(session, trl, None, None)
    _versions(session)
    session.run("python", "-c", CANARY_REFUSAL, env={"GRPO_PATCHES_ALLOW_UNKNOWN": "0"})
    if os.environ.get("GRPO_PATCHES_CANARY_INVARIANTS") == "1":
        session.env["GRPO_PATCHES_ALLOW_UNKNOWN"] = "1"  # let the registry try the nearest adapter
        _run(session, trl)


CANARY_REFUSAL = """
import grpo_patches
try:
    grpo_patches.apply()
except grpo_patches.UnsupportedVersionError as exc:
    print("refused as expected:", exc)
else:
    raise SystemExit("an unknown TRL release was patched without GRPO_PATCHES_ALLOW_UNKNOWN=1")
"""


LAYOUT_DEPS = ("deepspeed==0.19.8", "bitsandbytes==0.50.2")  # the tested versions of pyproject's extra "layouts"


@nox.session(tags=["layouts"], reuse_venv=False, default=False)
def layouts(session: nox.Session) -> None:
    """Preflight's layouts against DeepSpeed (ZeRO-2/3, CPU accelerator) and bitsandbytes (nf4 / int8)
    on CPU, and the kit under DeepSpeed: the newest tested TRL row plus the ``layouts`` extra. Apart
    from the matrix because DeepSpeed compiles a CPU op on first use (a minute or more)."""
    newest = max(COMPAT["supported"], key=lambda v: tuple(int(x) for x in v.split(".")))
    row = COMPAT["supported"][newest]
    _install(session, newest, {name: row[name] for name in PINNED}, None)
    # math-verify and tensorboard: tests/test_deepspeed.py launches examples/train_grpo_lora.py with zero2 / zero3.yaml
    session.install(*LAYOUT_DEPS, "tokenizers", "math-verify", "tensorboard", "--override", _no_torch_override(session))
    _versions(session)
    command = session.posargs or ["pytest", "-q", "tests/test_preflight_layouts.py", "tests/test_deepspeed.py"]
    session.run(*command, env={"GRPO_PATCHES_TRL_VERSION": newest})
