"""Real GPUs through NVML (nvidia-ml-py, ``import pynvml``): discovery, what a GPU supports, its energy counter, and
clock and power-limit changes that are always undone.

Every NVML call freqopt makes goes through ``NVMLDevice``. A device opened ``read_only`` refuses every set and
reset call before it reaches NVML, so a read-only run cannot change a shared GPU. Before the first change,
``GPUStateGuard`` records what it found (power limit, application clocks) in memory and in a small state file
written atomically; on normal exit, exception, SIGINT and SIGTERM it restores exactly those values, and after a
SIGKILL ``freqopt reset`` restores them from the file. NVML has no call that reads locked clocks, so a GPU whose
clocks someone else had locked cannot be returned to that lock: freqopt resets the locks it set (the driver's
default, unlocked state) and says so in its documentation.

NVML calls used (NVML API reference, r535+): nvmlInit, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
nvmlDeviceGetHandleByUUID, nvmlDeviceGetName, nvmlDeviceGetUUID, nvmlDeviceGetSupportedMemoryClocks,
nvmlDeviceGetSupportedGraphicsClocks, nvmlDeviceGetPowerManagementLimitConstraints,
nvmlDeviceGetPowerManagementDefaultLimit, nvmlDeviceGetPowerManagementLimit, nvmlDeviceGetTotalEnergyConsumption
(mJ since the driver loaded, Volta+), nvmlDeviceGetPowerUsage (board power, mW), nvmlDeviceGetClockInfo, nvmlDeviceGetApplicationsClock, and the set calls
nvmlDeviceSetGpuLockedClocks (Volta+), nvmlDeviceSetMemoryLockedClocks (Ampere+), their Reset calls,
nvmlDeviceSetPowerManagementLimit (mW) and nvmlDeviceSetApplicationsClocks, each of which needs root or
CAP_SYS_ADMIN. A call the GPU does not support raises NVMLNotSupportedError (NVML_ERROR_NOT_SUPPORTED): the memory-clock
lock before Ampere, and, as nvidia-smi reports it, on Hopper, whose memory clock locks only deferred to the GPU's next
initialisation (``nvidia-smi --lock-memory-clocks-deferred``; search_spaces/h100-sxm.toml, sources.mem_clock_lock).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from freqopt.errors import FreqoptError, GPUPermissionError, InvalidSettingError, UnknownNameError

__all__ = ["NVMLError", "NVMLNotSupportedError", "NVMLDevice", "GPUState", "GPUStateGuard", "open_devices", "state_dir", "reset_from_state_files",
           "parse_gpu_indices", "READ_ONLY_HINT", "DaemonSetCalls", "DaemonDevice", "device_count"]

READ_ONLY_HINT = "run as root or with CAP_SYS_ADMIN to change clocks, or measure read-only, at the current settings"


class NVMLError(FreqoptError):
    """NVML is missing or failed (no driver, no GPU, an unsupported call)."""


class NVMLNotSupportedError(NVMLError):
    """NVML says this GPU or driver does not support the call (NVML_ERROR_NOT_SUPPORTED; pynvml raises
    NVMLError_NotSupported), e.g. a run-time memory-clock lock on a GPU that locks it only per job."""


def _pynvml():
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NVMLError("nvidia-ml-py is not installed; pip install nvidia-ml-py") from e
    return pynvml


def _call(what: str, fn, *args):
    """Call an NVML function, mapping its errors to freqopt's: no permission, not supported, anything else."""
    pynvml = _pynvml()
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        code = getattr(e, "value", None)
        if code == pynvml.NVML_ERROR_NO_PERMISSION:
            raise GPUPermissionError(f"{what}: NVML says no permission; {READ_ONLY_HINT}") from e
        if code == pynvml.NVML_ERROR_NOT_SUPPORTED:
            raise NVMLNotSupportedError(f"{what}: this GPU or driver does not support it ({e})") from e
        if code in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
            raise NVMLError(f"{what}: no NVIDIA driver found ({e}); use backend sim (the simulated GPU) on a machine without a GPU") from e
        raise NVMLError(f"{what}: NVML error {e}") from e


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NVMLDevice:
    """One GPU seen through NVML.

    Args:
        handle: the NVML device handle.
        index: the position of the GPU among the visible ones (CUDA_VISIBLE_DEVICES order).
        read_only: refuse every set and reset call (raise, before calling NVML).
    """

    def __init__(self, handle, index: int, *, read_only: bool = False):
        self.handle, self.index, self.read_only = handle, index, read_only
        nv = _pynvml()
        self.name = _text(_call("nvmlDeviceGetName", nv.nvmlDeviceGetName, handle))
        self.uuid = _text(_call("nvmlDeviceGetUUID", nv.nvmlDeviceGetUUID, handle))

    # -- reads ---------------------------------------------------------------------------------------------------
    def supported_mem_clocks_mhz(self) -> tuple[int, ...]:
        nv = _pynvml()
        return tuple(sorted(_call("nvmlDeviceGetSupportedMemoryClocks", nv.nvmlDeviceGetSupportedMemoryClocks,
                                  self.handle)))  # fmt: skip

    def supported_sm_clocks_mhz(self, mem_clock_mhz: int) -> tuple[int, ...]:
        nv = _pynvml()
        return tuple(sorted(_call("nvmlDeviceGetSupportedGraphicsClocks", nv.nvmlDeviceGetSupportedGraphicsClocks,
                                  self.handle, mem_clock_mhz)))  # fmt: skip

    def power_limit_constraints_w(self) -> tuple[float, float]:
        nv = _pynvml()
        lo, hi = _call("nvmlDeviceGetPowerManagementLimitConstraints", nv.nvmlDeviceGetPowerManagementLimitConstraints,
                       self.handle)  # fmt: skip
        return lo / 1000.0, hi / 1000.0

    def power_limit_default_w(self) -> float:
        nv = _pynvml()
        return _call("nvmlDeviceGetPowerManagementDefaultLimit", nv.nvmlDeviceGetPowerManagementDefaultLimit,
                     self.handle) / 1000.0  # fmt: skip

    def power_limit_w(self) -> float:
        nv = _pynvml()
        return _call("nvmlDeviceGetPowerManagementLimit", nv.nvmlDeviceGetPowerManagementLimit, self.handle) / 1000.0

    def energy_j(self) -> float:
        """The cumulative energy counter, J (NVML counts mJ; converted here, once).

        Raises:
            NVMLNotSupportedError: the GPU has no energy counter (before Volta, and some boards since).
        """
        nv = _pynvml()
        return _call("nvmlDeviceGetTotalEnergyConsumption", nv.nvmlDeviceGetTotalEnergyConsumption, self.handle) / 1000.0

    def power_w(self) -> float:
        """The board's power draw, W (nvmlDeviceGetPowerUsage counts mW; converted here, once). NVML's reference: on
        GA100 and older GPUs the reading is instantaneous; on other Ampere and newer GPUs it is the average over the
        last second.

        Raises:
            NVMLNotSupportedError: the GPU has no power reading (power management not supported).
        """
        nv = _pynvml()
        return _call("nvmlDeviceGetPowerUsage", nv.nvmlDeviceGetPowerUsage, self.handle) / 1000.0

    def sm_clock_mhz(self) -> int:
        nv = _pynvml()
        return int(_call("nvmlDeviceGetClockInfo", nv.nvmlDeviceGetClockInfo, self.handle, nv.NVML_CLOCK_SM))

    def mem_clock_mhz(self) -> int:
        nv = _pynvml()
        return int(_call("nvmlDeviceGetClockInfo", nv.nvmlDeviceGetClockInfo, self.handle, nv.NVML_CLOCK_MEM))

    def applications_clocks_mhz(self) -> tuple[int, int] | None:
        """(SM, memory) application clocks, or None where the GPU does not have them."""
        nv = _pynvml()
        try:
            sm = _call("nvmlDeviceGetApplicationsClock", nv.nvmlDeviceGetApplicationsClock, self.handle,
                       nv.NVML_CLOCK_GRAPHICS)  # fmt: skip
            mem = _call("nvmlDeviceGetApplicationsClock", nv.nvmlDeviceGetApplicationsClock, self.handle,
                        nv.NVML_CLOCK_MEM)  # fmt: skip
        except NVMLError:
            return None
        return int(sm), int(mem)

    # -- changes -------------------------------------------------------------------------------------------------
    def _writable(self, what: str) -> None:
        if self.read_only:
            raise GPUPermissionError(f"{what} refused: GPU {self.index} ({self.name}) was opened read-only")

    def lock_sm_clock(self, sm_clock_mhz: int) -> None:
        """Lock the SM clock (nvmlDeviceSetGpuLockedClocks with min = max)."""
        self._writable("locking the SM clock")
        nv = _pynvml()
        _call("nvmlDeviceSetGpuLockedClocks", nv.nvmlDeviceSetGpuLockedClocks, self.handle, sm_clock_mhz, sm_clock_mhz)

    def reset_sm_clock(self) -> None:
        self._writable("resetting the SM clock")
        nv = _pynvml()
        _call("nvmlDeviceResetGpuLockedClocks", nv.nvmlDeviceResetGpuLockedClocks, self.handle)

    def lock_mem_clock(self, mem_clock_mhz: int) -> None:
        """Lock the memory clock (nvmlDeviceSetMemoryLockedClocks with min = max).

        Raises:
            NVMLNotSupportedError: the GPU cannot lock its memory clock while a job runs (before Ampere; Hopper,
                as nvidia-smi reports it: per job only, deferred).
        """
        self._writable("locking the memory clock")
        nv = _pynvml()
        _call("nvmlDeviceSetMemoryLockedClocks", nv.nvmlDeviceSetMemoryLockedClocks, self.handle, mem_clock_mhz,
              mem_clock_mhz)  # fmt: skip

    def reset_mem_clock(self) -> None:
        self._writable("resetting the memory clock")
        nv = _pynvml()
        _call("nvmlDeviceResetMemoryLockedClocks", nv.nvmlDeviceResetMemoryLockedClocks, self.handle)

    def set_power_limit_w(self, power_limit_w: float) -> None:
        """Set the power limit (nvmlDeviceSetPowerManagementLimit, mW)."""
        self._writable("setting the power limit")
        nv = _pynvml()
        _call("nvmlDeviceSetPowerManagementLimit", nv.nvmlDeviceSetPowerManagementLimit, self.handle,
              int(round(power_limit_w * 1000)))  # fmt: skip

    def set_applications_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int) -> None:
        self._writable("setting application clocks")
        nv = _pynvml()
        _call("nvmlDeviceSetApplicationsClocks", nv.nvmlDeviceSetApplicationsClocks, self.handle, mem_clock_mhz,
              sm_clock_mhz)  # fmt: skip

    def spec(self):
        """The GPUSpec of the search_spaces/ file whose nvml_names hold this GPU's name, with the clock lists and
        power-limit range read from the device (so ``mem_clock_runtime`` also needs more than one memory clock
        listed by the device; the file's ``mem_clock_lock`` is kept: freqopt.gpu.backends.nvml tries it).

        Raises:
            UnknownNameError: no GPU type in search_spaces/ has this NVML name; the message names it.
        """
        import dataclasses

        from freqopt.gpu.specs import get_gpu, list_gpus

        for name in list_gpus():
            spec = get_gpu(name)
            if self.name in spec.nvml_names:
                break
        else:
            raise UnknownNameError(
                f"GPU {self.index} is a {self.name!r}, which no file in search_spaces/ lists in nvml_names; add a "
                "TOML file for it (copy the nearest one and fill in its data sheet)"
            )
        mem = self.supported_mem_clocks_mhz() or spec.mem_clocks_mhz
        sm_by_mem = {m: self.supported_sm_clocks_mhz(m) for m in mem}
        sm = tuple(sorted(set().union(*sm_by_mem.values()))) or spec.sm_clocks_mhz
        limits = {m: max(v) for m, v in sm_by_mem.items() if v and max(v) < sm[-1]}
        lo, hi = self.power_limit_constraints_w()
        return dataclasses.replace(spec, sm_clocks_mhz=sm, mem_clocks_mhz=tuple(mem), max_sm_clock_for_mem_mhz=limits,
                                   power_limit_min_w=lo, power_limit_max_w=hi,
                                   power_limit_default_w=self.power_limit_default_w())  # fmt: skip


