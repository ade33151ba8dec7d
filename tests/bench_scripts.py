"""The scripts under bench/ (not a package) for the tests that check them: `load` imports one as a module, `BENCH`
is their folder (for running one as the command a GPU session runs)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py, imported as the module `name` with bench/ on the path while it imports (only then: its
    scripts' plain names, engine or guard, would otherwise shadow other imports for the rest of the session)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
