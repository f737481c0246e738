"""Every measurement a search makes, kept in its Optuna storage.

A search killed at any point (SIGKILL included) and started again replays its own steps: each measurement it
already has is read back instead of taken, and each one it still needs is taken with the same sample index, so a
simulated GPU draws the same noise (SimulatedGPU._noisy) and the resumed search ends exactly where an
uninterrupted one would. A measurement is written before the search acts on it (an Optuna trial is told its
values only after its measurement is logged), so nothing finished is lost and nothing is measured twice.

Records are study user attributes (Study.set_user_attr), one key per measurement: "<tag>#<sample>" ->
[time_s, energy_j, cost_gpu_s, sm_clock_mhz]. One key per record means concurrent writers never
read-modify-write a shared value; each study has one writer at a time (its unit's owner, or the leader).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import optuna

from freqopt.gpu.backends.base import Measurement

__all__ = ["MeasurementLog", "digest"]

_PREFIX = "m:"


def digest(value: object) -> str:
    """A short stable name for a long value (a whole-iteration schedule): sha1 of its repr, 16 hex digits."""
    return hashlib.sha1(repr(value).encode()).hexdigest()[:16]


class MeasurementLog:
    """The measurements recorded in ``study`` (any storage, in-memory included), and a way to add to them.

    Attributes:
        n_new: measurements taken through this object (not read back from storage).
        n_stored: distinct measurements read back from those the storage held when this object was made (an
            earlier run's, or another process's).
    """

    def __init__(self, study: optuna.Study):
        self.study = study
        self.records: dict[str, list] = {k: v for k, v in study.user_attrs.items() if k.startswith(_PREFIX)}
        self.n_new = 0
        self._stored, self._read = frozenset(self.records), set()

    @property
    def n_stored(self) -> int:
        return len(self._read)

    def measure(self, tag: str, sample: int, take: Callable[[int], Measurement]) -> Measurement:
        """The ``sample``-th measurement of ``tag``: read back if recorded, else ``take(sample)``, recorded first.

        Args:
            tag: what is measured (a unit's setting, a schedule's digest); at most a few hundred characters.
            sample: its index among measurements of the same tag, from 0.
            take: performs the measurement; called with ``sample``.
        """
        key = f"{_PREFIX}{tag}#{sample}"
        record = self.records.get(key)
        if record is not None:
            if key in self._stored:
                self._read.add(key)
            return Measurement(*record)
        m = take(sample)
        record = [m.time_s, m.energy_j, m.cost_gpu_s, m.sm_clock_mhz]
        self.study.set_user_attr(key, record)
        self.records[key] = record
        self.n_new += 1
        return m