class DaemonSetCalls:
    """The set calls of a GPU device class routed to freqoptd (freqopt.daemon; ``client``:
    freqopt.gpu.daemon_client.DaemonClient) in place of the GPU library, its reads left to the library in this
    process, which needs no root for them. Mixed in before NVMLDevice (DaemonDevice) or AMD SMI's device
    (freqopt.gpu.amdsmi.AMDSMIDaemonDevice). The daemon's refusals are raised as the NVML layer's own errors, so
    callers need not know where a set call went: GPUPermissionError (the policy does not allow it, or another client
    holds the GPU, in the daemon's words), InvalidSettingError (a value the GPU does not support),
    NVMLNotSupportedError, NVMLError.

    Attributes:
        last_call: (queued_s, latency_s) of the last set call as the daemon timed it on the GPU's worker, or None.
    """

    via_daemon = True
    uuid: str

    def _attach(self, client) -> None:
        self.client = client
        self.last_call: tuple[float, float] | None = None

    def _request(self, message: dict) -> dict:
        from freqopt.errors import DaemonRefusedError

        try:
            return self.client.request(message)
        except DaemonRefusedError as e:
            error = {"policy": GPUPermissionError, "busy": GPUPermissionError, "invalid": InvalidSettingError,
                     "not_supported": NVMLNotSupportedError, "nvml": NVMLError}.get(e.kind)  # fmt: skip
            if error is None:
                raise
            raise error(str(e)) from e

    def _set(self, call: str, *args) -> None:
        reply = self._request({"op": "set", "gpu": self.uuid, "call": call, "args": list(args)})
        self.last_call = (float(reply.get("queued_s", 0.0)), float(reply.get("latency_s", 0.0)))

    def lock_sm_clock(self, sm_clock_mhz: int) -> None:
        self._set("lock_sm_clock", int(sm_clock_mhz))

    def reset_sm_clock(self) -> None:
        self._set("reset_sm_clock")

    def lock_mem_clock(self, mem_clock_mhz: int) -> None:
        self._set("lock_mem_clock", int(mem_clock_mhz))

    def reset_mem_clock(self) -> None:
        self._set("reset_mem_clock")

    def set_power_limit_w(self, power_limit_w: float) -> None:
        self._set("set_power_limit_w", float(power_limit_w))

    def set_applications_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int) -> None:
        self._set("set_applications_clocks", int(sm_clock_mhz), int(mem_clock_mhz))

    def release(self) -> None:
        """Ask the daemon to put this GPU back to what it found before this process's first change."""
        self._request({"op": "release", "gpu": self.uuid})


