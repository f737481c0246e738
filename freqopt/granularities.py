"""The one-GPU search's granularities, by name, without the search (no Optuna or PyTorch import): so that a wrong
name is refused at once. freqopt.search.units partitions a trace at each. Also a pipeline
search's (freqopt.pipeline.config)."""

from __future__ import annotations

from collections.abc import Sequence

from freqopt.errors import InvalidSettingError, UnknownNameError

__all__ = ["GRANULARITIES", "check_granularity", "PIPELINE_GRANULARITIES", "pipeline_granularities"]

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


PIPELINE_GRANULARITIES = ("iteration", "stage", "instruction")


def pipeline_granularities(granularity: str | Sequence[str]) -> tuple[str, ...]:
    """The granularities of a pipeline search, coarse to fine, from "all", one name or a sequence of names.

    Raises:
        UnknownNameError: a name that is not a pipeline granularity (the message lists them).
        InvalidSettingError: an empty sequence or something that is not a name.
    """
    names = [granularity] if isinstance(granularity, str) else granularity
    if not isinstance(names, Sequence) or not names or not all(isinstance(g, str) for g in names):
        raise InvalidSettingError(f"granularity must be 'all', {' or '.join(PIPELINE_GRANULARITIES)}, or a sequence of "
                                  f"them, not {granularity!r}", argument="granularity")  # fmt: skip
    if "all" in names:
        return PIPELINE_GRANULARITIES
    for g in names:
        if g not in PIPELINE_GRANULARITIES:
            raise UnknownNameError(f"granularity {g!r} is not searched on a pipeline (pp > 1): choose all, "
                                   f"{', '.join(PIPELINE_GRANULARITIES)}", argument="granularity")  # fmt: skip
    return tuple(g for g in PIPELINE_GRANULARITIES if g in names)
