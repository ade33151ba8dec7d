"""Shared fixtures: the tiny model and its tokenizer, glm52-tiny, the shipped tasks; offline settings for every test."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from models import resolve_model_path

    return str(resolve_model_path("tiny-random"))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from models import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    from models import load_model

    return load_model(tiny_path).eval()


@pytest.fixture(scope="session")
def glm52_path() -> str:
    from models import resolve_model_path

    return str(resolve_model_path("glm52-tiny"))


@pytest.fixture(scope="session")
def glm52_policy(glm52_path):
    """glm52-tiny as a policy, fp32, eval mode: shared, so never changed (tests that perturb it take a copy)."""
    from models import load_model

    return load_model(glm52_path, "policy").eval()


@pytest.fixture(scope="session")
def shipped_tasks():
    from environments import load_tasks

    return load_tasks()


@pytest.fixture(scope="session")
def task_by_id(shipped_tasks):
    return {t.id: t for t in shipped_tasks.tasks}
