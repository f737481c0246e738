"""Real AMD GPUs through AMD SMI (the ``amdsmi`` Python bindings ROCm ships): discovery, what a GPU supports, its
energy counter, and power-cap and SM-clock changes, behind the interface of freqopt.gpu.nvml.NVMLDevice, so that
the real-GPU backend (freqopt.gpu.backends.nvml), GPUStateGuard's restore on exit and signal, its state files and
``freqopt reset`` serve AMD GPUs unchanged.

What maps to what (AMD SMI Python API, ROCm 6.x; units as its reference gives them):

- power limit: ``amdsmi_get_power_cap_info`` (``power_cap``, ``default_power_cap``, ``min_power_cap``,
  ``max_power_cap``, uW) and ``amdsmi_set_power_cap(handle, 0, uW)``;
- SM (graphics, GFX) clock: an AMD GPU takes a range anywhere between its lowest and highest DPM level, not a list
  of clocks: ``amdsmi_set_gpu_clk_range(handle, min, max, AmdSmiClkType.GFX)`` (MHz) with min = max locks it, and
  the full range with ``amdsmi_set_gpu_perf_level(handle, AmdSmiDevPerfLevel.AUTO)`` releases it. The range is
  ``amdsmi_get_clk_freq(handle, AmdSmiClkType.GFX)``'s levels (Hz); freqopt searches the GPU file's clock grid
  within it;
- memory clock: the levels of ``amdsmi_get_clk_freq(handle, AmdSmiClkType.MEM)``, set by the same range call with
  ``AmdSmiClkType.MEM``;
- energy: ``amdsmi_get_energy_count`` (``energy_accumulator`` x ``counter_resolution``, uJ; before amdsmi 6.2.1 the
  accumulator's key was ``power``); board power ``amdsmi_get_power_info`` (``average_socket_power``, else
  ``current_socket_power``, W); current clocks ``amdsmi_get_clock_info`` (``clk``, MHz);
- name and UUID: ``amdsmi_get_gpu_asic_info``'s ``market_name``, ``amdsmi_get_gpu_device_uuid``.

AMD GPUs have no application clocks: ``applications_clocks_mhz`` is None and setting them is not supported. Errors:
AMD SMI's ``AmdSmiLibraryException`` codes (amdsmi_status_t in amd_smi.h): AMDSMI_STATUS_NO_PERM (10) ->
GPUPermissionError, AMDSMI_STATUS_NOT_SUPPORTED (2) -> AMDSMINotSupportedError, AMDSMI_STATUS_INVAL (1) ->
InvalidSettingError, AMDSMI_STATUS_DRIVER_NOT_LOADED (34) and AMDSMI_STATUS_INIT_ERROR (18) -> AMDSMIError
naming the simulator, anything else AMDSMIError. Visibility: HIP_VISIBLE_DEVICES, else ROCR_VISIBLE_DEVICES, else
CUDA_VISIBLE_DEVICES (which ROCm's HIP also honours), as indices or UUIDs.

Where users have no root, freqoptd (freqopt.daemon, its policy's ``backend = "amdsmi"``) makes the set calls:
``open_amd_devices`` returns AMDSMIDaemonDevices, whose set calls go to it and whose reads stay here, where
$FREQOPT_DAEMON names its socket.

On an MI250X each graphics compute die (GCD) is one GPU to software, and AMD SMI reports power and energy for the
package on the even one only (Zeus's AMD backend says so too): the odd die's counter raises AMDSMINotSupportedError.
"""

from __future__ import annotations

import os

from freqopt.errors import GPUPermissionError, InvalidSettingError, UnknownNameError
from freqopt.gpu.nvml import READ_ONLY_HINT, DaemonSetCalls, NVMLError, NVMLNotSupportedError

__all__ = ["AMDSMIError", "AMDSMINotSupportedError", "AMDSMIDevice", "AMDSMIDaemonDevice", "open_amd_devices",
           "visible_amd_devices", "amd_device_count"]

STATUS_INVAL, STATUS_NOT_SUPPORTED, STATUS_INIT_ERROR, STATUS_NO_PERM, STATUS_DRIVER_NOT_LOADED = 1, 2, 18, 10, 34


class AMDSMIError(NVMLError):
    """AMD SMI is missing or failed (no ROCm driver, no GPU, an unsupported call). A subclass of NVMLError, the GPU
    management library's failure, so that code written for NVIDIA GPUs handles it as it handles NVML's."""


class AMDSMINotSupportedError(AMDSMIError, NVMLNotSupportedError):
    """AMD SMI says this GPU or driver does not support the call (AMDSMI_STATUS_NOT_SUPPORTED)."""


