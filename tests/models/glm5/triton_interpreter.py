"""Run a check of a Triton kernel on the CPU, under Triton's interpreter, in a fresh interpreter process (Triton
decides between compiling and interpreting when a kernel is defined, so the flag cannot be set in-process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def run_interpreted(module: str, check: str) -> None:
    """Call `module.check(torch.float32, "cpu")` with TRITON_INTERPRET=1; fail with its output if it fails."""
    pytest.importorskip("triton")
    code = f"import torch; from {module} import {check}; {check}(torch.float32, 'cpu')"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
