"""One setting for a whole job: a job-level table's power limit and locked clocks held while a command runs.

    >>> from freqopt.apply.job import apply_table, nvidia_smi_lines
    >>> from freqopt.tables import load_table
    >>> table = load_table("tables/gpt3-small-h100-sxm-1pct-power-cap.json")                  # doctest: +SKIP
    >>> apply_table(table, ["python", "train.py"], gpu_indices=[0])                            # doctest: +SKIP
    0
    >>> nvidia_smi_lines(table, [0])                                                           # doctest: +SKIP
    ['nvidia-smi -i 0 -pl 200', 'nvidia-smi -i 0 -rgc  # SM clock unlocked: the table keeps the GPU's own']

A table holds one setting for the job when every entry holds the same one: a power-cap table (a power limit,
clocks left to the GPU), an iteration-level table (locked SM and memory clocks at the default power limit), and a
pass, phase or kernel table whose units all realized one setting (on the H100 gpt3-small realizes no more than one:
its phases are far shorter than a clock switch). A table whose schedule switches between settings while the job
runs needs a runtime at the job's phase boundaries, freqopt.DVFSRuntime or ``freqopt train``; ``job_setting``
refuses it, and a pipeline's table, saying so.

``apply_table`` puts each GPU at the setting through the NVML backend (freqopt.gpu.backends.nvml.NVMLBackend.apply,
as the runtime does: None fields are the GPU's default, unlocked clocks and the default power limit), runs the
command as a child that SIGINT, SIGTERM and SIGHUP reach (freqopt.command.run_command), and restores each GPU when
the command ends, however it ends (freqopt.gpu.nvml.GPUStateGuard: what the GPU had, from memory, and after a
SIGKILL of freqopt from the state file that ``freqopt reset`` reads). A signal to freqopt is passed on to the
command, and freqopt restores the GPUs once the command has ended. A command that outlives a SIGKILL of freqopt
keeps running at the setting until ``freqopt reset`` puts the GPUs back.

``nvidia_smi_lines`` gives the same setting as nvidia-smi command lines (nvidia-smi -h: ``-pl`` power limit in W,
``-lgc``/``-rgc`` lock and reset the SM clocks, ``-lmc``/``-rmc`` the memory clocks at run time,
``--lock-memory-clocks-deferred``/``--reset-memory-clocks-deferred`` at the GPU's next initialisation).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from freqopt.command import check_command, run_command
from freqopt.errors import ClockTableError, InvalidSettingError
from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.nvml import NVMLError, open_devices, parse_gpu_indices
from freqopt.gpu.specs import get_gpu
from freqopt.tables import ClockTable, load_table

__all__ = ["job_setting", "nvidia_smi_lines", "apply_table"]


def _table(table: ClockTable | str | Path) -> ClockTable:
    return table if isinstance(table, ClockTable) else load_table(table)


def job_setting(table: ClockTable) -> ClockSetting:
    """The one setting ``table`` holds for the whole job: its entries' setting when all are the same.

    Returns:
        a ClockSetting: sm_clock_mhz and mem_clock_mhz (MHz), power_limit_w (W); None fields keep the GPU's default.

    Raises:
        ClockTableError: a pipeline's table, or a table whose entries hold more than one setting (its schedule
            switches clocks while the job runs); the message names the runtimes that apply it.
    """
    name = table.source or "the clock table"
    table.refuse_pipeline("freqopt apply (one setting for the whole job)")
    settings = list(dict.fromkeys(ClockSetting.of_entry(e) for e in table.entries))
    if len(settings) > 1:
        raise ClockTableError(
            f"{name} is a {table.granularity}-level table whose schedule switches between {len(settings)} settings "
            "while the job runs, and freqopt apply holds one setting for the whole job: apply it at the job's phase "
            f"boundaries with freqopt.DVFSRuntime in the training loop, or with `freqopt train --table {name}`"
        )
    return settings[0]


def _smi_targets(gpu_indices) -> list[str | None]:
    """What nvidia-smi's ``-i`` takes for each GPU: the CUDA_VISIBLE_DEVICES entry at each index (an NVML index or
    a UUID, both of which nvidia-smi takes), the index itself where CUDA_VISIBLE_DEVICES is unset; [None] (no
    ``-i``: every GPU) for every visible GPU where CUDA_VISIBLE_DEVICES is unset."""
    wanted = parse_gpu_indices(gpu_indices)
    if wanted == []:
        raise InvalidSettingError("gpu_indices is empty; name the GPUs to set, e.g. 0,1, or leave it out for every "
                                  "visible GPU", argument="gpu_indices")  # fmt: skip
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [None] if wanted is None else [str(i) for i in wanted]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if wanted is None:
        return entries
    missing = [i for i in wanted if i >= len(entries)]
    if missing:
        raise InvalidSettingError(f"gpu_indices {missing[0]} is not a visible GPU: CUDA_VISIBLE_DEVICES={visible} "
                                  f"makes {len(entries)} visible (0-{len(entries) - 1})",
                                  argument="gpu_indices")  # fmt: skip
    return [entries[i] for i in wanted]


def nvidia_smi_lines(table: ClockTable, gpu_indices: Sequence[int] | str | None = None, *,
                     undo: bool = False) -> list[str]:  # fmt: skip
    """The nvidia-smi command lines that put the GPUs at ``table``'s job setting (job_setting), as apply_table does
    (each needs root); with ``undo``, the lines that put them back at their defaults.

    Args:
        table: a job-level table (job_setting).
        gpu_indices: the GPUs, by index among the visible ones (CUDA_VISIBLE_DEVICES order), as a sequence or text
            "0,1"; each line names its GPU as nvidia-smi's ``-i`` takes it (CUDA_VISIBLE_DEVICES's entry where it is
            set). None: every visible GPU (no ``-i`` where CUDA_VISIBLE_DEVICES is unset).
        undo: the lines that unlock the clocks and set the default power limit instead (nvidia-smi cannot read
            back a limit that was changed before, which apply_table restores itself).

    Returns:
        one line per GPU and knob; a default the setting keeps is stated as such (``-rgc``, ``-pl`` at the default
        limit), with a comment after ``#``. The memory clock of a GPU type that locks it only per job
        (search_spaces/*.toml, ``mem_clock_lock``) is set with ``--lock-memory-clocks-deferred``, which takes effect
        at the GPU's next initialisation; one that cannot be locked, or stays at the highest clock there, has no line.

    Raises:
        ClockTableError: as job_setting.
        InvalidSettingError: bad gpu_indices (argument ``gpu_indices``).
    """
    setting = job_setting(table)
    spec = get_gpu(table.gpu)
    mem_top = spec.max_mem_clock_mhz
    lines = []
    for target in _smi_targets(gpu_indices):
        smi = "nvidia-smi" + (f" -i {target}" if target is not None else "")
        default_pl = f"{smi} -pl {spec.power_limit_default_w:g}"
        if undo:
            lines.append(f"{smi} -rgc")
            if spec.mem_clock_lock == "runtime" and len(spec.mem_clocks_mhz) > 1:
                lines.append(f"{smi} -rmc")
            elif spec.mem_clock_lock == "per-job" and setting.mem_clock_mhz not in (None, mem_top):
                lines.append(f"{smi} --reset-memory-clocks-deferred  # at the GPU's next initialisation")
            lines.append(f"{default_pl}  # {spec.name}'s default limit; put back the one it had, if another")
            continue
        if setting.power_limit_w is None:
            lines.append(f"{default_pl}  # the default limit, which the table keeps")
        else:
            lines.append(f"{smi} -pl {setting.power_limit_w:g}")
        if setting.sm_clock_mhz is None:
            lines.append(f"{smi} -rgc  # SM clock unlocked: the table keeps the GPU's own")
        else:
            lines.append(f"{smi} -lgc {setting.sm_clock_mhz},{setting.sm_clock_mhz}")
        mem = setting.mem_clock_mhz
        if spec.mem_clock_lock == "runtime" and len(spec.mem_clocks_mhz) > 1:
            lines.append(f"{smi} -rmc  # memory clock unlocked: the table keeps the GPU's own" if mem is None
                         else f"{smi} -lmc {mem},{mem}")  # fmt: skip
        elif spec.mem_clock_lock == "per-job" and mem not in (None, mem_top):
            lines.append(f"{smi} --lock-memory-clocks-deferred={mem}  # {spec.name} locks its memory clock per job: "
                         "from the GPU's next initialisation (a driver reload)")  # fmt: skip
    return lines


def apply_table(table: ClockTable | str | Path, command: Sequence[str], *,
                gpu_indices: Sequence[int] | str | None = None,
                announce: Callable[[str], None] | None = None) -> int:  # fmt: skip
    """Hold ``table``'s job setting on the GPUs while ``command`` runs; restore them when it ends (module docstring).

    Everything is checked before any GPU is changed: the table (job_setting), the command, the GPUs, and that each
    GPU is of the table's type and supports its setting.

    Args:
        table: a job-level table, or the path of one (load_table).
        command: the program and its arguments, no shell, e.g. ``["python", "train.py"]``.
        gpu_indices: the GPUs to set, by index among the visible ones (CUDA_VISIBLE_DEVICES order), as a sequence
            or text "0,1"; None: every visible GPU.
        announce: called with one line per GPU once it holds the setting, and once the GPUs are restored (e.g.
            ``print``); None: nothing said.

    Returns:
        the command's exit status as a shell reports it: its own, or 128 + N where signal N ended it.

    Raises:
        ClockTableError: as job_setting and load_table; a GPU of another type than the table's, or one that locks
            its memory clock only per job where the table asks for a memory clock other than its highest.
        InvalidSettingError: an empty command or one not found (argument ``command``); bad gpu_indices (argument
            ``gpu_indices``: empty, not indices, or a GPU not visible); a setting the GPU does not support.
        GPUPermissionError: changing clocks or the power limit needs root or CAP_SYS_ADMIN.
        NVMLError: no NVIDIA driver, or NVML fails.
    """
    table = _table(table)
    setting = job_setting(table)
    argv = check_command(command)
    wanted = parse_gpu_indices(gpu_indices)
    if wanted == []:
        raise InvalidSettingError("gpu_indices is empty; name the GPUs to set, e.g. 0,1, or leave it out for every "
                                  "visible GPU", argument="gpu_indices")  # fmt: skip
    try:
        devices = open_devices()
    except NVMLError as e:
        raise NVMLError(f"freqopt apply sets real GPUs through NVML, which fails here ({e.__cause__ or e}); run it on "
                        "the GPU machine, with its NVIDIA driver loaded") from e  # fmt: skip
    if wanted is not None:
        missing = [i for i in wanted if i >= len(devices)]
        if missing:
            raise InvalidSettingError(f"gpu_indices {missing[0]} is not a visible GPU: this process sees "
                                      f"{len(devices)} (0-{len(devices) - 1})", argument="gpu_indices")  # fmt: skip
        devices = [devices[i] for i in wanted]
    from freqopt.gpu.backends.nvml import NVMLBackend  # imports PyTorch: after every check that needs none

    say = announce or (lambda line: None)
    name = table.source or "the clock table"
    with contextlib.ExitStack() as held:
        backends = []
        for device in devices:
            backend = NVMLBackend(device, torch_device=f"cuda:{device.index}")
            held.callback(backend.close)  # restores this GPU, whatever happens after
            backends.append(backend)
        for backend in backends:
            _check_memory_clock(backend, setting, name)
            table.check_gpu(backend.spec, source=name)
        for backend in backends:
            backend.apply(setting)
            say(f"GPU {backend.device.index} ({backend.device.name}): {setting.label()} held while the command runs")
        run = run_command(argv)
    say(f"GPU{'s' if len(devices) > 1 else ''} {', '.join(str(d.index) for d in devices)} restored")
    return run.exit_code


def _check_memory_clock(backend, setting: ClockSetting, name: str) -> None:
    """Refuse a memory clock that ``backend``'s GPU cannot take while a job runs (it refused a run-time lock when
    the backend opened it: NVMLBackend.mem_clock_refusal) and that is not the clock it runs at anyway."""
    mem, held = setting.mem_clock_mhz, backend.spec.max_mem_clock_mhz
    if backend.mem_clock_refusal is None or mem is None or mem == held:
        return
    device = backend.device
    raise ClockTableError(f"{name} asks for memory clock {mem} MHz, but GPU {device.index} ({device.name}) locks its "
                          f"memory clock only per job (it refused a run-time lock), so it runs at {held} MHz: lock "
                          f"{mem} MHz with `nvidia-smi -i {device.uuid} --lock-memory-clocks-deferred={mem}` and a "
                          f"driver reload before the job, or use a table searched at {held} MHz")  # fmt: skip
