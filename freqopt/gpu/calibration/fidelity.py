"""One scoreboard of the simulated GPUs' fidelity: every public and shared measurement, each judged on data it was not
fitted on.

A *data set* (``DataSet``) is one body of measurements of one or more GPU types. It knows its GPUs, its kind
(``KINDS``), where the data come from, and how to judge the committed constants on it:

* ``rows(folds)`` gives the scoreboard's rows (``Row``: per GPU and metric, the error with the committed constants
  -- *fitted on*, since the committed constants were fitted on these data -- and the error of each point predicted by
  a fit that did not see it -- *left out*), and only predicts: ``folds`` maps each fold's name to the constants that
  fold's refit found, which are applied to today's committed GPU file through today's physics code;
* ``folds`` names what each fold leaves out (a workload, a batch size, a stage, a kernel shape, a whole step), and
  ``fit_fold(name)`` refits the data set's free constants without it (the expensive part: scipy's least squares, each
  fit bounded in evaluations) and returns the fitted values, JSON-able.

``experiments/fidelity.py`` runs every fold's refit, then every data set's ``rows`` with the refits' values, and
records both (experiments/fidelity.json, .md); tests/test_fidelity.py re-runs ``rows`` of the ``cheap`` data sets
with the *recorded* values (no refit) and fails when a left-out error moves past its recorded value plus
``tolerance`` -- a change to the physics or to a committed constant that makes another GPU's prediction worse.

What is left out, per data set (``REGISTRY``):

* Zeus's V100 BERT/SQuAD power-limit sweep: one batch size (8, 16, 32) at a time, the V100's power model and the
  workloads' host gaps refitted on the other two and McDonald's figures (freqopt.gpu.calibration.v100.fit_power_model);
* McDonald et al.'s V100 training figures: nothing (every figure fits the same workload's host gap; see ``Row.note``);
* Perseus's A100 BLOOM stage sweep and its A100 PCIe pipelines under power limits: one data set at a time, the GA100's
  joint fit refitted on the others (experiments/fit_a100_power.py, whose JSON records each fold's values: the refit
  is that script's, read here);
* Perseus's A40 stage sweeps and Zeus NSDI'23's A40 power-limit sweeps: one stage or one network (every batch size)
  at a time, the A40's joint fit refitted on the rest (experiments/fit_a40_power.py, whose JSON records the folds;
  NCF's sweeps, host-bound at every batch size, are not traced);
* Zeus NSDI'23's P100 sweeps: one network (every batch size and dataset) at a time, the P100's power model refitted
  on its other networks' sweeps (experiments/fit_zeus_power.py, whose JSON records the folds);
* Perseus's A40 pipelines under power limits, Zeus's Quadro RTX 6000 sweeps and DeepBench's V100 kernels: nothing of
  them is fitted in the committed files, so the committed constants' error is the left-out figure;
* the H100's microbenchmarks: nothing yet (``Row.note``); the H100's whole steps: one step at a time, both stages of
  freqopt.gpu.calibration.h100_steps.fit refitted on the other three;
* the H200's kernel families: one shape at a time (freqopt.gpu.calibration.h200.fit_family, the same refit as
  h200.leave_one_out); the H200's whole steps: one step at a time, the host's factor refitted on the other four
  (experiments/h200_check.py's fit_host);
* Spaan et al.'s headline figures: recorded by experiments/repro_spaan.py (a search of 20-30 min), not recomputed;
**Registering a data set** is one function and one entry. Write a function that returns a ``DataSet`` (its
``rows`` and, if it refits, its ``folds`` and ``fit_fold``), and add it to ``_BUILDERS`` (replacing the
``not_modelled`` placeholder of the same name if there is one)::

    def _zeus_p100() -> DataSet:
        def rows(folds):            # {fold name: fitted values}, as fit_fold returned them
            ...                     # predict each left-out point with its fold's values: [Row(...), ...]
        def fit_fold(name):         # refit without the fold; bounded work (max_nfev)
            return {"p_sm_active_w": ...}
        return DataSet("zeus-nsdi23-p100", ("p100",), "power-limit sweep", "shared/calibration/zeus/nsdi23/...",
                       rows, folds=("shufflenetv2", "resnet50", ...), fit_fold=fit_fold)

then re-record with ``python experiments/fidelity.py``. Targets by kind and metric are ``TARGETS`` (the
accuracy asked of each kind); tolerances of the guard are ``TOLERANCES``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

__all__ = ["Row", "DataSet", "KINDS", "TARGETS", "TOLERANCES", "REGISTRY", "EXPERIMENTS", "registry", "not_modelled",
           "tolerance", "target", "regressions", "recorded_folds"]

EXPERIMENTS = Path(__file__).resolve().parents[3] / "experiments"
DATA = EXPERIMENTS / "data"

KINDS = ("power-limit sweep", "clock sweep", "kernel family", "whole step", "headline figure")

# The targets, on left-out data: (kind, metric) -> the largest error that meets it.
TARGETS: dict[tuple[str, str], float] = {
    ("power-limit sweep", "time_rel_pp"): 8.0,  # relative time at every limit, percentage points
    ("power-limit sweep", "energy_rel_pp"): 8.0,
    ("power-limit sweep", "optimal_limit_w"): 25.0,  # the energy-optimal power limit's miss, W
    ("clock sweep", "time_rel_pp"): 3.0,  # relative time at every locked clock
    ("clock sweep", "energy_rel_pp"): 4.0,
    ("clock sweep", "optimal_clock_mhz"): 60.0,  # the energy-optimal clock's miss, MHz
    ("kernel family", "mean_abs_pct"): 15.0,  # mean |error| of a family's shapes, % of the measured time
    ("whole step", "time_pct"): 5.0,  # the H100's; the H200's is 10 (TARGET_BY_GPU)
    ("whole step", "energy_pct"): 5.0,
    ("headline figure", "figure_pp"): 8.0,  # McDonald's figures are power-limit points: the sweeps' target
}
TARGET_BY_GPU: dict[tuple[str, str, str], float] = {
    ("h200-sxm", "whole step", "time_pct"): 10.0,
    ("h200-sxm", "whole step", "energy_pct"): 10.0,
}
# The guard's tolerance, by metric: (absolute, relative to the recorded figure); the larger applies. The simulator is
# noiseless and the folds' values are recorded, so a rerun of unchanged code reproduces each figure to rounding:
# any move is a change. Half a point is a tenth of the smallest pp target (3-8 pp), below what a reader of the table
# would call a change; 5 % of a percentage error likewise. The energy-optimal limit or clock of a flat curve moves
# by a step of its grid on a change too small to matter, so one step (25 W of Zeus's limits, 15 MHz of Perseus's
# clocks) is tolerated; a larger move is a real one.
TOLERANCES: dict[str, tuple[float, float]] = {
    "time_rel_pp": (0.5, 0.0),
    "energy_rel_pp": (0.5, 0.0),
    "figure_pp": (0.5, 0.0),
    "optimal_limit_w": (25.0, 0.0),
    "optimal_clock_mhz": (15.0, 0.0),
    "mean_abs_pct": (0.5, 0.05),
    "time_pct": (0.5, 0.05),
    "energy_pct": (0.5, 0.05),
    "power_pct": (0.5, 0.05),
}


def tolerance(metric: str, recorded: float) -> float:
    """How far above ``recorded`` a figure of ``metric`` may move before the guard fails (TOLERANCES).

    Raises:
        KeyError: a metric with no tolerance.
    """
    absolute, relative = TOLERANCES[metric]
    return max(absolute, relative * abs(recorded))


def target(gpu: str, kind: str, metric: str) -> float | None:
    """The target for a metric of a data set's kind (TARGETS, TARGET_BY_GPU); None where it sets none."""
    return TARGET_BY_GPU.get((gpu, kind, metric), TARGETS.get((kind, metric)))


