"""Sandbox fixtures: every sandbox test runs on each backend; Docker's skip, saying why, where no engine runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from environments import make_sandbox

SETUP_WAIT_S = 900  # .ci/run builds the engine and image in the background while the venv installs


def _wait_for_ci_setup() -> str:
    """When .ci/run is still setting Docker up (status file in AGENTIC_RL_DOCKER_SETUP), wait for it; returns
    the setup's last status line ('' outside CI)."""
    status_file = os.environ.get("AGENTIC_RL_DOCKER_SETUP")
    if not status_file:
        return ""
    path = Path(status_file)
    deadline = time.monotonic() + SETUP_WAIT_S
    while time.monotonic() < deadline:
        status = path.read_text().strip() if path.exists() else "running"
        if not status.startswith("running"):
            return status
        time.sleep(2)
    return f"still running after {SETUP_WAIT_S} s"


@pytest.fixture(scope="session")
def docker_engine() -> str:
    """A Docker engine with the sandbox image, or a skip that says why there is none."""
    status = _wait_for_ci_setup()
    from environments.sandbox.docker import docker_available

    ok, why = docker_available()
    if not ok:
        pytest.skip(f"no Docker engine for the docker sandbox: {why}" + (f" (CI setup: {status})" if status else ""))
    return why


@pytest.fixture(params=["bwrap", "docker"])
def backend(request) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return request.param


@pytest.fixture(params=["bwrap", "bwrap-per-call", "docker"])
def sandbox_kind(request) -> str:
    """The backends, and bwrap both ways: its resident executor (the default as root) and a bwrap per call."""
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return request.param


@pytest.fixture
def make(sandbox_kind):
    """make(**limits) → a sandbox of the test's kind, closed at the end of the test."""
    made = []
    backend, options = (("bwrap", {"resident": False}) if sandbox_kind == "bwrap-per-call"
                        else (sandbox_kind, {}))

    def factory(**limits):
        box = make_sandbox(backend, **options, **limits)
        made.append(box)
        return box

    yield factory
    for box in made:
        box.close()