def _amdsmi():
    try:
        import amdsmi
    except (ImportError, OSError) as e:  # the bindings load libamd_smi.so at import: OSError where ROCm is missing
        raise AMDSMIError(f"AMD SMI is not available ({e}); install ROCm's amdsmi package, or use backend sim "
                          "(the simulated GPU) on a machine without an AMD GPU") from e  # fmt: skip
    return amdsmi


def _call(what: str, fn, *args):
    """Call an AMD SMI function, mapping its errors to freqopt's: no permission, not supported, a bad value,
    no driver, anything else."""
    smi = _amdsmi()
    try:
        return fn(*args)
    except smi.AmdSmiLibraryException as e:
        code = e.get_error_code()
        if code == STATUS_NO_PERM:
            raise GPUPermissionError(f"{what}: AMD SMI says no permission; {READ_ONLY_HINT}") from e
        if code == STATUS_NOT_SUPPORTED:
            raise AMDSMINotSupportedError(f"{what}: this GPU or driver does not support it ({e})") from e
        if code == STATUS_INVAL:
            raise InvalidSettingError(f"{what}: AMD SMI refused the value ({e}); give one within the GPU's "
                                      "supported range") from e  # fmt: skip
        if code in (STATUS_DRIVER_NOT_LOADED, STATUS_INIT_ERROR):
            raise AMDSMIError(f"{what}: no AMD GPU driver found ({e}); use backend sim (the simulated GPU) on a "
                              "machine without a GPU") from e  # fmt: skip
        raise AMDSMIError(f"{what}: AMD SMI error {e}") from e


