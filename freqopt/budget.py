"""The slowdown budget: how much slower than at default settings the training iteration may run."""

from __future__ import annotations

import math
import re

from freqopt.errors import InvalidSettingError

__all__ = ["CONFIRM_TRIES", "DEFAULT_CONFIDENCE", "check_confidence", "first_confirmed", "parse_slowdown"]

_NUMBER = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%?)")


def parse_slowdown(value: float | str, *, argument: str = "max_slowdown", allow_zero: bool = False) -> float:
    """A slowdown as a fraction of the default iteration time: 0.01, "1%", "1 %" and "0.01" all give 0.01.

    A budget of zero is refused unless ``allow_zero``: a search keeps a schedule only where its slowdown's upper
    confidence bound is within the budget, and no slower setting's readings put that bound at or below zero, so a
    zero budget spends its measurements to return the default settings. A pipeline's plan (freqopt.pipeline) allows
    it: instructions off the critical path slow down at no cost to the iteration.

    Args:
        value: a fraction (a number, or a string without "%") or a percentage (a string ending in "%").
        argument: the argument's name, for the error message.
        allow_zero: accept 0 (a pipeline's budget).

    Returns:
        The fraction, in (0, 1), or [0, 1) with ``allow_zero``.

    Raises:
        InvalidSettingError: not a number, negative, not finite, 100 % or more, or zero without ``allow_zero``.
    """
    if isinstance(value, bool):
        raise InvalidSettingError(f"{argument} {value!r} is not a slowdown; write a fraction like 0.01 or '1%'",
                                  argument=argument)  # fmt: skip
    if isinstance(value, (int, float)):
        fraction = float(value)
        if not math.isfinite(fraction) or not 0.0 <= fraction < 1.0:
            raise InvalidSettingError(
                f"{argument} {value!r} is outside [0, 1); write a fraction like 0.01 or a percentage like '1%'",
                argument=argument,
            )
        return _refuse_zero(fraction, value, argument, allow_zero)
    raw = str(value).strip()
    if raw.startswith("-"):
        raise InvalidSettingError(f"{argument} {value!r} is negative; a slowdown is in [0, 100%), like 1% or 0.01",
                                  argument=argument)  # fmt: skip
    match = _NUMBER.fullmatch(raw)
    if not match:
        raise InvalidSettingError(f"{argument} {value!r} is not a slowdown; write a percentage like 1% or a "
                                  "fraction like 0.01", argument=argument)  # fmt: skip
    fraction = float(match.group(1)) / (100.0 if match.group(2) else 1.0)
    if not 0.0 <= fraction < 1.0:
        raise InvalidSettingError(
            f"{argument} {value!r} is outside [0, 100%); write a percentage like 1% or a fraction like 0.01",
            argument=argument,
        )
    return _refuse_zero(fraction, value, argument, allow_zero)


def _refuse_zero(fraction: float, value, argument: str, allow_zero: bool) -> float:
    if fraction == 0.0 and not allow_zero:
        raise InvalidSettingError(f"{argument} {value!r} must be above 0: a search at no slowdown can only keep the "
                                  "default settings (no slower setting is within it at any confidence); give a "
                                  "budget like 1% or 0.01", argument=argument)  # fmt: skip
    return fraction


# The confidence at which a schedule's slowdown is promised to be within the budget: its upper one-sided confidence
# bound must be. 95 % is the field's default one-sided level; 0.5 judges on the mean alone.
DEFAULT_CONFIDENCE = 0.95

# Schedules confirmed at most, least energy first, on fresh readings after a level's choice before it falls back to
# the defaults (freqopt.search.allocation.confirmed): each confirmation costs its readings, and a schedule that fails
# one is usually followed by others chosen as near the budget's edge.
CONFIRM_TRIES = 3


def first_confirmed(choices, confirm, holds):
    """The first of ``choices`` (least energy first, each once) among the first CONFIRM_TRIES whose confirmation,
    ``confirm(choice)`` (fresh readings taken after the choice), ``holds``: (choice, confirmation); None where none
    does. The rule every level keeps a schedule by (freqopt.search.validate.Validator.confirm)."""
    for choice in list(choices)[:CONFIRM_TRIES]:
        fresh = confirm(choice)
        if holds(fresh):
            return choice, fresh
    return None


def check_confidence(confidence: float, *, argument: str = "confidence") -> float:
    """``confidence`` as a float in [0.5, 1): the one-sided confidence level at which a schedule's slowdown is held
    to the budget (freqopt.search.validate.PairedReadings).

    Raises:
        InvalidSettingError: not a number in [0.5, 1).
    """
    try:
        value = float(confidence)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(confidence, bool) or not 0.5 <= value < 1.0:
        raise InvalidSettingError(f"{argument} {confidence!r} is not a confidence level; give one in [0.5, 1), such "
                                  f"as 0.95 (0.5 judges a schedule on its mean alone)", argument=argument)  # fmt: skip
    return value