@dataclass(frozen=True)
class Row:
    """One line of the scoreboard.

    Attributes:
        entry: the REGISTRY name of the data set that yields it.
        gpu: freqopt's GPU type (or the measured GPU's name where freqopt has no file for it).
        dataset: the data set (or part of it: one stage, one kernel family), for people.
        kind: one of KINDS.
        metric: what is measured; the unit is in the name (``_pp`` percentage points of a ratio to the top clock or
            default limit, ``_pct`` % of the measured, ``_w``, ``_mhz``); the figure is the largest |error| over the
            points (``mean_abs_pct``: the mean).
        fitted_on: the committed constants' error (they were fitted on these data, so this is a residual); None
            where nothing is computed.
        left_out: the error of each point predicted by a refit that did not see it; None where nothing is left out
            (``note`` says why).
        n_points: measured points the figure covers (left out where there is a left-out figure).
        target: the target of its kind and metric (``target``); None where it sets none.
        note: how the figure was left out, or why it was not, or where a recorded figure comes from.
        status: "computed", "recorded" (read from another experiment's output, not recomputed here) or
            "not modelled yet".
    """

    entry: str
    gpu: str
    dataset: str
    kind: str
    metric: str
    fitted_on: float | None
    left_out: float | None
    n_points: int | None
    target: float | None
    note: str = ""
    status: str = "computed"

    @property
    def meets(self) -> bool | None:
        """Whether the left-out figure meets the target; None where either is missing (a residual is no fidelity)."""
        if self.left_out is None or self.target is None:
            return None
        return abs(self.left_out) <= self.target

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.entry, self.gpu, self.dataset, self.metric)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "meets": self.meets}


@dataclass(frozen=True)
class DataSet:
    """A registered data set (module docstring).

    Attributes:
        name: the REGISTRY key.
        gpus: the GPU types it measures.
        kind: one of KINDS.
        source: where the data are (a path under experiments/data or shared/calibration, and the paper).
        rows: ``folds -> list[Row]``, the folds' fitted values by fold name (empty for a data set with no folds).
        folds: fold names, each what one refit leaves out (or a function returning them, where finding them costs
            work: ``fold_names``).
        fit_fold: ``fold name -> {constant: value}``, the refit without that fold; None where nothing is refitted.
        cheap: whether ``rows`` is fast enough for the test suite (the guard recomputes only those).
        modelled: False for a placeholder of data no model reads yet.
    """

    name: str
    gpus: tuple[str, ...]
    kind: str
    source: str
    rows: Callable[[Mapping[str, dict]], list[Row]]
    folds: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()
    fit_fold: Callable[[str], dict] | None = None
    cheap: bool = True
    modelled: bool = True

    def fold_names(self) -> tuple[str, ...]:
        """The fold names (computed on use where ``folds`` is a function)."""
        return tuple(self.folds()) if callable(self.folds) else tuple(self.folds)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"data set {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.folds and self.fit_fold is None:
            raise ValueError(f"data set {self.name!r} names folds but has no fit_fold")


