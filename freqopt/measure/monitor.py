"""Measurement windows around any code, as Zeus's ZeusMonitor offers them: ``begin_window(name)`` and
``end_window(name)`` (or ``with monitor.window(name)``) give the window's time and energy, per GPU through NVML and,
where the host exposes it, per CPU package and its DRAM through RAPL; ``measure_command`` wraps a whole command.

What each figure covers: a GPU's figure is its whole board (its memory included) over every process that uses
it, and a GPU that sits idle through the window still draws its idle power; a CPU package's figure is the whole
socket over every process on the host, and DRAM's the memory attached to it. None is the energy of one program
alone.

Sources:
    GPU energy: NVML's ``nvmlDeviceGetTotalEnergyConsumption`` (NVML API reference, Device Queries): the energy the
    GPU used since the driver was last loaded, in mJ, on Volta and newer GPUs; read through freqopt.gpu.nvml (the
    device opened read-only, so no set call can reach NVML). The counter moves at the driver's update period, not
    continuously: every 20-100 ms on recent GPUs (PETSc's PetscLogGpuEnergyMeter documentation; Zeus added
    ``approx_instant_energy`` in v0.6.1 because windows shorter than it read 0 J). The period per GPU type is the
    ``energy_counter_period_ms`` of the search_spaces/ file that lists the GPU's NVML name (100 ms measured on the
    H100 and H200; 20 ms on the V100, Yang et al. 2024, arXiv 2312.02741), else DEFAULT_COUNTER_PERIOD_S, 100 ms,
    assumed as the A100's. A window shorter than its GPU's period is estimated as power x time instead
    (``nvmlDeviceGetPowerUsage`` at the window's end), with a ShortWindowWarning.
    GPUs without the counter (before Volta, and boards where NVML does not support it): the board's power
    (``nvmlDeviceGetPowerUsage``, mW) sampled by a background thread every POWER_SAMPLE_PERIOD_S, 0.1 s, while a
    window is open, and at each window's begin and end, integrated by the trapezoid rule. NVML's reference says the
    reading is instantaneous on GA100 and older GPUs and a 1 s average on other Ampere and newer ones; 0.1 s is
    the counter's own 100 ms period on A100-class GPUs and a tenth of that 1 s average.
    Synchronization: with ``sync=True`` (the default) and PyTorch's CUDA available, ``torch.cuda.synchronize(i)``
    for each monitored GPU before every reading, so that the work a window queued lands in that window.
    CPU and DRAM energy: Linux's power capping framework (kernel documentation, Documentation/power/powercap/
    powercap.rst), the RAPL zones under /sys/class/powercap: ``intel-rapl:N`` named ``package-P`` (or
    ``package-P-die-D`` on CPUs with several dies a package, summed into package P) and their subzones
    ``intel-rapl:N:M`` named ``dram``; ``core``, ``uncore`` and ``psys`` zones are parts of, or beyond, the
    package and are not read. AMD CPUs that Linux's RAPL driver supports appear under the same ``intel-rapl``
    names (package zones only: they report no DRAM domain). Each zone's ``energy_uj`` counts µJ and wraps to 0
    after ``max_energy_range_uj``; the monitor reads every zone at least every ``rapl_poll_s`` while a window is
    open, so it sees every wrap (an Intel package zone reports 262,143,328,850 µJ, about 262 kJ: over 8 minutes
    even at 500 W).
    Since Linux 5.10 (and the stable kernels patched for CVE-2020-8694, "Platypus") ``energy_uj`` is readable by
    root only; there the CPU and DRAM figures are None and a RAPLWarning says how to open them up.
    AMD GPUs (``backend="amdsmi"``): AMD SMI's ``amdsmi_get_energy_count`` (``energy_accumulator`` x
    ``counter_resolution``, uJ) through freqopt.gpu.amdsmi, opened read-only, and ``amdsmi_get_power_info``'s socket
    power where a GPU has no counter; the period is the ``energy_counter_period_ms`` of the file that lists the GPU's
    AMD SMI market name (``amdsmi_names``). An MI250X's second die reports neither (its first reports the
    package's) and is refused: measure the first alone.
    Time: ``time.monotonic()``.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from freqopt.command import check_command, exit_status, run_command
from freqopt.errors import InvalidSettingError
from freqopt.gpu.nvml import NVMLError, NVMLNotSupportedError, open_devices, parse_gpu_indices

# The GPU libraries a monitor reads, and per library its energy counter's and power reading's call (for messages).
GPU_LIBRARIES = {"nvml": ("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPowerUsage"),
                 "amdsmi": ("amdsmi_get_energy_count", "amdsmi_get_power_info")}

__all__ = ["EnergyMonitor", "WindowMeasurement", "MeasurementWindow", "CommandMeasurement", "RAPLWarning",
           "ShortWindowWarning", "measure_command", "parse_gpu_indices", "counter_period_s", "POWERCAP_ROOT",
           "RAPL_POLL_S", "POWER_SAMPLE_PERIOD_S", "DEFAULT_COUNTER_PERIOD_S", "COUNTER", "POWER_SAMPLES",
           "POWER_X_TIME", "COVERS"]  # fmt: skip

POWERCAP_ROOT = "/sys/class/powercap"
# How often RAPL counters are read while a window is open, s: far within the time an Intel package's counter takes
# to wrap (max_energy_range_uj, about 262 kJ, over 500 s even at 500 W), so no wrap goes unseen.
RAPL_POLL_S = 10.0
# How often a GPU without an energy counter has its power (nvmlDeviceGetPowerUsage) sampled while a window is open,
# s: the counter's own 100 ms period on A100-class GPUs, and a tenth of the 1 s over which NVML averages the reading
# on Ampere and newer GPUs other than GA100 (NVML API reference, nvmlDeviceGetPowerUsage).
POWER_SAMPLE_PERIOD_S = 0.1
# The energy counter's update period where no search_spaces/ file lists the GPU's NVML name, s: assumed as the
# A100's (Yang et al. 2024, arXiv 2312.02741: about every 100 ms; the H100 and H200 measured the same).
DEFAULT_COUNTER_PERIOD_S = 0.1

# How a GPU's energy in a window was found (WindowMeasurement.gpu_energy_source).
COUNTER = "energy counter"  # nvmlDeviceGetTotalEnergyConsumption, end minus begin
POWER_SAMPLES = "power samples"  # nvmlDeviceGetPowerUsage every POWER_SAMPLE_PERIOD_S, trapezoid rule
POWER_X_TIME = "power x time"  # window shorter than the counter's period: power at the end x the window's time

# What each kind of figure covers, in the user's words (WindowMeasurement.summary, the CLI's table).
COVERS = {
    "gpu": "each GPU's whole board (its memory included), over every process on it; an idle GPU still draws power",
    "cpu": "each CPU package whole (cores, caches, uncore), over every process on the host",
    "dram": "the DRAM attached to each CPU package, over every process on the host",
    "total": "the GPUs, CPU packages and DRAM measured, added: every process on those devices, not one program",
}

_ZONE = re.compile(r"intel-rapl:(\d+)")
_SUBZONE = re.compile(r"intel-rapl:(\d+):(\d+)")
_PACKAGE = re.compile(r"package-(\d+)(?:-die-\d+)?")


class RAPLWarning(UserWarning):
    """CPU and DRAM energy cannot be measured here (no RAPL zones, or ``energy_uj`` readable by root only); the
    message says why and what to do. Emitted once, when an EnergyMonitor with ``cpu="auto"`` is made."""


class ShortWindowWarning(UserWarning):
    """A window ended before its GPU's energy counter could move reliably (shorter than the counter's update
    period): that GPU's energy is estimated as power x time, and the message says so and what to do. Emitted by
    ``EnergyMonitor.end_window``."""


def counter_period_s(gpu_name: str) -> float:
    """The update period of the energy counter on a GPU of this NVML name or AMD SMI market name, s: the
    ``energy_counter_period_ms`` of the search_spaces/ file whose ``nvml_names`` or ``amdsmi_names`` list it, else
    DEFAULT_COUNTER_PERIOD_S (0.1 s, assumed as the A100's)."""
    from freqopt.errors import FreqoptError
    from freqopt.gpu.specs import get_gpu, list_gpus

    try:
        for type_name in list_gpus():
            spec = get_gpu(type_name)
            if gpu_name in spec.nvml_names or gpu_name in spec.amdsmi_names:
                return spec.energy_counter_period_s
    except (FreqoptError, OSError, ValueError):  # an unreadable GPU file: the assumed figure
        pass
    return DEFAULT_COUNTER_PERIOD_S


@dataclass(frozen=True)
class WindowMeasurement:
    """What one measurement window took.

    Attributes:
        name: the window's name.
        time_s: wall-clock time from begin to end (time.monotonic), s.
        gpu_energy_j: GPU index (the monitor's gpu_indices) -> energy of the whole board, J, over every process
            on it (COVERS["gpu"]); how each was found is in gpu_energy_source. Empty when no GPU was measured.
        cpu_energy_j: CPU package -> energy of the whole package (cores, caches, uncore), J, over every process on
            the host (RAPL ``package-P`` zones); None where RAPL is not readable or was not asked for.
        dram_energy_j: CPU package -> energy of the DRAM attached to it, J, over every process on the host (RAPL
            ``dram`` subzones); None where RAPL reports no DRAM domain (AMD, most desktop CPUs) or is not read.
        gpu_energy_source: GPU index -> how its energy was found: COUNTER ("energy counter", NVML's counter, mJ
            resolution), POWER_SAMPLES ("power samples": no counter on this GPU, power integrated) or
            POWER_X_TIME ("power x time": the window was shorter than the counter's update period).
    """

    name: str
    time_s: float
    gpu_energy_j: dict[int, float]
    cpu_energy_j: dict[int, float] | None = None
    dram_energy_j: dict[int, float] | None = None
    gpu_energy_source: dict[int, str] = field(default_factory=dict)

    @property
    def gpu_total_energy_j(self) -> float:
        """Every measured GPU's energy added, J (0.0 when no GPU was measured; idle GPUs included)."""
        return float(sum(self.gpu_energy_j.values()))

    @property
    def cpu_total_energy_j(self) -> float | None:
        """Every CPU package's energy added, J (whole sockets, every process); None where not measured."""
        return None if self.cpu_energy_j is None else float(sum(self.cpu_energy_j.values()))

    @property
    def dram_total_energy_j(self) -> float | None:
        """Every package's DRAM energy added, J; None where not measured."""
        return None if self.dram_energy_j is None else float(sum(self.dram_energy_j.values()))

    @property
    def total_energy_j(self) -> float:
        """GPU, CPU-package and DRAM energy added, J: the parts measured (DRAM is not inside a package's zone), each
        a whole device over every process on it (COVERS["total"]); gpu_total_energy_j, cpu_total_energy_j and
        dram_total_energy_j give them apart."""
        return self.gpu_total_energy_j + (self.cpu_total_energy_j or 0.0) + (self.dram_total_energy_j or 0.0)

    def summary(self) -> dict:
        """The measurement as JSON-ready values: {"name", "time_s", "gpu_energy_j", "gpu_energy_source",
        "cpu_energy_j", "dram_energy_j", "gpu_total_energy_j", "cpu_total_energy_j", "dram_total_energy_j",
        "total_energy_j", "covers"}, per-device figures keyed by the index as text; "covers" is COVERS, what each
        kind of figure includes."""

        def keyed(values):
            return None if values is None else {str(k): v for k, v in values.items()}

        return {"name": self.name, "time_s": self.time_s, "gpu_energy_j": keyed(self.gpu_energy_j),
                "gpu_energy_source": keyed(self.gpu_energy_source), "cpu_energy_j": keyed(self.cpu_energy_j),
                "dram_energy_j": keyed(self.dram_energy_j), "gpu_total_energy_j": self.gpu_total_energy_j,
                "cpu_total_energy_j": self.cpu_total_energy_j, "dram_total_energy_j": self.dram_total_energy_j,
                "total_energy_j": self.total_energy_j, "covers": dict(COVERS)}  # fmt: skip


@dataclass
class MeasurementWindow:
    """The handle ``EnergyMonitor.window(name)`` yields; ``result`` is filled when the ``with`` block ends (also
    when it ends by an exception).

    Attributes:
        name: the window's name.
        result: the WindowMeasurement, or None while the window is open.
    """

    name: str
    result: WindowMeasurement | None = None


# -- RAPL through /sys/class/powercap -------------------------------------------------------------------------------
class _RAPLUnavailable(Exception):
    """Why RAPL cannot be read here (the message, one line, says what to do)."""


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def _chmod_hint(root: Path) -> str:
    return (f"run as root, or let users read the counters (until the next reboot): sudo chmod o+r "
            f"{root}/intel-rapl:*/energy_uj {root}/intel-rapl:*/intel-rapl:*/energy_uj")


class _Zone:
    """One RAPL zone's counter, unwrapped: ``read()`` returns the µJ counted since the zone was opened."""

    def __init__(self, path: Path, package: int):
        self.path, self.package = path, package
        self.max_range_uj = _read_int(path / "max_energy_range_uj")
        self.last_uj = _read_int(path / "energy_uj")
        self.total_uj = 0

    def read(self) -> int:
        now = _read_int(self.path / "energy_uj")
        # The counter wraps to 0 past max_energy_range_uj (powercap.rst); the monitor reads often enough that at
        # most one wrap lies between two reads.
        self.total_uj += now - self.last_uj if now >= self.last_uj else now + self.max_range_uj - self.last_uj
        self.last_uj = now
        return self.total_uj


class _RAPL:
    """The package and DRAM zones under a powercap root.

    Raises:
        _RAPLUnavailable: no package zone, or a counter that cannot be read (the message says why and what to do).
    """

    def __init__(self, root: Path):
        if not root.is_dir():
            raise _RAPLUnavailable(f"{root} does not exist: this host exposes no RAPL counters (not Linux, or a "
                                   "virtual machine or container without them)")  # fmt: skip
        self.packages: list[_Zone] = []
        self.dram: list[_Zone] = []
        try:
            for zone in sorted(p for p in root.iterdir() if _ZONE.fullmatch(p.name)):
                match = _PACKAGE.fullmatch(zone.joinpath("name").read_text().strip())
                if match is None:
                    continue  # psys (the platform), not a package
                package = int(match.group(1))
                self.packages.append(_Zone(zone, package))
                for sub in sorted(p for p in zone.iterdir() if _SUBZONE.fullmatch(p.name)):
                    if sub.joinpath("name").read_text().strip() == "dram":  # core and uncore lie inside the package
                        self.dram.append(_Zone(sub, package))
        except PermissionError as e:
            raise _RAPLUnavailable(f"{e.filename or root} is readable by root only (Linux restricts RAPL counters "
                                   f"since CVE-2020-8694); {_chmod_hint(root)}") from e  # fmt: skip
        except (OSError, ValueError) as e:
            raise _RAPLUnavailable(f"the RAPL zones under {root} cannot be read ({e})") from e
        if not self.packages:
            raise _RAPLUnavailable(f"{root} holds no RAPL package zone (intel-rapl:N named package-N); load the "
                                   "driver with `sudo modprobe intel_rapl_msr` where the CPU has RAPL")  # fmt: skip

    def read(self) -> tuple[dict[int, int], dict[int, int] | None]:
        """(package -> µJ, package -> DRAM µJ or None where no DRAM zone), each since the zones were opened."""
        cpu: dict[int, int] = {}
        for zone in self.packages:
            cpu[zone.package] = cpu.get(zone.package, 0) + zone.read()
        if not self.dram:
            return cpu, None
        dram: dict[int, int] = {}
        for zone in self.dram:
            dram[zone.package] = dram.get(zone.package, 0) + zone.read()
        return cpu, dram


@dataclass(frozen=True)
class _Reading:
    time_s: float
    gpu_j: dict[int, float]
    cpu_uj: dict[int, int] | None
    dram_uj: dict[int, int] | None


def _difference(end: dict | None, begin: dict | None, scale: float) -> dict | None:
    if end is None or begin is None:
        return None
    return {k: (end[k] - begin[k]) * scale for k in end}


class _PowerIntegral:
    """A GPU's energy from its power samples: ``read(now)`` samples the power and adds the trapezoid since the last
    sample, returning the J since it was made; end minus begin of two reads is the window's energy."""

    def __init__(self, device, now_s: float):
        self.device = device
        self.last_s, self.last_w = now_s, device.power_w()
        self.total_j = 0.0

    def read(self, now_s: float) -> float:
        power_w = self.device.power_w()
        self.total_j += 0.5 * (self.last_w + power_w) * (now_s - self.last_s)
        self.last_s, self.last_w = now_s, power_w
        return self.total_j


def _cuda_sync(indices: tuple[int, ...]) -> Callable[[], None] | None:
    """``torch.cuda.synchronize(i)`` for each of ``indices``, or None where PyTorch or its CUDA is missing."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def sync() -> None:
        if not torch.cuda.is_initialized():
            return  # this process has queued no GPU work; synchronizing would only make CUDA contexts
        count = torch.cuda.device_count()
        for i in indices:
            if i < count:
                torch.cuda.synchronize(i)

    return sync


class EnergyMonitor:
    """Measurement windows over GPU energy (NVML or AMD SMI), CPU-package and DRAM energy (RAPL) and time.

    Windows are named; any number may be open at once, nested or overlapping, each measured as if it were alone
    (as ZeusMonitor's). The monitor only reads: the GPUs are opened read-only (freqopt.gpu.nvml refuses every set
    call before it reaches NVML). Every figure is a whole device over every process on it (COVERS): a GPU that
    another job shares, or that sits idle, is in the figure all the same.

    A GPU's energy is its energy counter's difference (COUNTER); where the GPU has no counter (before Volta, or
    not supported) its power is sampled every ``power_sample_period_s`` while a window is open and integrated by
    the trapezoid rule (POWER_SAMPLES); a window shorter than the counter's update period is estimated as power
    x time, with a ShortWindowWarning (POWER_X_TIME).

        >>> monitor = EnergyMonitor(gpu_indices=[0])               # doctest: +SKIP
        >>> with monitor.window("step") as step:                   # doctest: +SKIP
        ...     train_one_step()
        >>> step.result.time_s, step.result.gpu_energy_j[0]        # doctest: +SKIP

    Args:
        gpu_indices: the GPUs to measure, by their index among the visible ones (CUDA_VISIBLE_DEVICES order, as
            freqopt.gpu.nvml.open_devices lists them): a sequence of ints or text "0,1"; None: every visible GPU;
            empty (or "none"): no GPU, time and CPU energy only, without NVML.
        cpu: "auto": CPU-package and DRAM energy where RAPL is readable, else None with a RAPLWarning; True: RAPL
            must be readable (else an error); False: not read.
        powercap_root: the folder of the powercap zones; None: POWERCAP_ROOT, /sys/class/powercap (looked up at
            each call: tests point it at a fake tree).
        sync: True (the default): before every reading (each begin and end), ``torch.cuda.synchronize(i)`` for
            each monitored GPU i, where PyTorch is installed, has CUDA, and this process has initialized it (a
            process that never touched CUDA has queued nothing), so the GPU work launched in a window is finished
            when it ends; CUDA must number the GPUs as NVML does (CUDA_DEVICE_ORDER=PCI_BUS_ID) for i to be the
            same GPU. False or None: no synchronization (queued work then lands in a later window). A callable:
            called instead, e.g. ``jax.effects_barrier``.
        rapl_poll_s: while a window is open, RAPL counters are also read in a background thread at least this
            often, s, so that a counter wrap between a window's begin and end is not missed; None: only at begin
            and end (windows shorter than the counter's wrap time, minutes, only).
        power_sample_period_s: how often a GPU without an energy counter has its power sampled while a window is
            open, s (POWER_SAMPLE_PERIOD_S, 0.1 s).
        energy_counter_period_s: the energy counter's update period, s, below which a window is estimated as
            power x time; None: per GPU, from its search_spaces/ file (counter_period_s), else 0.1 s assumed.
        backend: the GPUs' library: "nvml" (NVIDIA, the default) or "amdsmi" (AMD SMI: AMD GPUs, numbered in
            HIP_VISIBLE_DEVICES order, freqopt.gpu.amdsmi.visible_amd_devices).

    Attributes:
        gpu_indices: the GPUs measured (tuple of indices); gpu_names: index -> the GPU's NVML name.
        gpu_energy_sources: index -> COUNTER or POWER_SAMPLES, how that GPU's energy is read.
        counter_period_s: index -> the energy counter's update period, s (GPUs with a counter).
        sync: what is called before every reading, or None.
        rapl_unavailable: why CPU and DRAM energy are None (one line), or None where RAPL is read.

    Raises:
        InvalidSettingError: bad gpu_indices (argument ``gpu_indices``: not indices, or a GPU not visible), a bad
            ``cpu``, ``sync`` or ``backend`` value, ``cpu=True`` where RAPL cannot be read, or a non-positive rapl_poll_s,
            power_sample_period_s or energy_counter_period_s.
        NVMLError: GPUs asked for (gpu_indices None or not empty) but NVML (or AMD SMI: AMDSMIError, an NVMLError)
            is missing or fails, or a GPU has
            neither an energy counter nor a power reading; the message (about ``gpu_indices``) says to leave it
            out, or to ask for no GPU to measure time and CPU energy only.
    """

    def __init__(self, gpu_indices: Sequence[int] | str | None = None, *, cpu: bool | str = "auto",
                 powercap_root: str | Path | None = None, sync: bool | Callable[[], object] | None = True,
                 rapl_poll_s: float | None = RAPL_POLL_S, power_sample_period_s: float = POWER_SAMPLE_PERIOD_S,
                 energy_counter_period_s: float | None = None, backend: str = "nvml"):  # fmt: skip
        if backend not in GPU_LIBRARIES:
            raise InvalidSettingError(f"backend must be one of {', '.join(map(repr, GPU_LIBRARIES))} (the GPUs' "
                                      f"library), not {backend!r}", argument="backend")  # fmt: skip
        self.backend = backend
        if cpu not in (True, False, "auto"):
            raise InvalidSettingError(f"cpu must be True, False or 'auto', not {cpu!r}", argument="cpu")
        if not (sync is None or isinstance(sync, bool) or callable(sync)):
            raise InvalidSettingError(f"sync must be True, False or a callable, not {sync!r}", argument="sync")
        for argument, value, optional in (("rapl_poll_s", rapl_poll_s, True),
                                          ("power_sample_period_s", power_sample_period_s, False),
                                          ("energy_counter_period_s", energy_counter_period_s, True)):  # fmt: skip
            if (value is None and optional) or (isinstance(value, int | float) and value > 0):
                continue
            also = " or None" if optional else ""
            raise InvalidSettingError(f"{argument} must be positive (seconds){also}, not {value!r}",
                                      argument=argument)  # fmt: skip
        wanted = parse_gpu_indices(gpu_indices)
        self.rapl_poll_s, self.power_sample_period_s = rapl_poll_s, power_sample_period_s
        self._lock = threading.Lock()  # one reading at a time: the windows' and the background threads'
        self._devices, self.gpu_energy_sources = self._open_gpus(wanted, backend)
        self.gpu_indices: tuple[int, ...] = tuple(self._devices)
        self.gpu_names: dict[int, str] = {i: d.name for i, d in self._devices.items()}
        self.counter_period_s: dict[int, float] = {
            i: energy_counter_period_s or counter_period_s(d.name)
            for i, d in self._devices.items() if self.gpu_energy_sources[i] == COUNTER}  # fmt: skip
        self._integrals: dict[int, _PowerIntegral] = {}
        if sync is True:
            self.sync = _cuda_sync(self.gpu_indices) if self.gpu_indices else None
        else:
            self.sync = sync or None
        # Why CPU and DRAM energy are None; None where RAPL is read.
        self.rapl_unavailable: str | None = None
        self._rapl: _RAPL | None = None
        if cpu is False:
            self.rapl_unavailable = "not asked for (cpu=False)"
        else:
            try:
                self._rapl = _RAPL(Path(POWERCAP_ROOT if powercap_root is None else powercap_root))
            except _RAPLUnavailable as e:
                self.rapl_unavailable = str(e)
                if cpu is True:
                    raise InvalidSettingError(f"cpu=True, but CPU energy cannot be measured: {e}",
                                              argument="cpu") from None  # fmt: skip
                warnings.warn(f"CPU and DRAM energy are not measured: {e}", RAPLWarning, stacklevel=2)
        self._open: dict[str, _Reading] = {}
        self._threads: list[tuple[threading.Event, threading.Thread]] = []

    @staticmethod
    def _open_gpus(wanted: list[int] | None, backend: str = "nvml") -> tuple[dict, dict[int, str]]:
        if wanted == []:
            return {}, {}
        library = {"nvml": "NVML", "amdsmi": "AMD SMI"}[backend]
        counter_call, power_call = GPU_LIBRARIES[backend]
        try:
            if backend == "amdsmi":
                from freqopt.gpu.amdsmi import open_amd_devices

                devices = open_amd_devices(read_only=True)
            else:
                devices = open_devices(read_only=True)
        except NVMLError as e:
            cause = e.__cause__ if e.__cause__ is not None and not isinstance(e.__cause__, ImportError) else e
            raise NVMLError(f"gpu_indices: GPU energy needs {library}, which fails here ({cause}); ask for no GPU (an "
                            "empty list, or none) to measure time and CPU energy only",
                            argument="gpu_indices") from e  # fmt: skip
        if wanted is None:
            wanted = list(range(len(devices)))
        missing = [i for i in wanted if i >= len(devices)]
        if missing:
            raise InvalidSettingError(f"gpu_indices {missing[0]} is not a visible GPU: this process sees "
                                      f"{len(devices)} (indices 0 to {len(devices) - 1}, CUDA_VISIBLE_DEVICES order)",
                                      argument="gpu_indices")  # fmt: skip
        chosen = {i: devices[i] for i in wanted}
        sources: dict[int, str] = {}
        for i, device in chosen.items():
            try:
                device.energy_j()
                sources[i] = COUNTER
                continue
            except NVMLNotSupportedError:
                pass
            try:
                device.power_w()
            except NVMLNotSupportedError as e:
                raise NVMLError(f"gpu_indices: GPU {i} ({device.name}) has neither an energy counter "
                                f"({counter_call}) nor a power reading ({power_call}); leave it out",
                                argument="gpu_indices") from e  # fmt: skip
            sources[i] = POWER_SAMPLES
        return chosen, sources

    # -- readings -------------------------------------------------------------------------------------------------
    def _read(self) -> _Reading:
        if self.sync is not None:
            self.sync()
        with self._lock:
            now = time.monotonic()
            gpu = {}
            for i, device in self._devices.items():
                if self.gpu_energy_sources[i] == COUNTER:
                    gpu[i] = device.energy_j()
                else:
                    if i not in self._integrals:
                        self._integrals[i] = _PowerIntegral(device, now)
                    gpu[i] = self._integrals[i].read(now)
            cpu = dram = None
            if self._rapl is not None:
                cpu, dram = self._rapl.read()
        return _Reading(now, gpu, cpu, dram)

    def _poll_rapl(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # a failing read fails at the window's end
            self._rapl.read()  # only to keep each zone's wrap count right

    def _sample_power(self) -> None:
        now = time.monotonic()
        for integral in self._integrals.values():
            with contextlib.suppress(NVMLError):  # a failed sample: the next one spans the gap
                integral.read(now)

    def _every(self, period_s: float, task: Callable[[], None], stop: threading.Event) -> None:
        while not stop.wait(period_s):
            with self._lock:
                task()

    def _start_threads(self) -> None:
        if self._threads:
            return
        tasks = []
        if self._rapl is not None and self.rapl_poll_s is not None:
            tasks.append(("freqopt-rapl-poll", self.rapl_poll_s, self._poll_rapl))
        if POWER_SAMPLES in self.gpu_energy_sources.values():
            tasks.append(("freqopt-power-sample", self.power_sample_period_s, self._sample_power))
        for name, period_s, task in tasks:
            stop = threading.Event()
            thread = threading.Thread(target=self._every, args=(period_s, task, stop), daemon=True, name=name)
            thread.start()
            self._threads.append((stop, thread))

    def _stop_threads(self) -> None:
        for stop, _ in self._threads:
            stop.set()
        for _, thread in self._threads:
            thread.join()
        self._threads = []

    # -- windows --------------------------------------------------------------------------------------------------
    @property
    def open_windows(self) -> tuple[str, ...]:
        """The names of the windows begun and not yet ended, in the order they began."""
        return tuple(self._open)

    def begin_window(self, name: str) -> None:
        """Begin the measurement window ``name`` (synchronizes, then reads every counter now).

        Raises:
            InvalidSettingError: a window of that name is already open (argument ``name``).
        """
        if name in self._open:
            raise InvalidSettingError(f"name {name!r} is already an open window; end it first, or give this one "
                                      "another name", argument="name")  # fmt: skip
        self._open[name] = self._read()
        self._start_threads()

    def end_window(self, name: str) -> WindowMeasurement:
        """End the measurement window ``name`` (synchronizes, then reads every counter) and return what it took.

        A GPU whose energy counter's update period (counter_period_s) is longer than the window gets power x time
        instead of the counter's difference, which would read 0 J or a whole period's energy; a ShortWindowWarning
        says so. Where that GPU has no power reading either, its counter difference stays, and the warning says it
        may be 0 J.

        Raises:
            InvalidSettingError: no window of that name is open (never begun, or already ended; argument ``name``).
        """
        return self._end(name, stacklevel=3)

    def _end(self, name: str, *, stacklevel: int) -> WindowMeasurement:
        """end_window's work; ``stacklevel`` points a ShortWindowWarning at the caller's line."""
        if name not in self._open:
            state = f"open: {', '.join(map(repr, self._open))}" if self._open else "no window is open"
            raise InvalidSettingError(f"name {name!r} is not an open window ({state}); begin_window({name!r}) "
                                      "first", argument="name")  # fmt: skip
        end = self._read()
        begin = self._open.pop(name)
        if not self._open:
            self._stop_threads()
        time_s = end.time_s - begin.time_s
        gpu_j = {i: end.gpu_j[i] - begin.gpu_j[i] for i in end.gpu_j}
        source = dict(self.gpu_energy_sources)
        short = [i for i, period_s in self.counter_period_s.items() if time_s < period_s]
        if short:
            estimated, kept = [], []
            for i in short:
                try:
                    gpu_j[i] = self._devices[i].power_w() * time_s
                except NVMLNotSupportedError:
                    kept.append(i)
                    continue
                source[i] = POWER_X_TIME
                estimated.append(i)
            warnings.warn(_short_window_message(name, time_s, self.counter_period_s, estimated, kept,
                                                GPU_LIBRARIES[self.backend][1]),
                          ShortWindowWarning, stacklevel=stacklevel)  # fmt: skip
        return WindowMeasurement(name=name, time_s=time_s, gpu_energy_j=gpu_j,
                                 cpu_energy_j=_difference(end.cpu_uj, begin.cpu_uj, 1e-6),
                                 dram_energy_j=_difference(end.dram_uj, begin.dram_uj, 1e-6),
                                 gpu_energy_source=source)  # fmt: skip

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[MeasurementWindow]:
        """``with monitor.window(name) as w:`` measures the block; ``w.result`` is the WindowMeasurement after it
        (filled also when the block raises, whose exception then propagates).

        Raises:
            InvalidSettingError: a window of that name is already open.
        """
        handle = MeasurementWindow(name)
        self.begin_window(name)
        try:
            yield handle
        finally:
            handle.result = self._end(name, stacklevel=4)  # past contextlib's frame, to the with statement


def _short_window_message(name: str, time_s: float, period_s: dict[int, float], estimated: list[int],
                          kept: list[int], power_call: str = "nvmlDeviceGetPowerUsage") -> str:  # fmt: skip
    def gpus(indices):
        listed = ", ".join(f"{i} ({period_s[i] * 1e3:g} ms)" for i in indices)
        return f"GPU{'s' if len(indices) > 1 else ''} {listed}"

    parts = []
    if estimated:
        parts.append(f"{gpus(estimated)} estimated as power x time ({power_call} at the window's end)")
    if kept:
        parts.append(f"{gpus(kept)} kept the counter's difference, which may read 0 J (no power reading)")
    return (f"window {name!r} lasted {time_s * 1e3:.1f} ms, under the energy counter's update period: "
            f"{'; '.join(parts)}; measure many steps in one window for the counter's own figure")


# -- a whole command -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommandMeasurement:
    """A command run inside one measurement window.

    Attributes:
        command: the command and its arguments.
        returncode: the child's exit status as subprocess gives it (negative: killed by that signal).
        measurement: the window around it (named "command").
        interrupted: the signals (SIGINT, SIGTERM, SIGHUP numbers) that reached the monitoring process while the
            command ran; each was passed on to the command unless the terminal had already sent it there.
        gpu_names: GPU index -> its NVML name (or AMD SMI market name).
        rapl_unavailable: why CPU and DRAM energy are None (None where they were measured).
        backend: the GPUs' library, "nvml" or "amdsmi".
    """

    command: tuple[str, ...]
    returncode: int
    measurement: WindowMeasurement
    interrupted: tuple[int, ...] = ()
    gpu_names: dict[int, str] = field(default_factory=dict)
    rapl_unavailable: str | None = None
    backend: str = "nvml"

    @property
    def exit_code(self) -> int:
        """The exit status a shell would report: the child's, or 128 + N where signal N killed it."""
        return exit_status(self.returncode)

    def summary(self) -> dict:
        """{"command", "returncode", "exit_code", "interrupted", "gpu_names", "rapl_unavailable", and the
        measurement's summary (WindowMeasurement.summary)}."""
        return {"command": list(self.command), "returncode": self.returncode, "exit_code": self.exit_code,
                "interrupted": list(self.interrupted),
                "gpu_names": {str(k): v for k, v in self.gpu_names.items()},
                "rapl_unavailable": self.rapl_unavailable, **self.measurement.summary()}  # fmt: skip


def measure_command(command: Sequence[str], *, gpu_indices: Sequence[int] | str | None = None,
                    cpu: bool | str = "auto", powercap_root: str | Path | None = None,
                    backend: str = "nvml") -> CommandMeasurement:
    """Run ``command`` (a program and its arguments, no shell) in one measurement window and wait for it.

    SIGINT, SIGTERM and SIGHUP sent to this process are passed on to the command (a Ctrl-C the terminal already
    sent to the command is not sent twice), and the window still ends when the command does: an interrupted run is
    measured and reported, with the command's own exit status. The command runs in its own process, whose GPU
    work is finished when it exits, so the window is not synchronized (``sync=False``); a command shorter than a
    GPU's energy counter period is estimated as power x time, with a ShortWindowWarning.

    Args:
        command: the program and its arguments, e.g. ``["python", "train.py"]``.
        gpu_indices, cpu: as EnergyMonitor's.
        powercap_root, backend: as EnergyMonitor's.

    Raises:
        InvalidSettingError: an empty command, or a program that is not found or cannot be run (argument
            ``command``); bad gpu_indices, cpu or backend as EnergyMonitor.
        NVMLError: as EnergyMonitor.
    """
    argv = check_command(command)
    # The command's GPU work is its own process's, finished when it exits: nothing here to synchronize.
    monitor = EnergyMonitor(gpu_indices, cpu=cpu, powercap_root=powercap_root, sync=False, backend=backend)
    monitor.begin_window("command")
    try:
        run = run_command(argv)
    finally:
        measurement = monitor.end_window("command")
    return CommandMeasurement(tuple(argv), run.returncode, measurement, run.received, dict(monitor.gpu_names),
                              monitor.rapl_unavailable, backend)  # fmt: skip
