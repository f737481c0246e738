"""Shared fixtures: small traces (traced once per session) and GPU specs."""

from __future__ import annotations

import optuna
import pytest

from freqopt.models import get_workload
from freqopt.trace import trace_training_iteration

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="session")
def small_trace():
    """gpt3-small, one sequence of 256 tokens: the real kernel mix, small enough for quick searches."""
    return trace_training_iteration(get_workload("gpt3-small", micro_batch_size=1, seq_len=256))


@pytest.fixture(scope="session")
def gpt3_small_trace():
    return trace_training_iteration(get_workload("gpt3-small"))