def not_modelled(name: str, gpus: tuple[str, ...], kind: str, source: str, dataset: str, why: str) -> DataSet:
    """A placeholder for measurements no model reads yet: one row per GPU, no figure, "not modelled yet"."""

    def rows(_folds):
        return [Row(name, gpu, dataset, kind, "-", None, None, None, None, why, "not modelled yet") for gpu in gpus]

    return DataSet(name, gpus, kind, source, rows, modelled=False)


@lru_cache(maxsize=None)
def _experiment(name: str):
    """experiments/<name>.py as a module (the fit scripts' starts and helpers, reused rather than copied)."""
    spec = importlib.util.spec_from_file_location(f"_freqopt_fidelity_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu(name: str):
    from freqopt.gpu.specs import get_gpu

    return get_gpu(name)


def _max_abs(values) -> float:
    return float(max(abs(v) for v in values))


def _step_rows(name: str, gpu: str, dataset: str, kind: str, fitted: list[dict], left: list[dict] | None,
               n_points: int, note: str) -> list[Row]:
    """A whole-step data set's two rows, time and energy: the largest |error| (%) of the steps with the committed
    constants (``fitted``) and of each step predicted by its fold (``left``; None where a fold is missing)."""
    return [Row(name, gpu, dataset, kind, f"{q}_pct", _max_abs(r[f"{q}_error_pct"] for r in fitted),
                _max_abs(r[f"{q}_error_pct"] for r in left) if left else None, n_points,
                target(gpu, kind, f"{q}_pct"), note) for q in ("time", "energy")]  # fmt: skip


# -- the V100: Zeus's BERT/SQuAD power-limit sweep and McDonald et al.'s figures ----------------------------------
V100 = "v100-pcie"


@lru_cache(maxsize=None)
def _v100_data():
    from freqopt.gpu.calibration import v100 as cal

    points = cal.load_zeus_points(DATA / "zeus_v100_bert_squad.csv")
    traces = {b: cal.bert_squad_trace(b) for b in sorted({p.batch_size for p in points})}
    return points, traces, cal.load_mcdonald_figures(DATA / "mcdonald_v100_training.csv"), cal.mcdonald_traces()


def _v100_gaps() -> dict[str, float]:
    """The host gaps per step the committed V100 constants were fitted with (experiments/calibration_residuals.json:
    workload constants, not GPU ones, so they live there)."""
    return json.loads((EXPERIMENTS / "calibration_residuals.json").read_text())["host_gaps_s"]


def _v100_with(spec, values: dict):
    power = {k: v for k, v in values.items() if k in spec.power_model.__dataclass_fields__}
    return dataclasses.replace(spec, power_model=dataclasses.replace(spec.power_model, **power))


def _sweep_errors(rows: list[dict]) -> dict[str, float]:
    """Zeus rows (v100.residuals) -> the largest |error| of relative time and energy (pp; energy = time x average
    power, relative to the highest limit) and the energy-optimal limit's largest miss (W) over batch sizes."""
    by_batch: dict[int, list[dict]] = {}
    for r in rows:
        by_batch.setdefault(r["batch_size"], []).append(r)
    energy, miss = [], []
    for batch_rows in by_batch.values():
        top = max(batch_rows, key=lambda r: r["power_limit_w"])
        e_meas = [r["time_rel_measured"] * r["avg_power_measured_w"] / top["avg_power_measured_w"]
                  for r in batch_rows]  # fmt: skip
        e_sim = [r["time_rel_simulated"] * r["avg_power_simulated_w"] / top["avg_power_simulated_w"]
                 for r in batch_rows]  # fmt: skip
        energy += [100 * (s - m) for s, m in zip(e_sim, e_meas)]
        limits = [r["power_limit_w"] for r in batch_rows]
        miss.append(limits[int(np.argmin(e_sim))] - limits[int(np.argmin(e_meas))])
    return {"time_rel_pp": _max_abs(r["time_rel_error_pp"] for r in rows), "energy_rel_pp": _max_abs(energy),
            "optimal_limit_w": _max_abs(miss)}  # fmt: skip


def _zeus_v100() -> DataSet:
    from freqopt.gpu.calibration import v100 as cal

    name, kind = "zeus-v100-bert-squad", "power-limit sweep"
    batches = (8, 16, 32)

    def rows(folds):
        points, traces, _, _ = _v100_data()
        spec = _gpu(V100)
        fitted = _sweep_errors(cal.residuals(spec, points, traces, _v100_gaps()["zeus_host_gap_s"]))
        left_rows = []
        for b in batches:
            values = folds.get(f"batch {b}")
            if values is None:
                left_rows = None
                break
            mine = [p for p in points if p.batch_size == b]
            left_rows += cal.residuals(_v100_with(spec, values), mine, {b: traces[b]}, values["zeus_host_gap_s"])
        left = _sweep_errors(left_rows) if left_rows else {}
        note = ("each batch size predicted by the V100 power model and host gaps refitted on the other two batch sizes "
                "and McDonald's figures (v100.fit_power_model, its own start); relative to the 250 W point")
        return [Row(name, V100, "Zeus NSDI'23 BERT/SQuAD power-limit sweep", kind, metric, fitted[metric],
                    left.get(metric), len(points), target(V100, kind, metric), note) for metric in fitted]  # fmt: skip

    def fit_fold(fold: str) -> dict:
        b = int(fold.split()[-1])
        points, traces, figures, figure_traces = _v100_data()
        kept = [p for p in points if p.batch_size != b]
        spec, gaps = cal.fit_power_model(_gpu(V100), kept, {k: v for k, v in traces.items() if k != b}, figures,
                                         figure_traces)  # fmt: skip
        values = {k: float(getattr(spec.power_model, k)) for k in cal.FIT_PARAMETERS}
        return {**values, "p_const_w": float(spec.power_model.p_const_w), **gaps}

    return DataSet(name, (V100,), kind, "experiments/data/zeus_v100_bert_squad.csv (You et al., NSDI 2023, artifact)",
                   rows, tuple(f"batch {b}" for b in batches), fit_fold)  # fmt: skip


def _mcdonald_v100() -> DataSet:
    from freqopt.gpu.calibration import v100 as cal

    name, kind = "mcdonald-v100-training", "headline figure"

    def rows(_folds):
        _, _, figures, figure_traces = _v100_data()
        got = cal.mcdonald_residuals(_gpu(V100), figures, figure_traces, _v100_gaps()["mcdonald_host_gap_s"])
        note = ("nothing left out: the five figures are the only data of this workload and fit its host gap per "
                "step with the V100's power model; leave one figure out (five more V100 refits, about 3 min of CPU "
                "each) is not run; the Zeus rows judge the same power model left out")
        return [Row(name, V100, "McDonald et al. 2022 V100 training figures", kind, "figure_pp",
                    _max_abs(r["error_pp"] for r in got), None, len(got), target(V100, kind, "figure_pp"), note)]

    return DataSet(name, (V100,), kind, "experiments/data/mcdonald_v100_training.csv (McDonald et al., NAACL 2022)",
                   rows)  # fmt: skip


# -- the A100 and A40: Perseus's stage sweeps at locked SM clocks -------------------------------------------------
@lru_cache(maxsize=None)
def _sweep(stage: str):
    from freqopt.gpu.calibration import dvfs as cd

    return cd.load_sweep(DATA / "perseus" / cd.STAGES[stage].file)


def _clock_metrics(summary: dict) -> dict[str, float]:
    return {"time_rel_pp": summary["max_abs_time_rel_error_pp"],
            "energy_rel_pp": summary["max_abs_energy_rel_error_pp"],
            "optimal_clock_mhz": float(abs(summary["energy_optimal_miss_mhz"]))}  # fmt: skip


def _perseus_a100() -> DataSet:
    from freqopt.gpu.calibration import dvfs as cd

    name, kind, gpu, stage = "perseus-a100-stages", "clock sweep", "a100-sxm4-80gb", "bloom+a100"
    fold = "bloom+a100 (clock sweep)"  # experiments/fit_a100_power.py's name for it

    def rows(folds):
        s = cd.STAGES[stage]
        fitted = _clock_metrics(cd.summarize(cd.residuals(_gpu(gpu), s, _sweep(stage))))
        values = folds.get(fold)
        left = (_clock_metrics(cd.summarize(cd.residuals(cd.with_values(_gpu(gpu), values), s, _sweep(stage))))
                if values else {})  # fmt: skip
        note = ("predicted by the GA100 joint fit without it (experiments/fit_a100_power.py: the A100 PCIe pipelines "
                "under power limits and the P2P-blocking power); the GPT-3 175B A100 sweep is held out, never read")
        return [Row(name, gpu, f"Perseus stage sweep {stage}", kind, m, v, left.get(m), len(_sweep(stage).sm_clock_mhz),
                    target(gpu, kind, m), note) for m, v in fitted.items()]  # fmt: skip

    def fit_fold(key: str) -> dict:
        return dict(_recorded_fit("a100_power_fit.json")["folds"][key]["values"])

    return DataSet(name, (gpu,), kind, "experiments/data/perseus/bloom+a100_sxm_bf16.csv (Chung et al., SOSP 2024)",
                   rows, (fold,), fit_fold)  # fmt: skip


def _a40_values(spec) -> dict[str, float]:
    from freqopt.gpu.calibration import dvfs as cd

    pm = spec.power_model
    out = {k: float(getattr(pm, k)) for k in cd.FIT_PARAMETERS if k != "f_knee_rel"}
    return {**out, "f_knee_rel": pm.f_knee_mhz / spec.max_sm_clock_mhz, "gemm_efficiency": float(spec.gemm_efficiency),
            "link_efficiency": float(spec.interconnect.link_efficiency)}  # fmt: skip


def _perseus_a40() -> DataSet:
    from freqopt.gpu.calibration import dvfs as cd

    name, kind, gpu = "perseus-a40-stages", "clock sweep", "a40"
    stages = ("bloom+a40", "gpt3-175b+a40")

    def rows(folds):
        out = []
        for stage in stages:
            s = cd.STAGES[stage]
            fitted = _clock_metrics(cd.summarize(cd.residuals(_gpu(gpu), s, _sweep(stage))))
            values = folds.get(stage)
            left = (_clock_metrics(cd.summarize(cd.residuals(cd.with_values(_gpu(gpu), values), s, _sweep(stage))))
                    if values else {})  # fmt: skip
            other = next(o for o in stages if o != stage)
            note = (f"predicted by the A40's joint fit without it (experiments/fit_a40_power.py: {other}, Zeus's "
                    "A40 sweeps and the sibling prior)")
            out += [Row(name, gpu, f"Perseus stage sweep {stage}", kind, m, v, left.get(m),
                        len(_sweep(stage).sm_clock_mhz), target(gpu, kind, m), note) for m, v in fitted.items()]
        return out

    def fit_fold(stage: str) -> dict:
        return dict(_recorded_fit("a40_power_fit.json")["folds"][stage]["parameters"])

    return DataSet(name, (gpu,), kind, "experiments/data/perseus/{bloom,gpt3-175b}+a40_bf16.csv (Chung et al., SOSP "
                   "2024)", rows, stages, fit_fold)  # fmt: skip


# -- the H100: microbenchmarks and whole steps ----------------------------------------------------------------------
H100 = "h100-sxm"


def _h100_kernels() -> DataSet:
    from freqopt.gpu.calibration import h100 as cal

    name, kind = "h100-kernels", "kernel family"

    def rows(_folds):
        got = cal.residuals(_gpu(H100), cal.load_points(DATA / "h100"))
        errors = [abs(r["time_error_pct"]) for r in got if "time_error_pct" in r]
        power = [abs(r["power_error_pct"]) for r in got]
        note = ("nothing left out yet: each of the 40-odd points would need its own 300-evaluation fit (h100.fit); the "
                "H100's whole steps judge the same file left out")
        return [Row(name, H100, "H100 microbenchmarks and replayed kernel classes", kind, "mean_abs_pct",
                    float(np.mean(errors)), None, len(errors), target(H100, kind, "mean_abs_pct"), note),
                Row(name, H100, "H100 microbenchmarks and replayed kernel classes (power)", kind, "power_pct",
                    float(np.mean(power)), None, len(power), None, note + "; mean |error| of the average power")]

    return DataSet(name, (H100,), kind, "experiments/data/h100 (a real H100, read-only, default settings)", rows)


@lru_cache(maxsize=None)
def _h100_steps_data():
    from freqopt.gpu.calibration import h100_steps as cal

    steps = cal.load_steps(DATA / "h100" / "whole_steps")
    return steps, cal.trace_steps(steps)


def _h100_steps() -> DataSet:
    from freqopt.gpu.calibration import h100_steps as cal

    name, kind = "h100-whole-steps", "whole step"
    folds = tuple(p.stem for p in sorted((DATA / "h100" / "whole_steps").glob("*.json")))

    def rows(fold_values):
        steps, traces = _h100_steps_data()
        spec = _gpu(H100)
        fitted = cal.residuals(spec, steps, traces)["steps"]
        left = []
        for s in steps:
            if s.name not in fold_values:
                left = None
                break
            left.append(cal.residuals(cal.with_values(spec, fold_values[s.name]), [s], traces)["steps"][0])
        note = ("each step predicted by both stages of h100_steps.fit (kernel classes, then the host's split) refitted "
                "on the other three")
        return _step_rows(name, H100, "H100 whole training steps", kind, fitted, left, len(steps), note)

    def fit_fold(step: str) -> dict:
        steps, traces = _h100_steps_data()
        fitted = cal.fit(_gpu(H100), [s for s in steps if s.name != step], traces)
        return {k: float(v) for k, v in cal.current_values(fitted).items()}

    return DataSet(name, (H100,), kind, "experiments/data/h100/whole_steps (a real H100, torch.profiler, NVML)", rows,
                   folds, fit_fold)  # fmt: skip


# -- the H200: kernel families by shape and whole steps ------------------------------------------------------------
H200 = "h200-sxm"


@lru_cache(maxsize=None)
def _h200_points():
    return tuple(_experiment("h200_check").load_points())


def _h200_harness() -> dict[str, float]:
    """The measuring loops' host times the committed constants were judged with (experiments/h200_check_residuals.json:
    properties of the measuring machine, never written to a GPU file)."""
    return json.loads((EXPERIMENTS / "h200_check_residuals.json").read_text())["harness_us"]


def _h200_fold_name(point) -> str:
    return f"{point.family}|{point.label}"


def _h200_alone(point, points) -> bool:
    """Whether a point alone exercises a constant of its family (h200.leave_one_out's ``alone``): no left-out figure."""
    from freqopt.gpu.calibration import h200 as cal

    rest = [q for q in points if q is not point]
    return cal._exercised_alone(point, rest) or not any(q.family == point.family for q in rest)


def _h200_group_keys(family: str) -> tuple[list[str], list[str]]:
    from freqopt.gpu.calibration import h200 as cal

    group = cal._group(family)
    return [k for f in group for k in f.parameters], [h for f in group for h in f.harness]


def _h200_families() -> DataSet:
    from freqopt.gpu.calibration import h200 as cal

    name, kind = "h200-kernel-families", "kernel family"

    def folds():
        points = _h200_points()
        return tuple(_h200_fold_name(p) for p in points if not _h200_alone(p, points))

    def rows(fold_values):
        points = _h200_points()
        spec, harness = _gpu(H200), _h200_harness()
        out = []
        for family in [f.name for f in cal.FAMILIES]:
            mine = [p for p in points if p.family == family]
            judged = [p for p in mine if not _h200_alone(p, points)]
            if not mine:
                continue
            left, kept, bound = [], [], 0
            for p in judged:
                values = fold_values.get(_h200_fold_name(p))
                if values is None:
                    left = None
                    break
                fold_harness = {**harness, **{k: v for k, v in values.items() if k in cal.HARNESS}}
                fold_spec = cal.with_values(spec, values)
                predicted = cal.predict(fold_spec, p, fold_harness)
                if p.harness and cal.kernel_time_s(fold_spec, p.kernels, p.sm_clock_mhz) < predicted * (1 - 1e-9):
                    bound += 1  # the measuring loop's host sets its time: a check of the loop, not of the kernel model
                    continue
                kept.append(p)
                left.append(abs(100 * (predicted / p.measured_s - 1)))
            judged = kept if left is not None else judged
            fitted = [abs(100 * (cal.predict(spec, p, harness) / p.measured_s - 1)) for p in judged]
            if judged:
                note = (f"each shape predicted by the family's group refitted on its other shapes, the families its "
                        f"prediction uses refitted without it too (h200.leave_one_out); {len(mine) - len(judged) - bound} "
                        f"shape(s) alone exercising a constant and {bound} bound by the measuring loop not judged")
                if not cal._FAMILY[family].parameters:
                    note += ("; nothing of this family is fitted on its own shapes (it rests on the constants of "
                             f"{', '.join(cal._FAMILY[family].uses)}), so left out equals fitted on")
            else:
                note = "one shape alone exercises the family's constant: nothing to leave out"
            if not judged:  # the committed constants' error on the shape(s) they alone were fitted on
                fitted = [abs(100 * (cal.predict(spec, p, harness) / p.measured_s - 1)) for p in mine]
            out.append(Row(name, H200, f"H200 kernels: {family}", kind, "mean_abs_pct", float(np.mean(fitted)),
                           float(np.mean(left)) if left else None, len(judged) or len(mine),
                           target(H200, kind, "mean_abs_pct"), note))  # fmt: skip
        return out

    def fit_fold(fold: str) -> dict:
        points = _h200_points()
        point = next(p for p in points if _h200_fold_name(p) == fold)
        names_in = {f.name for f in cal._group(point.family)}
        rest = [q for q in points if q.family in names_in and q is not point]
        base, harness = cal._without_shape(_gpu(H200), points, point.family, point.label, _h200_harness())
        left, left_harness = cal.fit_family(base, rest, point.family, harness)
        parameters, harness_keys = _h200_group_keys(point.family)
        for used in cal._FAMILY[point.family].uses:  # what its prediction uses, refitted without its shape too
            more, more_harness = _h200_group_keys(used)
            parameters, harness_keys = parameters + more, harness_keys + more_harness
        values = {k: float(v) for k, v in cal.current_values(left, parameters).items() if not math.isnan(v)}
        return {**values, **{h: float(left_harness[h]) for h in harness_keys if h in left_harness}}

    return DataSet(name, (H200,), kind, "experiments/data/h200/{kernel_atlas,convolutions,device_check,"
                   "waiting_power}.json (a real H200, read-only, default settings)", rows, folds, fit_fold)  # fmt: skip


@lru_cache(maxsize=None)
def _h200_step_traces():
    return _experiment("h200_check").step_traces()


def _h200_steps() -> DataSet:
    name, kind = "h200-whole-steps", "whole step"
    checks = json.loads((DATA / "h200" / "device_check.json").read_text())["training_steps"]
    folds = tuple(f"{r['model']} micro-batch {r['micro_batch_size']}" for r in checks)

    def rows(fold_values):
        from freqopt.gpu.host import get_host

        hc = _experiment("h200_check")
        spec, traces = _gpu(H200), _h200_step_traces()
        scale = spec.host_issue_s * 1e6 / get_host(hc.REFERENCE_HOST).issue_us
        fitted = hc.steps_with_host(spec, traces, scale)
        left = []
        for step in folds:
            if step not in fold_values:
                left = None
                break
            left += [r for r in hc.steps_with_host(spec, traces, fold_values[step]["host_scale"]) if r["step"] == step]
        note = ("each step predicted with the host's factor (on the H100 server's times) refitted on the other four "
                "(experiments/h200_check.py fit_host); the GPU's constants are fitted on kernels, not on steps")
        return _step_rows(name, H200, "H200 whole training steps", kind, fitted, left, len(fitted), note)

    def fit_fold(step: str) -> dict:
        return {"host_scale": _experiment("h200_check").fit_host(_gpu(H200), _h200_step_traces(), leave_out=step)}

    # Not cheap: tracing gpt3-xl and the larger steps takes tens of seconds.
    return DataSet(name, (H200,), kind, "experiments/data/h200/device_check.json (a real H200)", rows, folds, fit_fold,
                   cheap=False)  # fmt: skip


# -- headline figures recorded by other experiments ------------------------------------------------------------------
def _spaan() -> DataSet:
    name, kind, gpu = "spaan-rtx3080ti", "headline figure", "rtx3080ti"

    def rows(_folds):
        recorded = json.loads((EXPERIMENTS / "spaan" / "results.json").read_text())["rows"]
        paper = _experiment("repro_spaan").PAPER
        diffs = [recorded["|".join(k)]["energy_pct"] - v[0] for k, v in paper.items() if "|".join(k) in recorded]
        note = ("recorded by experiments/repro_spaan.py (a search of 20-30 min), not recomputed here: the largest "
                "absolute difference of freqopt's energy change from the paper's over Table 2's rows; no RTX 3080 Ti "
                "measurement was fitted, so the figure is left out by construction; no target is set for it")
        return [Row(name, gpu, "Spaan et al. 2026 Table 2 (energy change)", kind, "figure_pp", None, _max_abs(diffs),
                    len(diffs), None, note, "recorded")]  # fmt: skip

    return DataSet(name, (gpu,), kind, "shared/calibration/published.md (Spaan et al., CF 2026)", rows)


# -- fits recorded by their own experiments: the folds' values read from each fit's JSON ---------------------
def _recorded_fit(name: str) -> dict:
    return json.loads((EXPERIMENTS / name).read_text())


def _zeus_metrics(summary: dict) -> dict[str, float]:
    return {"time_rel_pp": summary["max_abs_time_rel_error_pp"], "energy_rel_pp": summary["max_abs_energy_rel_error_pp"],
            "optimal_limit_w": float(abs(summary["energy_optimal_error_w"]))}  # fmt: skip


@lru_cache(maxsize=None)
def _zeus_sweeps(board: str) -> tuple:
    """The Zeus NSDI'23 sweeps of ``board``'s file (a40, p100, rtx6000) whose networks freqopt traces."""
    from freqopt.gpu.calibration import zeus as cz

    stem = "summary_power_a40_shared" if board == "a40" else f"summary_power_{board}"
    return tuple(cz.load_sweeps(DATA / "zeus" / "nsdi23" / f"{stem}.csv", tuple(cz.NETWORKS)))


def _zeus_a40() -> DataSet:
    return _zeus_fitted("a40", "a40", "a40_power_fit.json",
                        "the A40's joint fit without {network} (every batch size of it), refitted by "
                        "experiments/fit_a40_power.py on the other networks and Perseus's two stages",
                        label=lambda sweep: sweep.name, csv_stem="summary_power_a40_shared", by_name=True)  # fmt: skip


def _zeus_carried(board: str, gpu: str) -> DataSet:
    """A Zeus NSDI'23 sweep of a board whose power model is carried, not fitted on it: every figure is left out."""
    from freqopt.gpu.calibration import zeus as cz

    name, kind = f"zeus-nsdi23-{board}", "power-limit sweep"

    def rows(_folds):
        out = []
        for sweep in _zeus_sweeps(board):
            left = _zeus_metrics(cz.summarize(cz.sweep_errors(_gpu(gpu), sweep)))
            note = (f"nothing of it fitted: {gpu}'s power model is carried from a sibling "
                    "(experiments/carry_gpus.py), so the committed file's error is a left-out figure")
            out += [Row(name, gpu, f"Zeus {sweep.label}", kind, m, None, v, len(sweep.power_limit_w),
                        target(gpu, kind, m), note) for m, v in left.items()]  # fmt: skip
        return out

    return DataSet(name, (gpu,), kind, f"experiments/data/zeus/nsdi23/summary_power_{board}.csv (You et al., NSDI "
                   "2023)", rows, cheap=False)  # fmt: skip


def _zeus_own(board: str, gpu: str) -> DataSet:
    """A Zeus NSDI'23 sweep of a board whose power model is fitted on its own sweeps alone
    (experiments/fit_zeus_power.py): each network predicted by the fold fitted without it."""
    return _zeus_fitted(board, gpu, f"{gpu}_power_fit.json",
                        f"{gpu}'s fit on its own Zeus sweeps without {{network}} (every batch size and dataset of it), "
                        "refitted by experiments/fit_zeus_power.py on the other networks")  # fmt: skip


def _zeus_fitted(board: str, gpu: str, record: str, how: str, *, label=lambda sweep: sweep.label,
                 csv_stem: str | None = None, by_name: bool = False) -> DataSet:  # fmt: skip
    """The Zeus NSDI'23 sweeps of ``board`` against ``gpu``'s file, whose power model a fit recorded in
    experiments/``record`` was fitted on them: each sweep's fitted-on error with the committed file and its
    left-out error with the recorded fold that left its network out (the fold's ``parameters``). ``how``: the
    note's account of that fold ("{network}" filled in); ``label``: a sweep's row name after "Zeus "; the folds in
    the record's order, or ``by_name`` (the record also holds folds of other data: the A40's stages)."""
    from freqopt.gpu.calibration import dvfs as cd
    from freqopt.gpu.calibration import zeus as cz

    name, kind = f"zeus-nsdi23-{board}", "power-limit sweep"

    def rows(folds):
        out = []
        for sweep in _zeus_sweeps(board):
            fitted = _zeus_metrics(cz.summarize(cz.sweep_errors(_gpu(gpu), sweep)))
            values = folds.get(sweep.network)
            left = (_zeus_metrics(cz.summarize(cz.sweep_errors(cd.with_values(_gpu(gpu), values), sweep)))
                    if values else {})  # fmt: skip
            note = "predicted by " + how.format(network=sweep.network)
            out += [Row(name, gpu, f"Zeus {label(sweep)}", kind, m, v, left.get(m), len(sweep.power_limit_w),
                        target(gpu, kind, m), note) for m, v in fitted.items()]  # fmt: skip
        return out

    def fit_fold(network: str) -> dict:
        return dict(_recorded_fit(record)["folds"][network]["parameters"])

    def folds() -> tuple[str, ...]:
        return (tuple(sorted({s.network for s in _zeus_sweeps(board)})) if by_name
                else tuple(_recorded_fit(record)["folds"]))  # fmt: skip

    return DataSet(name, (gpu,), kind, f"experiments/data/zeus/nsdi23/{csv_stem or f'summary_power_{board}'}.csv "
                   "(You et al., NSDI 2023)", rows, folds, fit_fold, cheap=False)  # fmt: skip


def _perseus_pipelines() -> DataSet:
    from freqopt.gpu.calibration import pipeline_sweeps as ps

    name, kind = "perseus-sosp24-pipelines", "power-limit sweep"
    a100 = _experiment("fit_a100_power")

    def metrics(e: dict) -> dict[str, float]:
        return {"time_rel_pp": e["max_abs_time_rel_error_pp"], "energy_rel_pp": e["max_abs_energy_rel_error_pp"],
                "optimal_limit_w": float(abs(e["energy_optimal_miss_w"]))}  # fmt: skip

    def rows(folds):
        out = []
        sets = a100.data_sets()
        for sweep in ps.load_pipeline_sweeps(DATA / "zeus" / "sosp24"):
            if sweep.model not in ps.SWEEP_MODELS:
                continue
            if sweep.testbed == "a40":
                left = metrics(ps.sweep_errors(None, sweep))
                out += [Row(name, sweep.gpu, f"Perseus pipeline {sweep.label}", kind, m, None, v,
                            len(sweep.power_limit_w), target(sweep.gpu, kind, m),
                            "nothing fitted on these pipelines: the committed A40's error is a left-out figure")
                        for m, v in left.items()]  # fmt: skip
                continue
            key = next(k for k in sets if k.startswith(f"{sweep.model} pp="))
            fitted = metrics(a100.errors(None, key, sets[key]))
            values = folds.get(key)
            left = metrics(a100.errors(values, key, sets[key])) if values else {}
            note = ("predicted by the GA100 joint fit without this pipeline (experiments/fit_a100_power.py: the BLOOM "
                    "stage sweep, the other pipeline and the P2P-blocking power)")
            out += [Row(name, sweep.gpu, f"Perseus pipeline {sweep.label}", kind, m, v, left.get(m),
                        len(sweep.power_limit_w), target(sweep.gpu, kind, m), note) for m, v in fitted.items()]
        return out

    def fit_fold(key: str) -> dict:
        return dict(_recorded_fit("a100_power_fit.json")["folds"][key]["values"])

    return DataSet(name, ("a100-pcie-80gb", "a40"), kind, "experiments/data/zeus/sosp24/{a100,a40}_zeus_global.csv "
                   "(Chung et al., SOSP 2024)", rows,
                   lambda: tuple(k for k in a100.data_sets() if "power-limit" in k), fit_fold)


def _deepbench_v100() -> DataSet:
    from freqopt.gpu.calibration import deepbench as db

    name, kind, gpu = "deepbench-v100", "kernel family", "v100-sxm2"

    def rows(_folds):
        points = db.load_points()
        errors = db.family_errors(_gpu(gpu), points)
        note = ("nothing of DeepBench is fitted in the committed V100 (experiments/deepbench_v100.md says why a fit "
                "on it is not committed), so the committed file's mean error is a left-out figure")
        return [Row(name, gpu, f"DeepBench {family}", kind, "mean_abs_pct", None, pct,
                    sum(p.family == family for p in points), target(gpu, kind, "mean_abs_pct"), note)
                for family, pct in errors.items()]  # fmt: skip

    return DataSet(name, (gpu,), kind, "experiments/data/deepbench_v100/ (Baidu DeepBench, da81ba7)", rows)


# -- the registry -----------------------------------------------------------------------------------------------------
_BUILDERS: list[Callable[[], DataSet]] = [
    _zeus_v100,
    _mcdonald_v100,
    _perseus_a100,
    _perseus_a40,
    _h100_kernels,
    _h100_steps,
    _h200_families,
    _h200_steps,
    _spaan,
    _zeus_a40,
    lambda: _zeus_own("p100", "p100-pcie"),
    lambda: _zeus_carried("rtx6000", "quadro-rtx6000"),
    _deepbench_v100,
    _perseus_pipelines,
]  # fmt: skip


@lru_cache(maxsize=None)
def registry() -> dict[str, DataSet]:
    """Every registered data set by name, in the table's order.

    Raises:
        FileNotFoundError: no experiments/ folder beside the package: the data sets and the fits' records live in
            a source checkout (an installed wheel has none).
        ValueError: two data sets of one name.
    """
    if not DATA.is_dir():
        raise FileNotFoundError(f"the fidelity scoreboard reads {DATA}, which is not there: run it from a source "
                                "checkout of freqopt (git clone, then pip install -e .)")
    out: dict[str, DataSet] = {}
    for build in _BUILDERS:
        ds = build()
        if ds.name in out:
            raise ValueError(f"two data sets named {ds.name!r}")
        out[ds.name] = ds
    return out


def __getattr__(name: str):
    """``REGISTRY``: registry()'s data sets, built on first use, so that importing this module reads no file."""
    if name == "REGISTRY":
        return registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def recorded_folds(recorded: dict, name: str) -> dict[str, dict]:
    """A data set's folds' fitted values as experiments/fidelity.json records them (fold name -> values)."""
    return {fold: f["values"] for fold, f in recorded["entries"].get(name, {}).get("folds", {}).items()}


def regressions(rows: list[Row], recorded_rows: list[dict]) -> list[str]:
    """What moved past its recorded figure plus its tolerance (``tolerance``), for people; empty if nothing did.

    Both figures of a row are held: the left-out one (fidelity) and the fitted-on one (a data set with nothing left out
    has only that). A row the record lacks, or a figure it had that is now missing, is a regression too: the record
    is re-made by ``python experiments/fidelity.py``.
    """
    by_key = {(r["entry"], r["gpu"], r["dataset"], r["metric"]): r for r in recorded_rows}
    out = []
    for row in rows:
        old = by_key.get(row.key)
        if old is None:
            out.append(f"{row.key}: not in the record (re-record with python experiments/fidelity.py)")
            continue
        for attr in ("left_out", "fitted_on"):
            now, then = getattr(row, attr), old[attr]
            if then is None:
                continue
            if now is None or not math.isfinite(now):
                out.append(f"{row.key} {attr}: recorded {then:.4g}, now none")
            elif abs(now) > abs(then) + tolerance(row.metric, then):
                out.append(f"{row.key} {attr}: {abs(now):.4g} against {abs(then):.4g} recorded (tolerance "
                           f"{tolerance(row.metric, then):.3g})")
    return out
