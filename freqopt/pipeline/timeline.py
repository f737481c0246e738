"""One simulated pipeline stage's SM clock over time (freqopt.pipeline.sim, "Clocks"): the settings in force from
each landing on, the requests served one at a time by the stage's runtime thread, each landing one switch latency
after its set call starts."""

from __future__ import annotations

import math

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.physics import SetCallQueue

__all__ = ["ClockTimeline"]


class ClockTimeline:
    """One stage's clock over time: the setting in force from each landing on (times in s, ascending), the
    requests served by one runtime thread whose set calls take ``call_s`` each, one at a time (SetCallQueue)."""

    def __init__(self, setting: ClockSetting, call_s: float = 0.0):
        self.times = [-math.inf]
        self.settings = [setting]
        self.requested = setting
        self.n_requests = 0
        self.n_dropped = 0  # requests dropped unserved since the origin last moved (a newer one came while they waited)
        self.queue = SetCallQueue(call_s)
        self._queued = False  # whether the latest request submitted to the queue holds the last landing
        self._counted_from = 1  # index of the first landing asked for since the origin last moved (n_requests)

    def request(self, at_s: float, setting: ClockSetting, latency_s: float) -> None:
        if setting == self.requested:
            return
        self.requested = setting
        start_s, dropped = self.queue.submit(at_s)
        self.n_dropped += dropped
        if dropped and self._queued:  # the request before, still waiting, is not served
            self.times.pop()
            self.settings.pop()
            if len(self.times) >= self._counted_from:  # it was asked for in this iteration, and counted there
                self.n_requests -= 1
        # Back to the setting already landing: nothing to switch (the thread's turn is taken all the same).
        self._queued = setting != self.settings[-1]
        if self._queued:
            self.n_requests += 1
            self.times.append(start_s + latency_s)
            self.settings.append(setting)

    def index_at(self, t: float) -> int:
        """Index of the setting in force at time t (the last landing at or before t)."""
        i = len(self.times) - 1
        while self.times[i] > t:
            i -= 1
        return i

    def shifted(self, by_s: float) -> None:
        """Move the origin: every time decreases by ``by_s``; landings before the new origin collapse into one."""
        self.times = [t - by_s for t in self.times]
        keep = self.index_at(0.0)
        self.times = [-math.inf] + self.times[keep + 1:]
        self.settings = self.settings[keep:]
        self.n_requests = 0
        self.n_dropped = 0
        self._counted_from = len(self.times)
        self.queue.shift(by_s)
