"""The scripted models of the whole-loop tests, taught once for the session (tests/e2e/scripted_policy.py)."""

from __future__ import annotations

import pytest

from .scripted_policy import make_scripted_judge, make_scripted_policy


@pytest.fixture(scope="session")
def scripted_policy(tiny_path, tmp_path_factory):
    """Read only: every run takes it as `model.name` and writes its checkpoints elsewhere."""
    return make_scripted_policy(tiny_path, tmp_path_factory.mktemp("policy") / "scripted")


@pytest.fixture(scope="session")
def scripted_judge(tiny_path, tmp_path_factory):
    return make_scripted_judge(tiny_path, tmp_path_factory.mktemp("judge") / "judge")
