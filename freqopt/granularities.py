"""The one-GPU search's granularities, by name, without the search (no Optuna or PyTorch import): so that a wrong
name is refused at once (issue 38, item 4). freqopt.search.units partitions a trace at each."""

from __future__ import annotations

from freqopt.errors import UnknownNameError

__all__ = ["GRANULARITIES", "check_granularity"]

# Coarse to fine: one power limit; one clock pair for the iteration; one per pass; one per kernel class; blocks of
# module phases (freqopt.search.schedule).
GRANULARITIES = ("power-cap", "iteration", "pass", "kernel", "phase")


def check_granularity(granularity: str) -> str:
    """``granularity`` if it is one of GRANULARITIES.

    Raises:
        UnknownNameError: any other name (the message lists them).
    """
    if granularity not in GRANULARITIES:
        raise UnknownNameError(f"unknown granularity {granularity!r}; choose from all, {', '.join(GRANULARITIES)}")
    return granularity
