"""Measure the stage profile that ``freqopt plan`` reads (freqopt.pipeline.profile.load_stage_profile): each pipeline
stage's forward and backward time and energy at each locked SM clock, on the simulated GPU or on a real one through
NVML. It is freqopt's counterpart of the stage profiling Perseus runs itself (Chung et al., SOSP'24), in the same CSV
format (columns ``stage, instruction, frequency, time, energy``).

What is measured. The model is split into stages as DeepSpeed's PipelineModule splits it
(freqopt.workload.pipeline_trace.trace_pipeline_stages: the layout's pp stages, or pp x v model stages for a schedule
that runs v per GPU), and every stage's instructions, the kernels of one micro-batch's forward and backward (for the
zero-bubble schedules also the backward's input- and weight-gradient halves, StageTrace.pass_kernels), P2P receives
and sends included, are measured at every SM clock asked for, locked (``ClockSetting(sm_clock_mhz=f)``; the memory
clock and the power limit stay at the GPU's defaults, as the pipeline search measures its instructions and as Perseus
profiles), by ``Backend.measure_schedule``:

* on the simulated GPU (backend "sim"), the instruction issued as a training step issues it, from an idle GPU, with
  the noise of one reading drawn from the seed, the instruction, the clock and the sample index (SimulatedGPU), so a
  resumed run draws the same figures as an uninterrupted one; this is what the pipeline search's instruction studies
  measure (freqopt.pipeline.search);
* on a real GPU (backend "nvml"), the instruction's kernels replayed in a loop on the one GPU (freqopt.gpu.replay; a
  P2P transfer, which needs its neighbour, runs as a device copy of its bytes, and the backend logs which), time by
  CUDA events and energy by NVML's energy counter over a window of several counter updates
  (freqopt.gpu.backends.nvml). The stages are measured one after another on that GPU: a pipeline's stages run on
  GPUs of one type. The time a stage waits for its neighbours is not in a row: the planner adds it from the schedule.

``repeats`` readings of each (stage, instruction, clock) are averaged.

The file. A plain CSV, ``stage, instruction, frequency, time, energy`` on its first line, then one row per
instruction: frequency (MHz), time (s) and energy (J) of one instruction, by stage, clock (highest first) and
instruction, as Perseus orders them; ``pandas.read_csv(path)``, as Perseus's planner loads its profile, reads it as
it is. What identifies the run (the model and its sizes, the layout, partition, schedule, GPU type, backend, seed and
repeats) and the blocking power to plan with are in a JSON file beside it, ``PATH.meta.json`` (sidecar_path).

Resuming. The whole file is written again, atomically (freqopt.files.atomic_write_text; the sidecar first, then the
CSV), after each clock, and once more with the rows measured so far when the run stops early (an exception,
Ctrl-C), whenever every stage then has a row of every instruction: the file on disk is always a stage profile the
planner reads, or absent. A run with the same arguments reads its rows back and measures only those missing; rows at
clocks it was not asked for are kept (a later run may add clocks). A file with no sidecar identifying a run (or, as
older versions wrote it, a first line ``# freqopt stage-profile run: {JSON}``), one that another run wrote, or whose
rows are not a stage profile, is refused and left as it is.

A real GPU. Its clocks are set through NVMLBackend, whose guard (freqopt.gpu.nvml.GPUStateGuard) puts back what it
found on success, on an exception and on SIGINT and SIGTERM (a backend opened by name here is closed here; one passed
in is the caller's to close). Read-only mode is refused before NVML is opened, and so never sets anything: a stage
profile is a table of locked clocks, which read-only mode cannot set, and a row per stage at whatever clock the GPU
runs would leave the planner nothing to choose.

Blocking power. The planner also needs the power a GPU draws while it waits on its neighbours (``freqopt plan
--blocking-power-w``), which no stage's own kernels show. It is taken from the GPU's file, not measured: the GPU's
waiting power at its highest clocks (freqopt.gpu.backends.physics.waiting_power_w: the file's [waiting_power]
measurement where it has one, e.g. Perseus's 83.64 W on an A100 SXM and 70.38 W on an A40, else the power model's
baseline; a figure the file carries from another GPU, as on the B200, L4, L40S and RTX 4090, is said to be carried,
not measured), the figure the simulated pipeline's blocked GPUs draw at the default clock. It is written in the file's
header and returned (StageProfileRun.blocking_power_w).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from freqopt.errors import FreqoptError, InvalidSettingError, check_positive_int
from freqopt.files import atomic_write_text
from freqopt.pipeline.profile import PROFILE_COLUMNS, StageProfile, load_stage_profile, stage_profile_from_rows

__all__ = ["StageProfileRun", "measure_stage_profile", "check_stage_profile_arguments", "blocking_power",
           "sidecar_path", "read_run_header"]

# What the JSON sidecar beside a stage profile is called: the CSV's name and this (module docstring, "The file").
SIDECAR_SUFFIX = ".meta.json"
# The first line of a stage profile as older versions wrote it, the run's JSON after it; still read back.
_LEGACY_RUN_HEADER = "# freqopt stage-profile run: "
_PARTITION_METHODS = ("parameters", "uniform")  # and "type:REGEX" (freqopt.workload.pipeline_partition)


@dataclass(frozen=True)
class StageProfileRun:
    """A stage profile measured by measure_stage_profile, and what to plan it with.

    Attributes:
        path: the CSV written (``out``), columns stage, instruction, frequency (MHz), time (s), energy (J).
        profile: that file read back (freqopt.pipeline.profile.load_stage_profile): every row in it, those read back
            from an earlier run included.
        gpu: the GPU type's name (``freqopt gpus``).
        backend: "sim" or "nvml".
        stages: the model stages profiled; gpus: the pipeline's GPUs (the layout's pp).
        schedule, virtual_stages: the schedule the stages were traced for (freqopt.pipeline.dag.SCHEDULES) and its
            model stages per GPU where it loops (None otherwise).
        kinds: the instruction kinds measured per stage.
        sm_clocks_mhz: the SM clocks (MHz) this run was asked for, highest first.
        n_measured: rows this run measured; n_reused: rows of those clocks read back from ``out``.
        blocking_power_w: the power (W) a GPU draws while it waits on its neighbours, from the GPU's file (module
            docstring, "Blocking power"); blocking_power_source: where that figure comes from, in words.
        cost_gpu_s: GPU-seconds this run's measurements took (Measurement.cost_gpu_s, summed).
    """

    path: Path
    profile: StageProfile
    gpu: str
    backend: str
    stages: int
    gpus: int
    schedule: str
    virtual_stages: int | None
    kinds: tuple[str, ...]
    sm_clocks_mhz: tuple[int, ...]
    n_measured: int
    n_reused: int
    blocking_power_w: float
    blocking_power_source: str
    cost_gpu_s: float

    def plan_options(self) -> dict:
        """The keyword arguments, besides the profile and the micro-batch count, that plan this profile as it was
        measured (freqopt.pipeline.planner.PipelinePlanner, plan_pipeline): ``blocking_power_w``, ``schedule``,
        ``gpu`` where it is a GPU type freqopt ships (``freqopt gpus``; the planner prices its clock-switch
        latency) and ``virtual_stages`` where it was given."""
        from freqopt.gpu.specs import list_gpus

        options: dict = {"blocking_power_w": self.blocking_power_w, "schedule": self.schedule}
        if self.gpu in list_gpus():
            options["gpu"] = self.gpu
        if self.virtual_stages is not None:
            options["virtual_stages"] = self.virtual_stages
        return options

    def planner(self, micro_batches: int, **options):
        """A PipelinePlanner (freqopt.pipeline.planner) on this profile for ``micro_batches`` micro-batches per
        iteration, with plan_options (``options`` override them: node_limit, time_limit_s, ...).

        Raises:
            InvalidSettingError: as PipelinePlanner.
        """
        from freqopt.pipeline.planner import PipelinePlanner

        return PipelinePlanner(self.profile, micro_batches, **{**self.plan_options(), **options})


def _error(argument: str, message: str) -> InvalidSettingError:
    return InvalidSettingError(f"{argument} {message}", argument=argument)


def _parse_clocks(sm_clocks_mhz) -> tuple[int, ...] | None:
    """``sm_clocks_mhz`` as a tuple of positive ints (from a sequence, or a text "1980,1500,1200"), or None."""
    if sm_clocks_mhz is None:
        return None
    values = sm_clocks_mhz
    if isinstance(values, str):
        values = [v.strip() for v in values.split(",") if v.strip()]
        try:
            values = [int(v) for v in values]
        except ValueError:
            raise _error("sm_clocks_mhz", f"must be SM clocks in MHz separated by commas (1980,1500,1200), not "
                                          f"{sm_clocks_mhz!r}") from None  # fmt: skip
    if not isinstance(values, Sequence) or not values or \
            any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):  # fmt: skip
        raise _error("sm_clocks_mhz", f"must be one or more SM clocks in MHz (positive integers), not "
                                      f"{sm_clocks_mhz!r}")  # fmt: skip
    return tuple(dict.fromkeys(int(v) for v in values))


def _check_partition_method(partition_method) -> None:
    """The partition method's form (freqopt.workload.pipeline_partition.partition_layers's methods): whether a type
    regex matches a layer is known once the model is built."""
    if not isinstance(partition_method, str):
        raise _error("partition_method", f"must be a string, not {type(partition_method).__name__}")
    lowered = partition_method.lower()
    if lowered in _PARTITION_METHODS:
        return
    if lowered.startswith("type:"):
        try:
            re.compile(lowered.split(":")[1])
        except re.error as e:
            raise _error("partition_method", f"{partition_method!r}: not a regular expression ({e})") from None
        return
    raise _error("partition_method", f"{partition_method!r} is not one of DeepSpeed's; choose parameters (the "
                                     "default), uniform or type:REGEX")  # fmt: skip


@dataclass(frozen=True)
class _Checked:
    """measure_stage_profile's arguments, checked (check_stage_profile_arguments)."""

    out: Path
    layout: object
    spec: object  # the GPU type asked for (sim: the default where none was), or None (nvml without gpu)
    backend: object  # a name, or a Backend as given
    backend_name: str
    sm_clocks_mhz: tuple[int, ...] | None
    per_gpu: int
    kinds: tuple[str, ...]
    fingerprint: dict  # what is known of the run's identity before the model is built
    existing: tuple[dict, dict] | None  # the header and rows of ``out`` where it exists


