"""A stand-in for AMD SMI's Python bindings (``import amdsmi``), for tests on machines without an AMD GPU: what
tests/fake_pynvml.py is for NVML.

It models what freqopt.gpu.amdsmi relies on, with AMD SMI's names and units (ROCm 6.x): processor handles, the ASIC
info's ``market_name`` and the device UUID; the GFX and memory clocks' DPM levels (``amdsmi_get_clk_freq``, Hz)
and a clock range set by ``amdsmi_set_gpu_clk_range`` (MHz) within them; the performance level; the power cap
(``amdsmi_get_power_cap_info`` and ``amdsmi_set_power_cap``, uW) within its range; the package's power
(``amdsmi_get_power_info``, W); and an energy accumulator (``amdsmi_get_energy_count``: ``energy_accumulator`` x
``counter_resolution`` uJ) that advances with a fake clock at the package's power but only at its update period.
Errors are ``AmdSmiLibraryException``s carrying amdsmi_status_t codes: every set call raises AMDSMI_STATUS_NO_PERM
(10) unless the fake runs as "root", a value outside the range AMDSMI_STATUS_INVAL (1), a missing driver
AMDSMI_STATUS_DRIVER_NOT_LOADED (34), a GPU without an energy counter (``energy_counter=False``: the odd die of an
MI250X) AMDSMI_STATUS_NOT_SUPPORTED (2). Every call is logged, so tests can prove which calls were made.
"""

from __future__ import annotations

import enum
import json
import os
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

SETTERS = ("amdsmi_set_gpu_clk_range", "amdsmi_set_power_cap", "amdsmi_set_gpu_perf_level")
INVAL, NOT_SUPPORTED, NO_PERM, DRIVER_NOT_LOADED = 1, 2, 10, 34


class AmdSmiLibraryException(Exception):
    def __init__(self, code: int):
        super().__init__(f"amdsmi status {code}")
        self.code = code

    def get_error_code(self) -> int:
        return self.code


