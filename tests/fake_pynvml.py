"""A stand-in for the pynvml module (nvidia-ml-py), for tests on machines without a GPU.

It keeps real pynvml's error classes and constants (so ``except pynvml.NVMLError`` and ``e.value`` behave as with
the real library) and models what freqopt relies on: devices with names, UUIDs and supported clock lists; a power
limit in mW within constraints; the board's power draw (nvmlDeviceGetPowerUsage, mW: ``power_w``); locked SM and memory clocks and their reset; application clocks; permission (every
set and reset call fails with NVML_ERROR_NO_PERMISSION unless the fake runs as "root"); and an energy counter in mJ
that advances with a fake clock at the board's power but changes only at its update period, as real counters do.
A GPU can lack the energy counter (``energy_counter=False``, as before Volta) and the power reading
(``power_reading=False``): those calls then raise NVMLError_NotSupported. Every call is logged, so tests can prove
which calls were made.

It refuses what the GPU refuses: nvmlDeviceSetMemoryLockedClocks and its reset raise NVMLError_NotSupported
(NVML_ERROR_NOT_SUPPORTED, real pynvml's class) on a GPU whose memory clock does not lock at run time: as the
search_spaces/ file listing its name says (``mem_clock_lock``: "per-job" on Hopper, "none" before Ampere), unless
the FakeGPU sets ``mem_clock_lock`` itself.
"""

from __future__ import annotations

import json
import os
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pynvml as _real

SETTERS = ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetMemoryLockedClocks",
           "nvmlDeviceResetMemoryLockedClocks", "nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetApplicationsClocks",
           "nvmlDeviceResetApplicationsClocks")  # fmt: skip