def check_stage_profile_arguments(model, *, out, layout=None, gpu=None, backend="sim", sm_clocks_mhz=None,
                                  sm_clock_step_mhz: int | None = None, repeats: int = 1, read_only: bool = False,
                                  schedule: str = "1f1b", virtual_stages: int | None = None,
                                  partition_method: str = "parameters", micro_batch_size: int | None = None,
                                  seq_len: int | None = None, n_heads: int | None = None,
                                  vocab_multiple: int | None = None, seed: int = 0,
                                  device: int | None = None) -> _Checked:  # fmt: skip
    """The checks of measure_stage_profile's arguments (see there for each) that need no model traced (nor PyTorch
    imported), in its order, so that a caller can refuse a wrong argument at once: the model's name and sizes (a
    built-in model: a Hugging Face one has no pipeline layer list yet) and the layout (pp > 1), the backend and
    read_only, the GPU type, the clocks (against the GPU type's, where it is known), the step, repeats, seed,
    device, schedule and partition method, and ``out``: writable, and where it exists, a stage profile of the same
    run (as far as it is known before the model is built). measure_stage_profile runs them first; the clocks of a
    real GPU named by no ``gpu``, and the model's own sizes, are checked once known.

    Returns:
        The arguments as checked (the layout parsed, the GPU type resolved, the clocks as a tuple, what ``out``
        holds), which measure_stage_profile goes on with.

    Raises:
        UnknownNameError, InvalidSettingError, OutputError: as measure_stage_profile.
    """
    from freqopt.gpu.backends import Backend, local_device
    from freqopt.gpu.specs import DEFAULT_GPU, get_gpu
    from freqopt.output import check_writable_file
    from freqopt.pipeline.schedules import expected_kinds, stages_per_rank
    from freqopt.resolve import check_workload_arguments, resolve_backend, resolve_gpu
    from freqopt.workload.model_names import HF_PREFIX

    given_layout = check_workload_arguments(model, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                            n_heads=n_heads, vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    if isinstance(model, str) and model.startswith(HF_PREFIX):
        raise InvalidSettingError(f"model {model!r}: a stage profile is measured per pipeline stage, and pipeline "
                                  "layouts (pp > 1) take the built-in GPT-3 and BERT models (freqopt models); a "
                                  "Hugging Face model has no layer list to split yet")  # fmt: skip
    if not given_layout.is_pipeline:
        raise _error("layout", f"{given_layout} has no pipeline stages; give pp > 1 (e.g. pp=4): a stage profile is "
                               "measured per pipeline stage")  # fmt: skip
    backend = resolve_backend(backend)
    backend_name = backend if isinstance(backend, str) else backend.name
    if not isinstance(read_only, bool):
        raise _error("read_only", f"must be True or False, not {read_only!r}")
    device_read_only = isinstance(backend, Backend) and getattr(getattr(backend, "device", None), "read_only", False)
    if read_only or device_read_only:
        if backend_name == "sim":
            raise _error("read_only", "applies to backend nvml; the simulated GPU changes nothing real")
        raise _error("read_only", "cannot measure a stage profile: it locks the SM clock at each clock measured, "
                                  "which read-only mode never does; run it where freqopt may set clocks (root or "
                                  "CAP_SYS_ADMIN; it restores them), or on the simulated GPU (backend sim)")
    spec = resolve_gpu(gpu)
    if isinstance(backend, Backend):
        if spec is not None and backend.spec.name != spec.name:
            raise _error("gpu", f"{spec.name} was asked for, but the backend given measures a {backend.spec.name}; "
                                "pass no gpu, or a backend of that type")  # fmt: skip
        spec = backend.spec
    elif backend_name == "sim" and spec is None:
        spec = get_gpu(DEFAULT_GPU)
    clocks = _parse_clocks(sm_clocks_mhz)
    if clocks is not None and spec is not None:
        _check_supported(clocks, spec)
    check_positive_int("sm_clock_step_mhz", sm_clock_step_mhz, optional=True)
    check_positive_int("repeats", repeats)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _error("seed", f"must be an integer, not {seed!r}")
    if device is not None:
        local_device(device)
    per_gpu = stages_per_rank(schedule, virtual_stages)
    kinds = tuple(expected_kinds(schedule))
    _check_partition_method(partition_method)
    if isinstance(out, bool) or not isinstance(out, (str, Path)) or not str(out):
        raise _error("out", f"must be a file path for the stage profile (CSV), not {out!r}")
    out = check_writable_file(out, argument="out")
    fingerprint = {"layout": str(given_layout), "partition_method": partition_method, "schedule": schedule,
                   "model_stages": given_layout.pp * per_gpu, "kinds": list(kinds), "backend": backend_name,
                   "seed": seed if backend_name == "sim" else None, "repeats": repeats}  # fmt: skip
    if spec is not None:
        fingerprint["gpu"] = spec.name
    if isinstance(model, str) and not model.startswith(HF_PREFIX):  # a built-in model's name is its Workload's
        fingerprint["model"] = model
    for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
        if value is not None:  # as given; the defaults are known once the model is resolved
            fingerprint[name] = value
    existing = _read_out(out)
    if existing is not None:
        _check_same_run(out, existing[0], fingerprint)
    return _Checked(out=out, layout=given_layout, spec=spec, backend=backend, backend_name=backend_name,
                    sm_clocks_mhz=clocks, per_gpu=per_gpu, kinds=kinds, fingerprint=fingerprint,
                    existing=existing)  # fmt: skip


def _check_supported(clocks: Sequence[int], spec) -> None:
    supported = set(spec.sm_clocks_mhz)
    wrong = [f for f in clocks if f not in supported]
    if wrong:
        lo, hi = min(spec.sm_clocks_mhz), max(spec.sm_clocks_mhz)
        raise _error("sm_clocks_mhz", f"{', '.join(map(str, wrong))} MHz: not supported SM clock(s) of {spec.name}, "
                                      f"which supports {len(supported)} clocks from {lo} to {hi} MHz (freqopt gpus "
                                      f"--gpu {spec.name})")  # fmt: skip


def _select_clocks(spec, clocks: tuple[int, ...] | None, step_mhz: int | None) -> tuple[int, ...]:
    """The clocks to measure, highest first: ``clocks`` (each supported) or every SM clock of ``spec``, thinned by
    ``step_mhz``: the highest kept, then each clock at least ``step_mhz`` below the last one kept."""
    if clocks is not None:
        _check_supported(clocks, spec)
    chosen = sorted(clocks if clocks is not None else spec.sm_clocks_mhz, reverse=True)
    if step_mhz is None:
        return tuple(chosen)
    kept = [chosen[0]]
    for f in chosen[1:]:
        if kept[-1] - f >= step_mhz:
            kept.append(f)
    return tuple(kept)


# -- the file ------------------------------------------------------------------------------------------------------
def _out_error(path: Path, message: str) -> InvalidSettingError:
    return InvalidSettingError(f"out {path} {message}", argument="out")


def sidecar_path(path: str | Path) -> Path:
    """The JSON file beside the stage profile ``path`` that identifies its run: ``PATH.meta.json`` (module
    docstring, "The file")."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def read_run_header(path: str | Path) -> dict | None:
    """The run header of the stage profile ``path`` (what identifies the run: model, sizes, layout, partition,
    schedule, GPU type, backend, seed, repeats), from its sidecar (sidecar_path), or from the first line of a file
    an older version wrote (``# freqopt stage-profile run: {JSON}``); None where neither holds one.

    Raises:
        InvalidSettingError (argument ``out``): the sidecar exists but cannot be read.
    """
    path = Path(path)
    meta = sidecar_path(path)
    if meta.exists():
        try:
            document = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise _out_error(path, f"has a sidecar {meta} that cannot be read ({reason}); remove both or give another "
                                   "path") from None  # fmt: skip
        except ValueError:
            return None
        run = document.get("run") if isinstance(document, dict) else None
        return run if isinstance(run, dict) else None
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError):
        return None
    if not first.startswith(_LEGACY_RUN_HEADER):
        return None
    try:
        header = json.loads(first[len(_LEGACY_RUN_HEADER):])
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


def _read_out(path: Path) -> tuple[dict, dict] | None:
    """The run header and rows ((stage, kind, MHz) -> (time_s, energy_j)) of a stage profile this module wrote at
    ``path``, or None where there is no file.

    Raises:
        InvalidSettingError (argument ``out``): a file that cannot be read, with no sidecar identifying its run (nor
            an older version's first line), or whose rows are not a stage profile.
    """
    if not path.exists():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _out_error(path, f"cannot be read ({reason}); give another path") from None
    lines = text.splitlines()
    header = read_run_header(path)
    if header is None:
        raise _out_error(path, "exists and is not a stage profile this command wrote (no readable "
                               f"{sidecar_path(path).name} beside it saying which run wrote it), so it is left as it "
                               "is; give another path, or remove the file to measure anew")  # fmt: skip
    body = [line for line in lines if not line.lstrip().startswith("#")]
    reader = csv.DictReader(body)
    if reader.fieldnames is None:
        return header, {}
    if [name.strip() for name in reader.fieldnames] != list(PROFILE_COLUMNS):
        raise _out_error(path, f"has the columns {', '.join(reader.fieldnames)}, not {', '.join(PROFILE_COLUMNS)}; "
                               "remove it or give another path")  # fmt: skip
    raw = list(reader)
    if not raw:
        return header, {}
    try:
        profile = stage_profile_from_rows(raw, source=str(path))
    except InvalidSettingError as e:
        reason = str(e).split(": ", 1)[-1]
        raise _out_error(path, f"is not a valid stage profile ({reason}); remove it or give another path") from None
    rows = {}
    for (stage, kind), options in profile.options.items():
        for f, t, e in zip(options.sm_clock_mhz, options.time_s, options.energy_j):
            rows[(stage, kind, int(f))] = (float(t), float(e))
    return header, rows


def _check_same_run(path: Path, found: dict, expected: dict) -> None:
    """Refuse ``out`` when its run header differs from ``expected`` in a field both hold."""
    differ = [f"{key} {found.get(key)!r} there, {value!r} here" for key, value in expected.items()
              if key not in found or found[key] != value]  # fmt: skip
    if differ:
        raise _out_error(path, f"holds the stage profile of another run ({'; '.join(differ)}); give another out "
                               "path, or the same arguments to resume it")  # fmt: skip


def _write(path: Path, header: dict, rows: dict, kinds: Sequence[str], notes: dict) -> None:
    """The whole profile, atomically: first its sidecar (the run header and ``notes``), then the CSV, the column
    names on its first line and the rows by stage, clock (highest first) and instruction kind (Perseus's order),
    each figure as Python's shortest repr of the float (read back exactly)."""
    order = {kind: i for i, kind in enumerate(kinds)}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(PROFILE_COLUMNS)
    for (stage, kind, f) in sorted(rows, key=lambda k: (k[0], -k[2], order.get(k[1], len(order)))):
        time_s, energy_j = rows[(stage, kind, f)]
        writer.writerow([stage, kind, f, repr(time_s), repr(energy_j)])
    document = {"profile": path.name, "run": header, **notes}
    atomic_write_text(sidecar_path(path), json.dumps(document, indent=2, sort_keys=True) + "\n")
    atomic_write_text(path, buffer.getvalue())


def _loadable(rows: dict, stages: int, kinds: Sequence[str]) -> bool:
    """Whether every stage has a row of every instruction kind (so the file is a stage profile the planner reads)."""
    have = {(s, k) for s, k, _ in rows}
    return all((s, k) in have for s in range(stages) for k in kinds)


# -- blocking power ------------------------------------------------------------------------------------------------
def blocking_power(spec) -> tuple[float, str]:
    """The power (W) a GPU of type ``spec`` draws while it waits on its pipeline neighbours, and its source in
    words: the GPU's waiting power at its highest SM and memory clocks (freqopt.gpu.backends.physics.waiting_power_w;
    module docstring, "Blocking power")."""
    from freqopt.gpu.backends.physics import waiting_power_w

    watts = float(waiting_power_w(spec, spec.max_mem_clock_mhz)[0, -1])  # (1, F), F ascending: the highest clock
    provenance = spec.provenance.get("waiting_power", "")
    if spec.waiting_power.top_clocks_w is not None and provenance.startswith("measured"):
        source = f"the {spec.name} GPU file's [waiting_power] measurement at the highest clocks, not measured here"
    elif spec.waiting_power.top_clocks_w is not None:  # a figure carried from another GPU or assumed: not measured
        source = (f"the {spec.name} GPU file's [waiting_power] figure at the highest clocks, not a measurement of this "
                  f"GPU ({provenance or 'its file names no source'}), not measured here")  # fmt: skip
    else:
        source = (f"the {spec.name} GPU file's power-model baseline at the highest clocks (a model: the file holds "
                  "no waiting-power measurement), not measured here")  # fmt: skip
    return watts, source


# -- the measurement -----------------------------------------------------------------------------------------------
def measure_stage_profile(
    model,
    *,
    out: str | Path,
    layout=None,
    gpu=None,
    backend="sim",
    sm_clocks_mhz: Sequence[int] | str | None = None,
    sm_clock_step_mhz: int | None = None,
    repeats: int = 1,
    read_only: bool = False,
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
    partition_method: str = "parameters",
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    n_heads: int | None = None,
    vocab_multiple: int | None = None,
    seed: int = 0,
    device: int | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> StageProfileRun:
    """Measure each pipeline stage's forward and backward time and energy at each SM clock and write them to
    ``out`` in the format ``freqopt plan --stage-profile`` reads (module docstring), resuming the rows ``out``
    holds from an earlier run of the same arguments.

        >>> import freqopt
        >>> run = freqopt.measure_stage_profile("gpt3-small", layout="pp=2", seq_len=256, micro_batch_size=1,
        ...                                     sm_clocks_mhz=[1980, 1500, 1200], out="stages.csv")  # doctest: +SKIP
        >>> run.planner(micro_batches=4).plan(max_slowdown="1%").saved  # doctest: +SKIP

    Args:
        model: a built-in model name (freqopt.workload.models.list_models) or a Workload whose layout has pp > 1.
        out: the CSV file to write (and to resume from, where it exists).
        layout: "pp=4" or "dp=1,tp=2,pp=4" or a Layout (model names only); pp must be above 1.
        gpu: GPU type name or GPUSpec: the simulated GPU's (default h100-sxm); with backend nvml, the real GPU must
            be of this type (default: whatever it is).
        backend: "sim" (the simulated GPU), "nvml" (the real GPU ``device``, clocks set and restored) or a Backend
            (measured on as given, and not closed here).
        sm_clocks_mhz: the SM clocks (MHz) to measure at, each one the GPU supports, as a sequence or a text
            "1980,1500,1200"; None: every supported SM clock.
        sm_clock_step_mhz: thin the clocks: keep the highest, then each one at least this many MHz below the last
            one kept (60 keeps every fourth of an H100's 15 MHz steps); None keeps all.
        repeats: readings averaged per stage, instruction and clock.
        read_only: refused (module docstring, "A real GPU"): a stage profile is measured at locked clocks.
        schedule, virtual_stages: the pipeline schedule the stages are traced for (freqopt.pipeline.dag.SCHEDULES):
            those that run several model stages per GPU (virtual_stages, default 2; the V-shaped ones 2) profile
            pp x that many stages, and the zero-bubble ones also each backward's input- and weight-gradient halves.
        partition_method: DeepSpeed's PipelineModule partition: "parameters" (its default), "uniform",
            "type:REGEX".
        micro_batch_size, seq_len, n_heads, vocab_multiple: get_workload overrides, model names only.
        seed: seeds the simulated GPU's noise (backend sim).
        device: the real GPU's index among the visible ones (freqopt.gpu.backends.local_device).
        on_progress: called as on_progress(done, total, what) once before the first measurement (done: the rows of
            the asked clocks already in ``out``) and after each one; ``what`` names the row ("stage 1 backward at
            1500 MHz"). An exception it raises (KeyboardInterrupt) stops the run as Ctrl-C does.

    Returns:
        StageProfileRun: the file, its profile as load_stage_profile reads it, the blocking power to plan with
        (StageProfileRun.planner, plan_options), and what the run measured.

    Raises:
        UnknownNameError: unknown model, GPU type, backend or schedule.
        InvalidSettingError: a bad size, layout (pp must be above 1, with no more stages than layers), clock, step,
            repeats, seed, device, virtual_stages or partition_method; a Hugging Face model (no pipeline layer list
            yet); read_only; a GPU other than ``gpu``; an ``out`` that holds something other than a stage profile of
            this run (argument ``out``).
        OutputError: ``out`` cannot be written.
        NVMLError, GPUPermissionError: the real GPU cannot be opened or changed (freqopt.gpu.nvml).
    """
    checked = check_stage_profile_arguments(model, out=out, layout=layout, gpu=gpu, backend=backend,
                                            sm_clocks_mhz=sm_clocks_mhz, sm_clock_step_mhz=sm_clock_step_mhz,
                                            repeats=repeats, read_only=read_only, schedule=schedule,
                                            virtual_stages=virtual_stages, partition_method=partition_method,
                                            micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                            vocab_multiple=vocab_multiple, seed=seed, device=device)  # fmt: skip
    from freqopt.resolve import resolve_workload
    from freqopt.workload.pipeline_trace import trace_pipeline_stages

    workload = resolve_workload(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                                vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    model_stages = workload.layout.pp * checked.per_gpu
    if checked.spec is not None:  # the whole run's identity, checked before any tracing or measuring
        header = _run_header(checked, workload, checked.spec)
        if checked.existing is not None:
            _check_same_run(checked.out, checked.existing[0], header)
    traces = trace_pipeline_stages(workload, partition_method=partition_method, model_stages=model_stages)
    kernels = {(s, kind): trace.pass_kernels(kind) for s, trace in enumerate(traces) for kind in checked.kinds}
    for (s, kind), ks in kernels.items():
        if not ks:
            raise _error("partition_method", f"{partition_method!r} leaves stage {s} no {kind} kernels to measure; "
                                             "choose another partition or fewer stages")  # fmt: skip
    measuring, opened = _open(checked, seed, device)
    try:
        spec = measuring.spec
        header = _run_header(checked, workload, spec)
        existing = _read_out(checked.out)  # again: another process may have written it since the check
        if existing is not None:
            _check_same_run(checked.out, existing[0], header)
        rows = dict(existing[1]) if existing is not None else {}
        clocks = _select_clocks(spec, checked.sm_clocks_mhz, sm_clock_step_mhz)
        watts, source = blocking_power(spec)
        notes = _notes(spec, checked, watts, source)
        save = lambda: _write(checked.out, header, rows, checked.kinds, notes)  # noqa: E731
        measured, cost = _measure(measuring, kernels, clocks, checked.kinds, model_stages, repeats, rows, save,
                                  on_progress)  # fmt: skip
    finally:
        if opened:
            measuring.close()  # a real GPU's clocks and power limit as found (GPUStateGuard)
    wanted = {(s, kind, f) for s in range(model_stages) for kind in checked.kinds for f in clocks}
    return StageProfileRun(path=checked.out, profile=load_stage_profile(checked.out), gpu=spec.name,
                           backend=checked.backend_name, stages=model_stages, gpus=workload.layout.pp,
                           schedule=schedule, virtual_stages=virtual_stages, kinds=checked.kinds,
                           sm_clocks_mhz=clocks, n_measured=measured, n_reused=len(wanted) - measured,
                           blocking_power_w=watts, blocking_power_source=source, cost_gpu_s=cost)  # fmt: skip


def _open(checked: _Checked, seed: int, device: int | None):
    """(the backend, whether it was opened here): one opened by name (freqopt.gpu.backends.get_backend: a simulated
    GPU of the type asked for, or the real GPU ``device``), or the Backend given."""
    from freqopt.gpu.backends import get_backend

    if not isinstance(checked.backend, str):
        return checked.backend, False
    return get_backend(checked.backend, checked.spec, seed=seed, device=device), True


def _run_header(checked: _Checked, workload, spec) -> dict:
    """What identifies a run: the model, its sizes (and a digest of its whole configuration), the layout, the
    partition, the schedule's model stages and kinds, the GPU type, the backend, the seed (sim) and repeats."""
    config = workload.config
    return {**checked.fingerprint, "model": workload.model, "micro_batch_size": workload.micro_batch_size,
            "seq_len": getattr(config, "seq_len", None),
            "config_sha1": hashlib.sha1(repr(config).encode()).hexdigest()[:12], "layout": str(workload.layout),
            "gpu": spec.name}  # fmt: skip


def _notes(spec, checked: _Checked, watts: float, source: str) -> dict:
    """What the sidecar says besides the run header: what the rows are, and the blocking power to plan with."""
    where = "the simulated GPU" if checked.backend_name == "sim" else "a real GPU through NVML"
    return {"written_by": f"freqopt stage-profile (freqopt.measure.stage_profile) on {where} ({spec.name}); "
                          "rewritten after each clock; the same command resumes it",
            "columns": {"stage": "pipeline stage (model stage), from 0",
                        "instruction": "one micro-batch's forward or backward, or a backward's input- or "
                                       "weight-gradient half (backward_input, backward_weight)",
                        "frequency": "locked SM clock (MHz)", "time": "time of one instruction (s)",
                        "energy": "energy of one instruction (J)"},
            "blocking_power_w": watts,
            "blocking_power_source": f"the power a GPU draws while it waits on its neighbours, from {source}; plan "
                                     "with freqopt plan --blocking-power-w"}  # fmt: skip


def _measure(backend, kernels: dict, clocks: Sequence[int], kinds: Sequence[str], stages: int, repeats: int,
             rows: dict, save: Callable[[], None], on_progress) -> tuple[int, float]:  # fmt: skip
    """Measure the rows of ``clocks`` that ``rows`` lacks into it, saving the file after each clock and, where the
    run stops early, with what it has (if every stage has a row of every kind). Returns (rows measured, GPU-s)."""
    from freqopt.gpu.backends.base import ClockSetting

    keys = [(s, kind) for s in range(stages) for kind in kinds]
    total = len(keys) * len(clocks)
    done = sum((s, kind, f) in rows for s, kind in keys for f in clocks)
    if on_progress is not None:
        on_progress(done, total, "")
    measured, cost, unsaved = 0, 0.0, False
    try:
        for f in clocks:
            setting = ClockSetting(sm_clock_mhz=f)
            for s, kind in keys:
                if (s, kind, f) in rows:
                    continue
                ks = kernels[(s, kind)]
                readings = [backend.measure_schedule(ks, [setting] * len(ks), key=f"stage{s}.{kind}", sample=r)
                            for r in range(repeats)]  # fmt: skip
                time_s = math.fsum(m.time_s for m in readings) / repeats
                energy_j = math.fsum(m.energy_j for m in readings) / repeats
                if not (time_s > 0 and math.isfinite(time_s) and energy_j >= 0 and math.isfinite(energy_j)):
                    raise FreqoptError(f"stage {s} {kind} at {f} MHz measured {time_s!r} s and {energy_j!r} J, not a "
                                       "positive time and energy; the rows so far are kept")  # fmt: skip
                rows[(s, kind, f)] = (float(time_s), float(energy_j))
                cost += math.fsum(m.cost_gpu_s for m in readings)
                measured, done, unsaved = measured + 1, done + 1, True
                if on_progress is not None:
                    on_progress(done, total, f"stage {s} {kind} at {f} MHz")
            if unsaved:
                save()
                unsaved = False
    finally:
        if unsaved and _loadable(rows, stages, kinds):
            save()
    return measured, cost
