"""Which of the kit's modules a fork needs: the import closure of an adapter, refusing what a fork
could not run (an absolute ``grpo_patches`` import, ``wrapt``)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from .paths import KIT

__all__ = ["FORBIDDEN", "BundleError", "bundle_modules", "module_file"]

# Imports a bundled module may not make: the fork has neither.
FORBIDDEN = ("grpo_patches", "wrapt")
# Functions whose forbidden import is fine, with why: the path is not taken in a fork.
LAZY_OK = {
    "enable_fast_generation": "imports wrapt only for a trainer class that is not wrapped; the fork's install "
                              "wraps the class and marks each wrapper as wrapt does (_self_wrapper)",
}


class BundleError(RuntimeError):
    """Something the fork would need cannot be carried by the patch."""


def module_file(root: Path, dotted: str) -> Path | None:
    """The file of module ``dotted`` (relative to the package at ``root``; ``""`` is the package)."""
    base = root.joinpath(*dotted.split(".")) if dotted else root
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if dotted and base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def _is_package(root: Path, dotted: str) -> bool:
    f = module_file(root, dotted)
    return f is not None and f.name == "__init__.py"


def bundle_modules(start: str, root: Path = KIT, forbidden: Iterable[str] = FORBIDDEN,
                   aliased: Iterable[str] = ()) -> list[str]:
    """Every module of the package at ``root`` that importing ``start`` runs, as dotted names relative
    to ``root`` (``""`` is the package itself and is never bundled: the patch writes its own).

    ``aliased``: modules the fork already has under another name (the patched trainer's own module,
    for the vendored trainer): not copied, only their parent packages; the install shim points the
    bundled name at the fork's module. Importing one at module level is refused (the alias is made
    when the hook runs, after the bundle is imported).
    """
    forbidden, aliased = tuple(forbidden), tuple(aliased)
    todo, seen = [start], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in aliased:
            parts = name.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts))]
            continue
        path = module_file(root, name)
        if path is None:
            raise BundleError(f"cannot bundle {root.name}.{name}: no such module under {root}")
        parts = name.split(".") if name else []
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run first
        package = parts if _is_package(root, name) else parts[:-1]
        todo += _imported(root, path, package, forbidden, aliased)
    return sorted(m for m in seen if m and m not in aliased)


def _imported(root: Path, path: Path, package: list[str], forbidden: tuple[str, ...],
              aliased: tuple[str, ...]) -> list[str]:
    """The kit modules one file imports (relative imports); an import a fork could not make raises."""
    where = f"{root.name}/{path.relative_to(root)}"
    tree = ast.parse(path.read_text(), str(path))
    excused = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in LAZY_OK
               for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom) and not getattr(n, "level", 0)}
    found: list[str] = []
    for node in ast.walk(tree):
        if id(node) in excused:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in forbidden:
                    raise BundleError(f"{where}:{node.lineno} imports {alias.name}, which a fork does not have; "
                                      f"use a relative import of a bundled module instead")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if (node.module or "").split(".")[0] in forbidden:
                    raise BundleError(f"{where}:{node.lineno} imports from {node.module}, which a fork does "
                                      f"not have; use a relative import of a bundled module instead")
                continue
            if node.level - 1 > len(package):
                raise BundleError(f"{where}:{node.lineno}: relative import above {root.name}")
            base = package[: len(package) - (node.level - 1)]
            target = ".".join(base + (node.module.split(".") if node.module else []))
            if target in aliased and node in tree.body:
                raise BundleError(f"{where}:{node.lineno} imports {target} at module level; the fork's "
                                  f"module is aliased only when its install hook runs: import it in the function")
            if target:
                found.append(target)
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if module_file(root, sub) is not None:
                    found.append(sub)
                elif not target:
                    raise BundleError(
                        f"{where}:{node.lineno} imports {alias.name!r} from {root.name}/__init__.py, which the "
                        f"fork replaces with its own; import it from the module that defines it")
    return found