@dataclass
class FakeGPU:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    mem_clocks_mhz: tuple[int, ...] = (2619,)
    sm_clocks_mhz: tuple[int, ...] = tuple(range(1980, 344, -15))
    power_limit_constraints_mw: tuple[int, int] = (200_000, 700_000)
    power_limit_default_mw: int = 700_000
    power_limit_mw: int = 700_000
    applications_clocks_mhz: tuple[int, int] = (1980, 2619)  # (SM, memory)
    locked_sm_mhz: int | None = None
    locked_mem_mhz: int | None = None
    power_w: float = 400.0  # board power while the fake clock runs
    counter_period_s: float = 0.1  # the energy counter changes this often
    energy_mj: float = 1_000_000.0
    realtime: bool = False  # advance with the wall clock at every counter read
    mem_clock_lock: str | None = None  # "runtime", "per-job", "none"; None: as search_spaces/ says for its name
    energy_counter: bool = True  # False: nvmlDeviceGetTotalEnergyConsumption is not supported (before Volta)
    power_reading: bool = True  # False: nvmlDeviceGetPowerUsage is not supported either
    _last_real_s: float | None = None
    _pending_mj: float = 0.0
    _since_update_s: float = 0.0

    def memory_locks_at_run_time(self) -> bool:
        """Whether nvmlDeviceSetMemoryLockedClocks works on this GPU while a job runs: its own ``mem_clock_lock``,
        else the search_spaces/ file that lists its name (a name no file lists: NVML's documented Ampere+ call)."""
        lock = self.mem_clock_lock
        if lock is None:
            from freqopt.gpu.specs import get_gpu, list_gpus

            lock = next((get_gpu(n).mem_clock_lock for n in list_gpus() if self.name in get_gpu(n).nvml_names),
                        "runtime")  # fmt: skip
        return lock == "runtime"

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` of fake time pass: energy accrues, the counter moves at its update period only."""
        while seconds > 0:
            step = min(seconds, self.counter_period_s - self._since_update_s)
            self._pending_mj += self.power_w * step * 1000
            self._since_update_s += step
            seconds -= step
            if self._since_update_s >= self.counter_period_s - 1e-12:
                self.energy_mj += self._pending_mj
                self._pending_mj, self._since_update_s = 0.0, 0.0


@dataclass
class FakeNVML:
    gpus: list[FakeGPU] = field(default_factory=lambda: [FakeGPU()])
    root: bool = False
    driver: bool = True
    calls: list[tuple] = field(default_factory=list)
    persist: str | None = None  # a JSON file holding the GPUs' state, rewritten after every set call

    def set_calls(self) -> list[tuple]:
        return [c for c in self.calls if c[0] in SETTERS]

    def save(self, path: str | Path | None = None) -> None:
        """Write the GPUs' state (what survives a process: the GPU keeps its settings) to ``path``."""
        # Atomically (a temporary file renamed over the old one): a test polls this file while a child process
        # rewrites it, and must never read it half-written.
        target = Path(path or self.persist)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"root": self.root, "gpus": [asdict(g) for g in self.gpus]}))
        os.replace(partial, target)

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> FakeNVML:
        raw = json.loads(Path(path).read_text())
        gpus = [FakeGPU(**{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}) for g in raw["gpus"]]
        return cls(gpus=gpus, root=raw["root"], **kwargs)

    def module(self) -> types.ModuleType:
        """A module object with pynvml's names, backed by this fake."""
        m = types.ModuleType("pynvml")
        for name in dir(_real):
            if name.startswith("NVML_") or name.startswith("NVMLError"):
                setattr(m, name, getattr(_real, name))
        fake = self

        def err(code):
            return _real.NVMLError(code)

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

        def gpu(handle) -> FakeGPU:
            return fake.gpus[handle]

        def need_root():
            if not fake.root:
                raise err(_real.NVML_ERROR_NO_PERMISSION)

        @logged
        def nvmlInit():
            if not fake.driver:
                raise err(_real.NVML_ERROR_LIBRARY_NOT_FOUND)

        @logged
        def nvmlShutdown():
            pass

        @logged
        def nvmlDeviceGetCount():
            return len(fake.gpus)

        @logged
        def nvmlDeviceGetHandleByIndex(i):
            if not 0 <= i < len(fake.gpus):
                raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
            return i

        @logged
        def nvmlDeviceGetHandleByUUID(uuid):
            for i, g in enumerate(fake.gpus):
                if g.uuid == uuid:
                    return i
            raise err(_real.NVML_ERROR_NOT_FOUND)

        @logged
        def nvmlDeviceGetName(h):
            return gpu(h).name

        @logged
        def nvmlDeviceGetUUID(h):
            return gpu(h).uuid

        @logged
        def nvmlDeviceGetSupportedMemoryClocks(h):
            return list(gpu(h).mem_clocks_mhz)

        @logged
        def nvmlDeviceGetSupportedGraphicsClocks(h, mem):
            if mem not in gpu(h).mem_clocks_mhz:
                raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
            return list(gpu(h).sm_clocks_mhz)

        @logged
        def nvmlDeviceGetPowerManagementLimitConstraints(h):
            return list(gpu(h).power_limit_constraints_mw)

        @logged
        def nvmlDeviceGetPowerManagementDefaultLimit(h):
            return gpu(h).power_limit_default_mw

        @logged
        def nvmlDeviceGetPowerManagementLimit(h):
            return gpu(h).power_limit_mw

        @logged
        def nvmlDeviceGetTotalEnergyConsumption(h):
            g = gpu(h)
            if not g.energy_counter:
                raise err(_real.NVML_ERROR_NOT_SUPPORTED)
            if g.realtime:
                now = time.monotonic()
                if g._last_real_s is not None:
                    g.advance(now - g._last_real_s)
                g._last_real_s = now
            return int(g.energy_mj)

        @logged
        def nvmlDeviceGetPowerUsage(h):
            g = gpu(h)
            if not g.power_reading:
                raise err(_real.NVML_ERROR_NOT_SUPPORTED)
            return int(round(g.power_w * 1000))  # mW, as NVML gives it

        @logged
        def nvmlDeviceGetClockInfo(h, which):
            g = gpu(h)
            if which == _real.NVML_CLOCK_MEM:
                return g.locked_mem_mhz or g.mem_clocks_mhz[-1]
            return g.locked_sm_mhz or g.applications_clocks_mhz[0]

        @logged
        def nvmlDeviceGetApplicationsClock(h, which):
            g = gpu(h)
            return g.applications_clocks_mhz[1] if which == _real.NVML_CLOCK_MEM else g.applications_clocks_mhz[0]

        @logged
        def nvmlDeviceSetGpuLockedClocks(h, lo, hi):
            need_root()
            if lo not in gpu(h).sm_clocks_mhz or hi not in gpu(h).sm_clocks_mhz:
                raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
            gpu(h).locked_sm_mhz = hi

        @logged
        def nvmlDeviceResetGpuLockedClocks(h):
            need_root()
            gpu(h).locked_sm_mhz = None

        @logged
        def nvmlDeviceSetMemoryLockedClocks(h, lo, hi):
            need_root()
            if not gpu(h).memory_locks_at_run_time():
                raise err(_real.NVML_ERROR_NOT_SUPPORTED)
            if hi not in gpu(h).mem_clocks_mhz:
                raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
            gpu(h).locked_mem_mhz = hi

        @logged
        def nvmlDeviceResetMemoryLockedClocks(h):
            need_root()
            if not gpu(h).memory_locks_at_run_time():
                raise err(_real.NVML_ERROR_NOT_SUPPORTED)
            gpu(h).locked_mem_mhz = None

        @logged
        def nvmlDeviceSetPowerManagementLimit(h, mw):
            need_root()
            lo, hi = gpu(h).power_limit_constraints_mw
            if not lo <= mw <= hi:
                raise err(_real.NVML_ERROR_INVALID_ARGUMENT)
            gpu(h).power_limit_mw = mw

        @logged
        def nvmlDeviceSetApplicationsClocks(h, mem, sm):
            need_root()
            gpu(h).applications_clocks_mhz = (sm, mem)

        @logged
        def nvmlDeviceResetApplicationsClocks(h):
            need_root()
            gpu(h).applications_clocks_mhz = (gpu(h).sm_clocks_mhz[0], gpu(h).mem_clocks_mhz[-1])

        return m