class AmdSmiClkType(enum.IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4


class AmdSmiDevPerfLevel(enum.IntEnum):
    AUTO = 0
    LOW = 1
    HIGH = 2
    MANUAL = 3


@dataclass
class FakeAMDGPU:
    name: str = "AMD Instinct MI300X"
    uuid: str = "00ff74a1-0000-1000-8000-000000000000"
    gfx_levels_mhz: tuple[int, ...] = (500, 1300, 2100)  # DPM levels; any clock in between can be held
    mem_levels_mhz: tuple[int, ...] = (1300,)
    gfx_range_mhz: tuple[int, int] | None = None  # the range set; None: the whole range
    mem_range_mhz: tuple[int, int] | None = None
    perf_level: int = 0  # AmdSmiDevPerfLevel.AUTO
    power_cap_range_uw: tuple[int, int] = (0, 750_000_000)
    power_cap_default_uw: int = 750_000_000
    power_cap_uw: int = 750_000_000
    power_w: float = 500.0  # package power while the fake clock runs
    counter_period_s: float = 0.001  # the accumulator changes this often
    resolution_uj: float = 15.3  # counter_resolution, uJ per count
    accumulator: float = 1_000_000.0
    realtime: bool = False  # advance with the wall clock at every counter read
    energy_counter: bool = True
    _last_real_s: float | None = None
    _pending_uj: float = 0.0
    _since_update_s: float = 0.0

    @property
    def locked_sm_mhz(self) -> int | None:
        """The GFX clock held (a range of one clock), or None."""
        r = self.gfx_range_mhz
        return r[0] if r is not None and r[0] == r[1] else None

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` of fake time pass: energy accrues, the accumulator moves at its update period only."""
        while seconds > 0:
            step = min(seconds, self.counter_period_s - self._since_update_s)
            self._pending_uj += self.power_w * step * 1e6
            self._since_update_s += step
            seconds -= step
            if self._since_update_s >= self.counter_period_s - 1e-12:
                counts = int(self._pending_uj // self.resolution_uj)
                self.accumulator += counts
                self._pending_uj -= counts * self.resolution_uj
                self._since_update_s = 0.0


@dataclass
class FakeAMDSMI:
    gpus: list[FakeAMDGPU] = field(default_factory=lambda: [FakeAMDGPU()])
    root: bool = False
    driver: bool = True
    calls: list[tuple] = field(default_factory=list)
    persist: str | None = None  # a JSON file holding the GPUs' state, rewritten after every set call

    def set_calls(self) -> list[tuple]:
        return [c for c in self.calls if c[0] in SETTERS]

    def save(self, path: str | Path | None = None) -> None:
        """Write the GPUs' state (what survives a process) to ``path``, atomically."""
        target = Path(path or self.persist)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"root": self.root, "gpus": [asdict(g) for g in self.gpus]}))
        os.replace(partial, target)

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> FakeAMDSMI:
        raw = json.loads(Path(path).read_text())
        gpus = [FakeAMDGPU(**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}) for g in raw["gpus"]]
        return cls(gpus=gpus, root=raw["root"], **kwargs)

    def module(self) -> types.ModuleType:
        """A module object with amdsmi's names, backed by this fake."""
        m = types.ModuleType("amdsmi")
        m.AmdSmiLibraryException, m.AmdSmiClkType, m.AmdSmiDevPerfLevel = (AmdSmiLibraryException, AmdSmiClkType,
                                                                           AmdSmiDevPerfLevel)  # fmt: skip
        fake = self

        def logged(fn):
            def call(*args):
                fake.calls.append((fn.__name__, *args))
                result = fn(*args)
                if fake.persist and fn.__name__ in SETTERS:
                    fake.save()
                return result

            call.__name__ = fn.__name__
            setattr(m, fn.__name__, call)
            return call

        def gpu(handle) -> FakeAMDGPU:
            return fake.gpus[handle]

        def need_root():
            if not fake.root:
                raise AmdSmiLibraryException(NO_PERM)

        def levels(g: FakeAMDGPU, clock) -> tuple[int, ...]:
            return g.mem_levels_mhz if clock == AmdSmiClkType.MEM else g.gfx_levels_mhz

        @logged
        def amdsmi_init(*flags):
            if not fake.driver:
                raise AmdSmiLibraryException(DRIVER_NOT_LOADED)

        @logged
        def amdsmi_shut_down():
            pass

        @logged
        def amdsmi_get_processor_handles():
            return list(range(len(fake.gpus)))

        @logged
        def amdsmi_get_gpu_asic_info(h):
            return {"market_name": gpu(h).name, "vendor_id": "0x1002", "device_id": "0x74a1"}

        @logged
        def amdsmi_get_gpu_device_uuid(h):
            return gpu(h).uuid

        @logged
        def amdsmi_get_clk_freq(h, clock):
            hz = [f * 1_000_000 for f in levels(gpu(h), clock)]
            return {"num_supported": len(hz), "current": 0, "frequency": hz}

        @logged
        def amdsmi_get_clock_info(h, clock):
            g = gpu(h)
            lv = levels(g, clock)
            held = g.mem_range_mhz if clock == AmdSmiClkType.MEM else g.gfx_range_mhz
            lo, hi = held or (lv[0], lv[-1])
            return {"clk": hi, "min_clk": lo, "max_clk": hi, "clk_locked": held is not None, "clk_deep_sleep": 0}

        @logged
        def amdsmi_get_power_cap_info(h):
            g = gpu(h)
            return {"power_cap": g.power_cap_uw, "default_power_cap": g.power_cap_default_uw, "dpm_cap": 0,
                    "min_power_cap": g.power_cap_range_uw[0], "max_power_cap": g.power_cap_range_uw[1]}  # fmt: skip

        @logged
        def amdsmi_get_power_info(h):
            g = gpu(h)
            if not g.energy_counter:
                return {"average_socket_power": "N/A", "current_socket_power": "N/A"}
            return {"average_socket_power": int(round(g.power_w)), "current_socket_power": int(round(g.power_w))}

        @logged
        def amdsmi_get_energy_count(h):
            g = gpu(h)
            if not g.energy_counter:
                raise AmdSmiLibraryException(NOT_SUPPORTED)
            if g.realtime:
                now = time.monotonic()
                if g._last_real_s is not None:
                    g.advance(now - g._last_real_s)
                g._last_real_s = now
            return {"energy_accumulator": int(g.accumulator), "counter_resolution": g.resolution_uj,
                    "timestamp": time.monotonic_ns()}  # fmt: skip

        @logged
        def amdsmi_set_gpu_clk_range(h, lo, hi, clock):
            need_root()
            g = gpu(h)
            lv = levels(g, clock)
            if not lv[0] <= lo <= hi <= lv[-1]:
                raise AmdSmiLibraryException(INVAL)
            whole = (lo, hi) == (lv[0], lv[-1])
            if clock == AmdSmiClkType.MEM:
                g.mem_range_mhz = None if whole else (lo, hi)
            else:
                g.gfx_range_mhz = None if whole else (lo, hi)
                g.perf_level = int(AmdSmiDevPerfLevel.MANUAL)

        @logged
        def amdsmi_set_gpu_perf_level(h, level):
            need_root()
            gpu(h).perf_level = int(level)

        @logged
        def amdsmi_set_power_cap(h, sensor, cap_uw):
            need_root()
            lo, hi = gpu(h).power_cap_range_uw
            if sensor != 0 or not lo <= cap_uw <= hi:
                raise AmdSmiLibraryException(INVAL)
            gpu(h).power_cap_uw = cap_uw

        return m