class AMDSMIDevice:
    """One AMD GPU seen through AMD SMI, with NVMLDevice's methods (module docstring says which call each makes).

    Args:
        handle: the AMD SMI processor handle.
        index: the position of the GPU among the visible ones.
        read_only: refuse every set and reset call (raise, before calling AMD SMI).
    """

    via_daemon = False

    def __init__(self, handle, index: int, *, read_only: bool = False):
        self.handle, self.index, self.read_only = handle, index, read_only
        smi = _amdsmi()
        self.name = str(_call("amdsmi_get_gpu_asic_info", smi.amdsmi_get_gpu_asic_info, handle)["market_name"])
        self.uuid = str(_call("amdsmi_get_gpu_device_uuid", smi.amdsmi_get_gpu_device_uuid, handle))

    # -- reads ---------------------------------------------------------------------------------------------------
    def _levels_mhz(self, clock_type) -> tuple[int, ...]:
        smi = _amdsmi()
        freq = _call("amdsmi_get_clk_freq", smi.amdsmi_get_clk_freq, self.handle, clock_type)
        return tuple(sorted({int(round(f / 1e6)) for f in freq["frequency"][: int(freq["num_supported"])]}))

    def sm_clock_range_mhz(self) -> tuple[int, int]:
        """(lowest, highest) GFX clock the GPU can be held in, MHz: its DPM levels' ends (amdsmi_get_clk_freq)."""
        levels = self._levels_mhz(_amdsmi().AmdSmiClkType.GFX)
        return levels[0], levels[-1]

    def supported_mem_clocks_mhz(self) -> tuple[int, ...]:
        return self._levels_mhz(_amdsmi().AmdSmiClkType.MEM)

    def supported_sm_clocks_mhz(self, mem_clock_mhz: int) -> tuple[int, ...]:
        """The GPU file's SM clocks within the GPU's GFX range, and the range's two ends (MHz): an AMD GPU takes
        any clock in the range, so the grid searched is the file's (its step), not the driver's few DPM levels."""
        lo, hi = self.sm_clock_range_mhz()
        grid = {f for f in self._file_spec().sm_clocks_mhz if lo <= f <= hi}
        return tuple(sorted(grid | {lo, hi}))

    def _cap_info(self) -> dict:
        smi = _amdsmi()
        return _call("amdsmi_get_power_cap_info", smi.amdsmi_get_power_cap_info, self.handle)

    def power_limit_constraints_w(self) -> tuple[float, float]:
        info = self._cap_info()
        return info["min_power_cap"] / 1e6, info["max_power_cap"] / 1e6

    def power_limit_default_w(self) -> float:
        return self._cap_info()["default_power_cap"] / 1e6

    def power_limit_w(self) -> float:
        return self._cap_info()["power_cap"] / 1e6

    def energy_j(self) -> float:
        """The cumulative energy counter, J: amdsmi_get_energy_count's accumulator x its resolution (uJ) / 1e6.

        Raises:
            AMDSMINotSupportedError: the GPU reports no energy (the odd die of an MI250X).
        """
        smi = _amdsmi()
        count = _call("amdsmi_get_energy_count", smi.amdsmi_get_energy_count, self.handle)
        accumulator = count["energy_accumulator"] if "energy_accumulator" in count else count["power"]
        return accumulator * count["counter_resolution"] / 1e6

    def power_w(self) -> float:
        """The package's power draw, W: amdsmi_get_power_info's average_socket_power, else current_socket_power
        (where the average is not reported: "N/A")."""
        smi = _amdsmi()
        info = _call("amdsmi_get_power_info", smi.amdsmi_get_power_info, self.handle)
        for key in ("average_socket_power", "current_socket_power"):
            if isinstance(info.get(key), (int, float)):
                return float(info[key])
        raise AMDSMINotSupportedError(f"GPU {self.index} ({self.name}) reports no power reading")

    def sm_clock_mhz(self) -> int:
        smi = _amdsmi()
        return int(_call("amdsmi_get_clock_info", smi.amdsmi_get_clock_info, self.handle, smi.AmdSmiClkType.GFX)["clk"])

    def mem_clock_mhz(self) -> int:
        smi = _amdsmi()
        return int(_call("amdsmi_get_clock_info", smi.amdsmi_get_clock_info, self.handle, smi.AmdSmiClkType.MEM)["clk"])

    def applications_clocks_mhz(self) -> None:
        """None: AMD GPUs have no application clocks."""
        return None

    # -- changes -------------------------------------------------------------------------------------------------
    def _writable(self, what: str) -> None:
        if self.read_only:
            raise GPUPermissionError(f"{what} refused: GPU {self.index} ({self.name}) was opened read-only")

    def _clock_range(self, what: str, lo: int, hi: int, clock_type) -> None:
        smi = _amdsmi()
        _call(what, smi.amdsmi_set_gpu_clk_range, self.handle, int(lo), int(hi), clock_type)

    def lock_sm_clock(self, sm_clock_mhz: int) -> None:
        """Hold the GFX clock at ``sm_clock_mhz`` (amdsmi_set_gpu_clk_range with min = max)."""
        self._writable("locking the SM clock")
        self._clock_range("amdsmi_set_gpu_clk_range", sm_clock_mhz, sm_clock_mhz, _amdsmi().AmdSmiClkType.GFX)

    def reset_sm_clock(self) -> None:
        """The GFX clock's whole range again, and the performance level back to auto (the driver's default)."""
        self._writable("resetting the SM clock")
        smi = _amdsmi()
        self._clock_range("amdsmi_set_gpu_clk_range", *self.sm_clock_range_mhz(), smi.AmdSmiClkType.GFX)
        _call("amdsmi_set_gpu_perf_level", smi.amdsmi_set_gpu_perf_level, self.handle, smi.AmdSmiDevPerfLevel.AUTO)

    def lock_mem_clock(self, mem_clock_mhz: int) -> None:
        """Hold the memory clock (amdsmi_set_gpu_clk_range with AmdSmiClkType.MEM, min = max).

        Raises:
            AMDSMINotSupportedError: the GPU lists one memory clock, or the driver refuses.
        """
        self._writable("locking the memory clock")
        levels = self.supported_mem_clocks_mhz()
        if len(levels) < 2:
            raise AMDSMINotSupportedError(f"GPU {self.index} ({self.name}) has one memory clock, {levels[0]} MHz")
        self._clock_range("amdsmi_set_gpu_clk_range", mem_clock_mhz, mem_clock_mhz, _amdsmi().AmdSmiClkType.MEM)

    def reset_mem_clock(self) -> None:
        self._writable("resetting the memory clock")
        levels = self.supported_mem_clocks_mhz()
        if len(levels) < 2:
            raise AMDSMINotSupportedError(f"GPU {self.index} ({self.name}) has one memory clock: nothing to reset")
        self._clock_range("amdsmi_set_gpu_clk_range", levels[0], levels[-1], _amdsmi().AmdSmiClkType.MEM)

    def set_power_limit_w(self, power_limit_w: float) -> None:
        """Set the power cap (amdsmi_set_power_cap on sensor 0, uW)."""
        self._writable("setting the power limit")
        smi = _amdsmi()
        _call("amdsmi_set_power_cap", smi.amdsmi_set_power_cap, self.handle, 0, int(round(power_limit_w * 1e6)))

    def set_applications_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int) -> None:
        raise AMDSMINotSupportedError("AMD GPUs have no application clocks")

    # -- its type ------------------------------------------------------------------------------------------------
    def _file_spec(self):
        from freqopt.gpu.specs import get_gpu, list_gpus

        for name in list_gpus():
            spec = get_gpu(name)
            if self.name in spec.amdsmi_names:
                return spec
        raise UnknownNameError(
            f"GPU {self.index} is a {self.name!r}, which no file in search_spaces/ lists in amdsmi_names; add a "
            "TOML file for it (copy the nearest one and fill in its data sheet)"
        )

    def spec(self):
        """The GPUSpec of the search_spaces/ file whose amdsmi_names hold this GPU's market name, with the clock
        lists (supported_sm_clocks_mhz, supported_mem_clocks_mhz) and power-cap range read from the device.

        Raises:
            UnknownNameError: no GPU type in search_spaces/ has this name; the message names it.
        """
        import dataclasses

        spec = self._file_spec()
        mem = self.supported_mem_clocks_mhz() or spec.mem_clocks_mhz
        sm = self.supported_sm_clocks_mhz(mem[-1])
        lo, hi = self.power_limit_constraints_w()
        return dataclasses.replace(spec, sm_clocks_mhz=sm, mem_clocks_mhz=tuple(mem), max_sm_clock_for_mem_mhz={},
                                   power_limit_min_w=lo, power_limit_max_w=hi,
                                   power_limit_default_w=self.power_limit_default_w())  # fmt: skip


