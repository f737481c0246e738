"""The slowdown budget: how much slower than at default settings the training iteration may run."""

from __future__ import annotations

import math
import re

from freqopt.errors import InvalidSettingError

__all__ = ["parse_slowdown"]

_NUMBER = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%?)")


def parse_slowdown(value: float | str, *, argument: str = "max_slowdown") -> float:
    """A slowdown as a fraction of the default iteration time: 0.01, "1%", "1 %" and "0.01" all give 0.01.

    Args:
        value: a fraction (a number, or a string without "%") or a percentage (a string ending in "%").
        argument: the argument's name, for the error message.

    Returns:
        The fraction, in [0, 1).

    Raises:
        InvalidSettingError: not a number, negative, not finite, or 100 % or more.
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
        return fraction
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
    return fraction
