"""The scripts under bench/ (not a package) for the tests that check them: `load` imports one as a module, `BENCH`
is their folder (for running one as the command a GPU session runs)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py, imported with bench/ on the path (a script imports its neighbours by their plain names)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)