class DaemonDevice(DaemonSetCalls, NVMLDevice):
    """An NVIDIA GPU whose set calls go to freqoptd and whose reads go to NVML in this process (DaemonSetCalls;
    ``open_devices`` makes these where $FREQOPT_DAEMON is set)."""

    def __init__(self, handle, index: int, client):
        NVMLDevice.__init__(self, handle, index)
        self._attach(client)


def device_count() -> int:
    """How many GPUs NVML sees on the machine, whatever CUDA_VISIBLE_DEVICES says (nvmlDeviceGetCount).

    Raises:
        NVMLError: no driver.
    """
    nv = _pynvml()
    _call("nvmlInit", nv.nvmlInit)
    return int(_call("nvmlDeviceGetCount", nv.nvmlDeviceGetCount))


def open_devices(*, read_only: bool = False, visible: str | None = None, daemon: str | None = None) -> list[NVMLDevice]:
    """The GPUs this process may use, in CUDA_VISIBLE_DEVICES order (indices or GPU-/MIG- UUIDs); all GPUs when it
    is unset. Indices are NVML's, which match CUDA's when CUDA_DEVICE_ORDER=PCI_BUS_ID.

    Args:
        read_only: refuse every set call (module docstring).
        visible: in place of CUDA_VISIBLE_DEVICES.
        daemon: freqoptd's socket path (or ``tcp://host:port``) through which to set the GPUs, where the user has
            no root; None: $FREQOPT_DAEMON; "" (or unset): set them from this process. Reads stay local either
            way. Ignored for read-only devices.

    Raises:
        NVMLError: no driver, or an entry of CUDA_VISIBLE_DEVICES names no GPU.
        DaemonError: freqoptd does not answer at ``daemon``.
    """
    nv = _pynvml()
    _call("nvmlInit", nv.nvmlInit)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        count = _call("nvmlDeviceGetCount", nv.nvmlDeviceGetCount)
        entries = [str(i) for i in range(count)]
    else:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
    devices = []
    for position, entry in enumerate(entries):
        if entry.isdigit():
            handle = _call(f"GPU {entry} of CUDA_VISIBLE_DEVICES", nv.nvmlDeviceGetHandleByIndex, int(entry))
        else:
            handle = _call(f"GPU {entry} of CUDA_VISIBLE_DEVICES", nv.nvmlDeviceGetHandleByUUID, entry)
        devices.append(NVMLDevice(handle, position, read_only=read_only))
    address = os.environ.get("FREQOPT_DAEMON", "") if daemon is None else daemon
    if address and not read_only and devices:
        from freqopt.gpu.daemon_client import DaemonClient

        client = DaemonClient(address)
        client.hello()  # fails here, before any work, when the daemon does not answer
        devices = [DaemonDevice(d.handle, d.index, client) for d in devices]
    return devices


