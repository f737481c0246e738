"""Measurement windows around any code, as Zeus's ZeusMonitor offers them: ``begin_window(name)`` and
``end_window(name)`` (or ``with monitor.window(name)``) give the window's time and energy, per GPU through NVML and,
where the host exposes it, per CPU package and its DRAM through RAPL; ``measure_command`` wraps a whole command.

Sources:
    GPU energy: NVML's ``nvmlDeviceGetTotalEnergyConsumption`` (NVML API reference, Device Queries): the energy the
    GPU used since the driver was last loaded, in mJ, on Volta and newer GPUs; read through freqopt.gpu.nvml (the
    device opened read-only, so no set call can reach NVML). The counter moves at the driver's update period, not
    continuously: every 20-100 ms on recent GPUs (PETSc's PetscLogGpuEnergyMeter documentation; Zeus added
    ``approx_instant_energy`` in v0.6.1 because windows shorter than it read 0 J): a window much shorter than that
    may read 0 J.
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

__all__ = ["EnergyMonitor", "WindowMeasurement", "MeasurementWindow", "CommandMeasurement", "RAPLWarning",
           "measure_command", "parse_gpu_indices", "POWERCAP_ROOT", "RAPL_POLL_S"]  # fmt: skip

POWERCAP_ROOT = "/sys/class/powercap"
# How often RAPL counters are read while a window is open, s: far within the time an Intel package's counter takes
# to wrap (max_energy_range_uj, about 262 kJ, over 500 s even at 500 W), so no wrap goes unseen.
RAPL_POLL_S = 10.0

_ZONE = re.compile(r"intel-rapl:(\d+)")
_SUBZONE = re.compile(r"intel-rapl:(\d+):(\d+)")
_PACKAGE = re.compile(r"package-(\d+)(?:-die-\d+)?")


class RAPLWarning(UserWarning):
    """CPU and DRAM energy cannot be measured here (no RAPL zones, or ``energy_uj`` readable by root only); the
    message says why and what to do. Emitted once, when an EnergyMonitor with ``cpu="auto"`` is made."""


@dataclass(frozen=True)
class WindowMeasurement:
    """What one measurement window took.

    Attributes:
        name: the window's name.
        time_s: wall-clock time from begin to end (time.monotonic), s.
        gpu_energy_j: GPU index (the monitor's gpu_indices) -> energy, J (NVML's counter: mJ resolution, updated
            every tens of ms). Empty when no GPU was measured.
        cpu_energy_j: CPU package -> energy of the package (cores, caches, uncore), J (RAPL ``package-P``
            zones); None where RAPL is not readable or was not asked for.
        dram_energy_j: CPU package -> energy of the DRAM attached to it, J (RAPL ``dram`` subzones); None where
            RAPL reports no DRAM domain (AMD, most desktop CPUs) or is not read.
    """

    name: str
    time_s: float
    gpu_energy_j: dict[int, float]
    cpu_energy_j: dict[int, float] | None = None
    dram_energy_j: dict[int, float] | None = None

    @property
    def total_energy_j(self) -> float:
        """GPU, CPU-package and DRAM energy summed, J (the parts measured; DRAM is not inside a package's zone)."""
        parts = [self.gpu_energy_j, self.cpu_energy_j or {}, self.dram_energy_j or {}]
        return float(sum(sum(p.values()) for p in parts))

    def summary(self) -> dict:
        """The measurement as JSON-ready values: {"name", "time_s", "gpu_energy_j", "cpu_energy_j",
        "dram_energy_j", "total_energy_j"}, per-device figures keyed by the index as text."""

        def keyed(values):
            return None if values is None else {str(k): v for k, v in values.items()}

        return {"name": self.name, "time_s": self.time_s, "gpu_energy_j": keyed(self.gpu_energy_j),
                "cpu_energy_j": keyed(self.cpu_energy_j), "dram_energy_j": keyed(self.dram_energy_j),
                "total_energy_j": self.total_energy_j}  # fmt: skip


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


class EnergyMonitor:
    """Measurement windows over GPU energy (NVML), CPU-package and DRAM energy (RAPL) and time.

    Windows are named; any number may be open at once, nested or overlapping, each measured as if it were alone
    (as ZeusMonitor's). The monitor only reads: the GPUs are opened read-only (freqopt.gpu.nvml refuses every set
    call before it reaches NVML).

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
        sync: called before every reading (at each begin and end), e.g. ``torch.cuda.synchronize``, so that the
            GPU work launched in a window is finished when it ends; None: nothing is called.
        rapl_poll_s: while a window is open, RAPL counters are also read in a background thread at least this
            often, s, so that a counter wrap between a window's begin and end is not missed; None: only at begin
            and end (windows shorter than the counter's wrap time, minutes, only).

    Attributes:
        gpu_indices: the GPUs measured (tuple of indices); gpu_names: index -> the GPU's NVML name.
        rapl_unavailable: why CPU and DRAM energy are None (one line), or None where RAPL is read.

    Raises:
        InvalidSettingError: bad gpu_indices (argument ``gpu_indices``: not indices, or a GPU not visible), a bad
            ``cpu`` value, ``cpu=True`` where RAPL cannot be read, or a non-positive rapl_poll_s.
        NVMLError: GPUs asked for (gpu_indices None or not empty) but NVML is missing or fails, or a GPU has no
            energy counter (before Volta); the message (about ``gpu_indices``) says to ask for no GPU to measure
            time and CPU energy only.
    """

    def __init__(self, gpu_indices: Sequence[int] | str | None = None, *, cpu: bool | str = "auto",
                 powercap_root: str | Path | None = None, sync: Callable[[], object] | None = None,
                 rapl_poll_s: float | None = RAPL_POLL_S):  # fmt: skip
        if cpu not in (True, False, "auto"):
            raise InvalidSettingError(f"cpu must be True, False or 'auto', not {cpu!r}", argument="cpu")
        if rapl_poll_s is not None and not rapl_poll_s > 0:
            raise InvalidSettingError(f"rapl_poll_s must be positive (seconds) or None, not {rapl_poll_s!r}",
                                      argument="rapl_poll_s")  # fmt: skip
        wanted = parse_gpu_indices(gpu_indices)
        self.sync, self.rapl_poll_s = sync, rapl_poll_s
        self._devices = self._open_gpus(wanted)
        self.gpu_indices: tuple[int, ...] = tuple(self._devices)
        self.gpu_names: dict[int, str] = {i: d.name for i, d in self._devices.items()}
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
        self._lock = threading.Lock()
        self._poll_stop: threading.Event | None = None
        self._poll_thread: threading.Thread | None = None

    @staticmethod
    def _open_gpus(wanted: list[int] | None) -> dict:
        if wanted == []:
            return {}
        try:
            devices = open_devices(read_only=True)
        except NVMLError as e:
            cause = e.__cause__ if e.__cause__ is not None and not isinstance(e.__cause__, ImportError) else e
            raise NVMLError(f"gpu_indices: GPU energy needs NVML, which fails here ({cause}); ask for no GPU (an "
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
        for i, device in chosen.items():
            try:
                device.energy_j()
            except NVMLNotSupportedError as e:
                raise NVMLError(f"gpu_indices: GPU {i} ({device.name}) has no energy counter "
                                "(nvmlDeviceGetTotalEnergyConsumption needs Volta or newer); leave it out",
                                argument="gpu_indices") from e  # fmt: skip
        return chosen

    # -- readings -------------------------------------------------------------------------------------------------
    def _read(self) -> _Reading:
        if self.sync is not None:
            self.sync()
        now = time.monotonic()
        gpu = {i: d.energy_j() for i, d in self._devices.items()}
        cpu = dram = None
        if self._rapl is not None:
            with self._lock:
                cpu, dram = self._rapl.read()
        return _Reading(now, gpu, cpu, dram)

    def _poll(self, stop: threading.Event) -> None:
        while not stop.wait(self.rapl_poll_s):
            with self._lock, contextlib.suppress(OSError, ValueError):  # a failing read fails at the window's end
                self._rapl.read()  # only to keep each zone's wrap count right

    def _start_polling(self) -> None:
        if self._rapl is None or self.rapl_poll_s is None or self._poll_thread is not None:
            return
        self._poll_stop = threading.Event()
        self._poll_thread = threading.Thread(target=self._poll, args=(self._poll_stop,), daemon=True,
                                             name="freqopt-rapl-poll")  # fmt: skip
        self._poll_thread.start()

    def _stop_polling(self) -> None:
        if self._poll_thread is not None:
            self._poll_stop.set()
            self._poll_thread.join()
            self._poll_thread = self._poll_stop = None

    # -- windows --------------------------------------------------------------------------------------------------
    @property
    def open_windows(self) -> tuple[str, ...]:
        """The names of the windows begun and not yet ended, in the order they began."""
        return tuple(self._open)

    def begin_window(self, name: str) -> None:
        """Begin the measurement window ``name`` (reads every counter now).

        Raises:
            InvalidSettingError: a window of that name is already open (argument ``name``).
        """
        if name in self._open:
            raise InvalidSettingError(f"name {name!r} is already an open window; end it first, or give this one "
                                      "another name", argument="name")  # fmt: skip
        self._open[name] = self._read()
        self._start_polling()

    def end_window(self, name: str) -> WindowMeasurement:
        """End the measurement window ``name`` and return what it took.

        Raises:
            InvalidSettingError: no window of that name is open (never begun, or already ended; argument ``name``).
        """
        if name not in self._open:
            state = f"open: {', '.join(map(repr, self._open))}" if self._open else "no window is open"
            raise InvalidSettingError(f"name {name!r} is not an open window ({state}); begin_window({name!r}) "
                                      "first", argument="name")  # fmt: skip
        end = self._read()
        begin = self._open.pop(name)
        if not self._open:
            self._stop_polling()
        return WindowMeasurement(name=name, time_s=end.time_s - begin.time_s,
                                 gpu_energy_j={i: end.gpu_j[i] - begin.gpu_j[i] for i in end.gpu_j},
                                 cpu_energy_j=_difference(end.cpu_uj, begin.cpu_uj, 1e-6),
                                 dram_energy_j=_difference(end.dram_uj, begin.dram_uj, 1e-6))  # fmt: skip

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
            handle.result = self.end_window(name)


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
        gpu_names: GPU index -> its NVML name.
        rapl_unavailable: why CPU and DRAM energy are None (None where they were measured).
    """

    command: tuple[str, ...]
    returncode: int
    measurement: WindowMeasurement
    interrupted: tuple[int, ...] = ()
    gpu_names: dict[int, str] = field(default_factory=dict)
    rapl_unavailable: str | None = None

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
                    cpu: bool | str = "auto", powercap_root: str | Path | None = None) -> CommandMeasurement:
    """Run ``command`` (a program and its arguments, no shell) in one measurement window and wait for it.

    SIGINT, SIGTERM and SIGHUP sent to this process are passed on to the command (a Ctrl-C the terminal already
    sent to the command is not sent twice), and the window still ends when the command does: an interrupted run is
    measured and reported, with the command's own exit status.

    Args:
        command: the program and its arguments, e.g. ``["python", "train.py"]``.
        gpu_indices, cpu: as EnergyMonitor's.
        powercap_root: as EnergyMonitor's.

    Raises:
        InvalidSettingError: an empty command, or a program that is not found or cannot be run (argument
            ``command``); bad gpu_indices or cpu as EnergyMonitor.
        NVMLError: as EnergyMonitor.
    """
    argv = check_command(command)
    monitor = EnergyMonitor(gpu_indices, cpu=cpu, powercap_root=powercap_root)
    monitor.begin_window("command")
    try:
        run = run_command(argv)
    finally:
        measurement = monitor.end_window("command")
    return CommandMeasurement(tuple(argv), run.returncode, measurement, run.received, dict(monitor.gpu_names),
                              monitor.rapl_unavailable)  # fmt: skip
