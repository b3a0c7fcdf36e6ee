"""Edits to a release's own files, placed with ``ast`` on the release's text (never by line number),
and the unified diffs (3 lines of context) that carry every file of a patch."""

from __future__ import annotations

import ast
import difflib

from .bundle import BundleError
from .layout import Target
from .paths import SWITCH
from .settings import Setting, config_fields
from .shim import hook

__all__ = ["diff", "edited_files"]


def edited_files(target: Target, sources: dict[str, str], found: list[Setting]) -> dict[str, str]:
    """The edited text of every upstream file the edit patch touches."""
    inserts: dict[str, list[tuple[int, str]]] = {name: [] for name in sources}
    # settings: after the config class's last field
    tree = ast.parse(sources[target.config_file])
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == target.config_class), None)
    if cls is None:
        raise BundleError(f"{target.config_file} of {target.release} defines no class {target.config_class}")
    fields = [s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    clash = {f.target.id for f in fields} & {SWITCH, *(s.name for s in found)}  # type: ignore[union-attr]
    if clash:
        raise BundleError(f"{target.config_class} of {target.release} already has fields {sorted(clash)}")
    if not fields:
        raise BundleError(f"{target.config_class} of {target.release} has no fields to add settings after")
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "dataclasses"
                for a in n.names}
    block = config_fields(target.package, found, with_field="field" in imported)
    inserts[target.config_file].append((fields[-1].end_lineno, block))  # type: ignore[arg-type]
    # hook: at the end of the trainer's module, where the trainer and config classes are both defined
    tree = ast.parse(sources[target.trainer_file])
    top = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    top |= {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names}
    missing = {target.trainer_class, target.config_class} - top
    if missing:
        raise BundleError(f"{target.trainer_file} of {target.release} has no module-level {sorted(missing)}")
    inserts[target.trainer_file].append((len(sources[target.trainer_file].splitlines()), hook(target)))
    out = {}
    for name, text in sources.items():
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"  # the diff keeps upstream's missing newline as a removed/added line pair
        for line_no, block in sorted(inserts[name], reverse=True):
            lines[line_no:line_no] = block.splitlines(keepends=True)
        out[name] = "".join(lines)
    return out


def diff(path: str, old: str | None, new: str) -> str:
    """A git-style unified diff of one file (``old`` None: a new file), no dates, no ids."""
    old_lines = old.splitlines(keepends=True) if old is not None else []
    new_lines = new.splitlines(keepends=True)
    head = [f"diff --git a/{path} b/{path}\n"]
    if old is None:
        head += ["new file mode 100644\n", "--- /dev/null\n", f"+++ b/{path}\n"]
    else:
        head += [f"--- a/{path}\n", f"+++ b/{path}\n"]
    body = []
    for line in list(difflib.unified_diff(old_lines, new_lines, n=3))[2:]:
        body.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(head + body)