def parse_gpu_indices(value) -> list[int] | None:
    """GPU indices from a sequence of ints, text ``"0,1"``, or ``"none"`` / ``""`` (no GPU); None stays None (all
    visible GPUs).

    Raises:
        InvalidSettingError: not non-negative integers, or one given twice.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none"):
            return []
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isdigit() for p in parts):
            raise InvalidSettingError(f"gpu_indices {value!r} is not a list of GPU indices; write it like 0,1 (or "
                                      "none for no GPU)", argument="gpu_indices")  # fmt: skip
        indices = [int(p) for p in parts]
    else:
        indices = list(value)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices):
            raise InvalidSettingError(f"gpu_indices {value!r} must be GPU indices (integers from 0)",
                                      argument="gpu_indices")  # fmt: skip
    if len(set(indices)) != len(indices):
        raise InvalidSettingError(f"gpu_indices {value!r} names a GPU twice", argument="gpu_indices")
    return indices


# -- never leave a GPU changed ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPUState:
    """What a GPU had before freqopt changed it: enough to put it back.

    Attributes:
        uuid: the GPU (nvmlDeviceGetUUID).
        power_limit_w: nvmlDeviceGetPowerManagementLimit, W.
        applications_clocks_mhz: (SM, memory) application clocks, or None.
        pid: the process that changed it (a state file of a live process is not restored by ``freqopt reset``).
    """

    uuid: str
    power_limit_w: float
    applications_clocks_mhz: tuple[int, int] | None
    pid: int


def state_dir() -> Path:
    """Folder of state files: $FREQOPT_STATE_DIR, else $XDG_STATE_HOME/freqopt, else ~/.local/state/freqopt."""
    env = os.environ.get("FREQOPT_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "freqopt"


def _state_path(uuid: str, folder: Path | None = None) -> Path:
    return (folder or state_dir()) / f"gpu-{uuid}.json"


def _write_state(state: GPUState, folder: Path | None = None) -> Path:
    from freqopt.files import atomic_write_text

    path = _state_path(state.uuid, folder)
    atomic_write_text(path, json.dumps(asdict(state)) + "\n")
    return path


def restore(device: NVMLDevice, state: GPUState) -> None:
    """Put back what ``state`` recorded: unlock the clocks freqopt may have locked, the power limit found, the
    application clocks found. A GPU set through freqoptd (DaemonDevice) is released to the
    daemon instead, which puts back what it found before this client's first change."""
    if getattr(device, "via_daemon", False):
        device.release()
        return
    device.reset_sm_clock()
    try:
        device.reset_mem_clock()
    except NVMLError:  # before Ampere there are no memory locks to reset
        pass
    if abs(device.power_limit_w() - state.power_limit_w) > 1e-3:
        device.set_power_limit_w(state.power_limit_w)
    if state.applications_clocks_mhz is not None and device.applications_clocks_mhz() != state.applications_clocks_mhz:
        device.set_applications_clocks(*state.applications_clocks_mhz)