def visible_amd_devices() -> str | None:
    """The visibility list a ROCm process honours: HIP_VISIBLE_DEVICES, else ROCR_VISIBLE_DEVICES, else
    CUDA_VISIBLE_DEVICES; None where none is set (every GPU)."""
    for key in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        if key in os.environ:
            return os.environ[key]
    return None


class AMDSMIDaemonDevice(DaemonSetCalls, AMDSMIDevice):
    """An AMD GPU whose set calls go to freqoptd and whose reads go to AMD SMI in this process (DaemonSetCalls:
    the daemon's refusals as GPUPermissionError, InvalidSettingError, NVMLNotSupportedError or NVMLError)."""

    def __init__(self, handle, index: int, client):
        AMDSMIDevice.__init__(self, handle, index)
        self._attach(client)

    def set_applications_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int) -> None:
        raise AMDSMINotSupportedError("AMD GPUs have no application clocks")


def amd_device_count() -> int:
    """How many GPUs AMD SMI sees on the machine, whatever the visibility variables say.

    Raises:
        AMDSMIError: no AMD SMI or driver.
    """
    smi = _amdsmi()
    _call("amdsmi_init", smi.amdsmi_init)
    return len(list(_call("amdsmi_get_processor_handles", smi.amdsmi_get_processor_handles)))


def open_amd_devices(*, read_only: bool = False, visible: str | None = None,
                     daemon: str | None = None) -> list[AMDSMIDevice]:
    """The AMD GPUs this process may use, in visibility order (visible_amd_devices: indices or UUIDs); all of them
    where no list is set.

    Args:
        read_only: refuse every set call.
        visible: in place of the environment's list.
        daemon: freqoptd's socket path (or ``tcp://host:port``) through which to set the GPUs, where the user has
            no root; None: $FREQOPT_DAEMON; "": set them from this process. Reads stay local either way. Ignored
            for read-only devices.

    Raises:
        AMDSMIError: no AMD SMI or driver, or an entry of the list names no GPU.
        DaemonError: freqoptd does not answer at ``daemon``.
    """
    smi = _amdsmi()
    _call("amdsmi_init", smi.amdsmi_init)
    handles = list(_call("amdsmi_get_processor_handles", smi.amdsmi_get_processor_handles))
    visible = visible_amd_devices() if visible is None else visible
    entries = [str(i) for i in range(len(handles))] if visible is None else [
        e.strip() for e in visible.split(",") if e.strip()]  # fmt: skip
    by_uuid = {}
    if any(not e.isdigit() for e in entries):
        by_uuid = {str(_call("amdsmi_get_gpu_device_uuid", smi.amdsmi_get_gpu_device_uuid, h)): h for h in handles}
    devices = []
    for position, entry in enumerate(entries):
        if entry.isdigit() and int(entry) < len(handles):
            handle = handles[int(entry)]
        elif entry in by_uuid:
            handle = by_uuid[entry]
        else:
            raise AMDSMIError(f"GPU {entry} of the visible devices (HIP_VISIBLE_DEVICES) names no GPU: "
                              f"{len(handles)} are present")  # fmt: skip
        devices.append(AMDSMIDevice(handle, position, read_only=read_only))
    address = os.environ.get("FREQOPT_DAEMON", "") if daemon is None else daemon
    if address and not read_only and devices:
        from freqopt.gpu.daemon_client import DaemonClient

        client = DaemonClient(address)
        client.hello()  # fails here, before any work, when the daemon does not answer
        devices = [AMDSMIDaemonDevice(d.handle, d.index, client) for d in devices]
    return devices
