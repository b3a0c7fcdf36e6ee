"""``grpo_patches/testing.py`` (the tiny model, tokenizer, dataset and free ports; it imports nothing of the
kit) loaded by its path as a module of its own. The fork-mode runs (tests/matrix under ``nox -s fork-*``,
tests/fork) must not import the ``grpo_patches`` package, whose ``__init__`` pulls in the kit and wrapt:
this way they use the same components without it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "grpo_patches_testing_standalone"


def load() -> ModuleType:
    if NAME not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "grpo_patches" / "testing.py"
        spec = importlib.util.spec_from_file_location(NAME, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[NAME]


testing = load()
