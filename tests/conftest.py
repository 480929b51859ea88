"""Shared fixtures. Engines in the test process run in-process (no extra engine process), on
CPU, with their OpenMP threads left to the OS: this must be set before vLLM is imported."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from engine.models import PreparedModel, prepare_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model() -> PreparedModel:
    return prepare_model("tiny")


@pytest.fixture(scope="session")
def smollm2_model() -> PreparedModel:
    return prepare_model("smollm2")
