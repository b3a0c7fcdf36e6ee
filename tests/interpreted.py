"""Kernel tests in Triton's interpreter: :func:`interpreted` runs a test in a fresh pytest process with
``TRITON_INTERPRET=1``, which Triton reads when it is first imported (this process may have done so already)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def interpreted(test):
    """Run ``test`` in a fresh pytest process with ``TRITON_INTERPRET=1`` (here, if this one has it)."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:  # the test's fixtures (pytest reads the wrapped signature)
        if os.environ.get("TRITON_INTERPRET") == "1":
            return test(*args, **kwargs)
        pytest.importorskip("triton", reason="the kernel tests need Triton (the `test` extra installs it)")
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        node = f"{Path(sys.modules[test.__module__].__file__).resolve().relative_to(ROOT)}::{test.__name__}"
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", node], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-6000:] + out.stderr[-3000:]

    return run