class GPUStateGuard:
    """Records a GPU's state before its first change and restores it on exit, exception, SIGINT and SIGTERM.

    Use as a context manager around everything that changes the GPU; call ``before_change()`` before each set
    call (the first one records the state, in memory and in a state file written atomically). Signal handlers are
    installed only in the main thread; they restore, then re-raise the signal's default action.

    Args:
        device: the GPU.
        state_dir: the state file's folder; default ``state_dir()`` (freqoptd gives its own). A GPU set through
            freqoptd gets no state file here: the daemon keeps its own and restores the GPU if this process dies.
    """

    def __init__(self, device: NVMLDevice, *, state_dir: Path | None = None):
        self.device = device
        self.folder = state_dir
        self.state: GPUState | None = None
        self._lock = threading.Lock()
        self._previous_handlers: dict[int, object] = {}

    def before_change(self) -> None:
        if self.device.read_only:
            raise GPUPermissionError(f"GPU {self.device.index} is read-only; freqopt will not change it")
        with self._lock:
            if self.state is None:
                self.state = GPUState(self.device.uuid, self.device.power_limit_w(),
                                      self.device.applications_clocks_mhz(), os.getpid())  # fmt: skip
                if not getattr(self.device, "via_daemon", False):
                    _write_state(self.state, self.folder)

    def restore(self) -> None:
        """Restore the recorded state (if anything was changed) and remove the state file."""
        with self._lock:
            if self.state is None:
                return
            restore(self.device, self.state)
            _state_path(self.state.uuid, self.folder).unlink(missing_ok=True)
            self.state = None

    def discard(self) -> None:
        """Forget the recorded state without restoring it, and remove its state file: for a change NVML refused
        before anything was changed (restoring would need the permission that was refused)."""
        with self._lock:
            if self.state is not None:
                _state_path(self.state.uuid, self.folder).unlink(missing_ok=True)
                self.state = None

    def _on_signal(self, signum, frame):
        self.restore()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __enter__(self) -> GPUStateGuard:
        atexit.register(self.restore)
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.restore()
        finally:
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            self._previous_handlers.clear()
            atexit.unregister(self.restore)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reset_from_state_files(devices: list[NVMLDevice] | None = None, *,
                           folder: Path | None = None) -> list[tuple[str, str]]:  # fmt: skip
    """Restore every GPU that a state file in ``folder`` (default ``state_dir()``) says a dead freqopt process left
    changed (``freqopt reset``; freqoptd at its start, in its own folder).

    Returns:
        (uuid, what was done) per state file found.

    Raises:
        GPUPermissionError: restoring needs root or CAP_SYS_ADMIN.
        NVMLError: a GPU named in a state file is not present.
    """
    folder = Path(folder) if folder is not None else state_dir()
    files = sorted(folder.glob("gpu-*.json")) if folder.is_dir() else []
    if not files:
        return []
    by_uuid = {d.uuid: d for d in (devices if devices is not None else open_devices(visible=None))}
    done = []
    for path in files:
        try:
            raw = json.loads(path.read_text())
            state = GPUState(raw["uuid"], float(raw["power_limit_w"]),
                             tuple(raw["applications_clocks_mhz"]) if raw.get("applications_clocks_mhz") else None,
                             int(raw["pid"]))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidSettingError(f"{path} is not a freqopt state file ({e}); remove it if it is stale") from e
        if state.pid != os.getpid() and _pid_alive(state.pid):
            done.append((state.uuid, f"left alone: process {state.pid} that changed it is still running"))
            continue
        if state.uuid not in by_uuid:
            raise NVMLError(f"{path} names GPU {state.uuid}, which is not visible here; run freqopt reset on its machine")
        restore(by_uuid[state.uuid], state)
        path.unlink(missing_ok=True)
        done.append((state.uuid, f"restored: power limit {state.power_limit_w:g} W, clocks unlocked"))
    return done
