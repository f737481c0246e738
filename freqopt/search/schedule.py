"""The phase-schedule granularity: the schedules a phase-switching runtime can apply, searched as such.

The finer granularities choose a setting per kernel class or pass; a runtime then realizes them per phase
(freqopt.search.realize), and on an H100, where a clock change lands 6-26 ms after it is asked for, most of
what they chose is lost. This granularity searches realizable schedules directly:

* **Blocks.** The iteration's phases (freqopt.workload.phases: module hooks and the optimizer step) are grouped into blocks
  of consecutive phases, each at least as long as the GPU's clock-switch latency (``GPUSpec.clock_switch_s``) and
  at least 1/``max_blocks`` of the iteration, cut within each pass so that forward, backward and optimizer start
  blocks of their own where they are long enough (phase_blocks). Kernel times are ``Backend.kernel_times_s`` at
  the default setting.
* **Look-ahead requests.** A runtime can ask for a block's setting only at a phase boundary, and the change lands
  one switch latency later; so each block's setting is requested at the last boundary at least one latency before
  the block starts (in the previous iteration for the first blocks), and lands about where the block begins. Blocks
  being at least one latency long, requests are at least about one latency apart and never queue behind each other
  in the runtime's controller thread.
* **In-situ studies.** Each block's (SM clock, memory clock) is searched by Bayesian optimization
  (freqopt.search.study.search_unit, Optuna's GPSampler) where every measurement is the *whole iteration* with only
  that block's setting changed from a reference schedule (the iteration level's validated clock, or the defaults),
  switch latency included. The power limit's sharing between neighbouring kernels, and the block's entry and exit
  switches, are in every measurement, which a kernel class measured alone cannot show. A study samples only where
  the iteration stays within its finalist slowdown (Optuna's constrained GPSampler): a block's changes worth
  having at a budget of a few percent lie there, and a trial far below it would only inform the fit's far end.
* **Allocation.** A block's options are its changes (time, energy) from the reference, fitted along the SM clock on
  all the block's readings (freqopt.search.smooth: each reading is the whole iteration, whose noise is as large as
  a block's change, and the fit pools them), at every supported clock within those measured, each taken one
  standard error worse; the MILP of freqopt.search.allocate picks one per block within the budget, and the budget
  is calibrated by validating the schedule (the whole iteration measured as the runtime applies it) until the
  validated slowdown meets the limit.
  Adjacent blocks that pick the same setting make no switch: a request is issued only where the setting changes,
  so the switches the schedule makes are exactly those the validation measures.

The resulting clock table (granularity "phase") lists, per block, its setting and the phase at whose start the
runtime requests it; DVFSRuntime applies it as it stands.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from freqopt.budget import first_confirmed
from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement
from freqopt.errors import InvalidSettingError
from freqopt.workload.kernels import Trace
from freqopt.workload.phases import phase_spans
from freqopt.search.allocate import allocate
from freqopt.search.phase_requests import (lookahead_requests, request_phases, requested_per_phase,
                                           requests_per_kernel, settings_per_phase)
from freqopt.search.smooth import smoothed_changes
from freqopt.search.study import UnitSearch, search_unit, setting_tag
from freqopt.search.units import TuningUnit

# The phase requests (lookahead_requests, settings_per_phase, request_phases, requested_per_phase) live in
# freqopt.search.phase_requests; they are re-exported here, where callers have always imported them from.
__all__ = ["PhaseBlock", "BlockModel", "phase_blocks", "lookahead_requests", "search_blocks", "request_schedule",
           "n_switches", "settings_per_phase", "PhaseScheduleResult", "search_phase_schedule", "request_phases",
           "requested_per_phase"]


@dataclass(frozen=True)
class PhaseBlock:
    """A run of consecutive phases that shares one setting.

    Attributes:
        name: "FIRST..LAST", the labels of its first and last phase (e.g. "fwd:h.0.ln_1..bwd:h.5.mlp").
        phases: indices of its phases in phase_spans(trace marks), ascending.
        kernel_indices: its phases' kernels, ascending.
        request: index of the phase at whose start the runtime asks for the block's setting (look-ahead by one
            switch latency; it may lie in an earlier block, or at the end of the previous iteration).
        duration_s: its kernels' time in ``kernel_time_s`` (the default setting, in a search), s.
    """

    name: str
    phases: tuple[int, ...]
    kernel_indices: tuple[int, ...]
    request: int
    duration_s: float

    @property
    def unit(self) -> TuningUnit:
        return TuningUnit(self.name, self.kernel_indices)


def phase_blocks(trace: Trace, kernel_time_s: np.ndarray, switch_s: float, *, max_blocks: int = 8) -> list[PhaseBlock]:
    """Group the trace's phases into blocks and place each block's look-ahead request (module docstring).

    Args:
        trace: the iteration; its phase marks are Trace.meta["marks"].
        kernel_time_s: every kernel's time, shape (K,), s (Backend.kernel_times_s at the default setting).
        switch_s: the GPU type's clock-switch latency, s (GPUSpec.clock_switch_s).
        max_blocks: at most about this many blocks (each at least 1/max_blocks of the iteration).

    Returns:
        The blocks in iteration order, covering every phase once; one block when the iteration is shorter than
        two switch latencies.
    """
    spans = phase_spans(trace.meta.get("marks", ()), len(trace))
    duration = np.array([float(np.sum(kernel_time_s[a:b])) for _, a, b in spans])  # (P,)
    start = np.cumsum(duration) - duration  # (P,)
    total = float(duration.sum())
    length = max(switch_s, total / max(1, max_blocks))
    # Cut each pass (forward, backward, optimizer) into about equal runs of at least `length`.
    groups: list[list[int]] = []
    for p, (_, a, _) in enumerate(spans):
        if groups and trace.kernels[spans[groups[-1][-1]][1]].pass_name == trace.kernels[a].pass_name:
            groups[-1].append(p)
        else:
            groups.append([p])
    blocks: list[list[int]] = []
    for group in groups:
        n = max(1, int(duration[group].sum() // length))
        target = duration[group].sum() / n
        cut, acc, cuts = [], 0.0, 0
        for p in group:
            cut.append(p)
            acc += duration[p]
            if acc >= target * (cuts + 1) - 1e-12 and p != group[-1]:
                blocks.append(cut)
                cut, cuts = [], cuts + 1
        if cut:
            blocks.append(cut)
    # A block shorter than one switch latency joins its predecessor (the first joins its successor).
    i = 0
    while len(blocks) > 1 and i < len(blocks):
        if duration[blocks[i]].sum() < switch_s:
            if i > 0:
                blocks[i - 1] += blocks.pop(i)
            else:
                first = blocks.pop(0)
                blocks[0] = first + blocks[0]
        else:
            i += 1
    requests = lookahead_requests(start, total, [b[0] for b in blocks], switch_s)
    out = []
    for b, request in zip(blocks, requests):
        kernels = tuple(k for p in b for k in range(spans[p][1], spans[p][2]))
        out.append(PhaseBlock(name=f"{spans[b[0]][0]}..{spans[b[-1]][0]}", phases=tuple(b), kernel_indices=kernels,
                              request=request, duration_s=float(duration[b].sum())))  # fmt: skip
    return out


def search_blocks(trace: Trace, backend: Backend, *, max_blocks: int = 8) -> list[PhaseBlock]:
    """The blocks a phase-level search on ``backend`` studies: phase_blocks with the kernels' times at the default
    setting (Backend.kernel_times_s) and the GPU type's clock-switch latency."""
    return phase_blocks(trace, backend.kernel_times_s(trace.kernels, DEFAULT_SETTING), backend.spec.clock_switch_s,
                        max_blocks=max_blocks)  # fmt: skip


def request_schedule(trace: Trace, blocks: Sequence[PhaseBlock], settings: Sequence[ClockSetting]) -> tuple:
    """The per-kernel schedule a runtime requests: from each block's request phase up to the next block's, the
    block's setting (cyclically over the iteration). Measured with switching (Backend.measure_schedule), each change
    lands one switch latency late, about where its block begins.

    Returns:
        One ClockSetting per kernel, shape (K,), constant within each phase.
    """
    spans = phase_spans(trace.meta.get("marks", ()), len(trace))
    return requests_per_kernel(spans, [(b.request, s) for b, s in zip(blocks, settings)])


@dataclass(frozen=True)
class PhaseScheduleResult:
    """What the phase-schedule search found.

    Attributes:
        blocks: the blocks, in iteration order.
        settings: the chosen setting of each block.
        reference: the schedule the in-situ studies changed one block of (one setting for every block).
        validated: the whole iteration measured with the chosen schedule as requested.
        predicted: the reference's measurement plus the chosen options' changes, each one standard error worse
            than its estimate (the bound the choice was made on: _block_choices).
        searches: each block's study outcome (options are whole-iteration measurements).
        n_switches: clock changes per iteration the schedule requests.
        model: what the search predicts for any setting per block (BlockModel), the prediction above among them.

    The studies' measurements and GPU-seconds are in ``searches``; the validations are counted by whoever owns
    ``measure`` (the runner's Validator).
    """

    blocks: tuple[PhaseBlock, ...]
    settings: tuple[ClockSetting, ...]
    reference: ClockSetting
    validated: Measurement
    predicted: Measurement
    searches: tuple[UnitSearch, ...]
    n_switches: int
    model: BlockModel | None = None


@dataclass(frozen=True)
class BlockModel:
    """The phase level's prediction of a schedule of one setting per block: the reference schedule's measurement
    plus each block's change at its setting (_block_choices: fitted on the block's in-situ readings, one standard
    error worse). A finer level whose settings a runtime realizes per phase runs such a schedule where its realized
    setting is constant on every block, and is predicted by it (runner._predicted_as_it_runs).

    Attributes:
        blocks: the blocks, in iteration order.
        reference: the reference schedule (every block at the reference setting) as validation measured it.
        changes: per block, setting -> (change of time_s, change of energy_j).
    """

    blocks: tuple[PhaseBlock, ...]
    reference: Measurement
    changes: tuple[dict, ...]

    def predict(self, settings: Sequence[ClockSetting]) -> Measurement | None:
        """The prediction for one setting per block (shape (B,)); None where a block has no option at its
        setting."""
        if any(s not in c for s, c in zip(settings, self.changes)):
            return None
        return Measurement(self.reference.time_s + sum(c[s][0] for s, c in zip(settings, self.changes)),
                           self.reference.energy_j + sum(c[s][1] for s, c in zip(settings, self.changes)))  # fmt: skip

    def settings_of(self, per_kernel: Sequence[ClockSetting]) -> tuple[ClockSetting, ...] | None:
        """The setting of each block in a per-kernel schedule (shape (K,)) as it lands, or None where some block
        runs more than one setting."""
        out = []
        for block in self.blocks:
            found = {per_kernel[k] for k in block.kernel_indices}
            if len(found) != 1:
                return None
            out.append(found.pop())
        return tuple(out)


class _InSitu:
    """The measuring side of one block's study: ``measure(kernels, setting)`` measures the whole iteration with
    the block at ``setting`` and the other blocks at the reference, switch latency included. Offers the part of
    the Backend interface search_unit uses (``spec``, ``measure``)."""

    def __init__(self, backend: Backend, trace: Trace, blocks: Sequence[PhaseBlock], index: int,
                 reference: ClockSetting, switching: bool = True):  # fmt: skip
        self.backend, self.trace, self.blocks, self.index, self.reference = backend, trace, blocks, index, reference
        self.switching = switching
        self.spec = backend.spec

    def measure(self, kernels, setting: ClockSetting, *, key: str = "", sample: int | None = None) -> Measurement:
        settings = [self.reference] * len(self.blocks)
        settings[self.index] = setting
        schedule = request_schedule(self.trace, self.blocks, settings)
        return self.backend.measure_schedule(self.trace.kernels, schedule, key=key, switching=self.switching,
                                             sample=sample)


def n_switches(settings: Sequence[ClockSetting]) -> int:
    """Changes of setting per iteration in a per-kernel schedule (shape (K,)), read cyclically: iterations repeat,
    so a last kernel's setting other than the first's is one more switch."""
    return 0 if len(set(settings)) <= 1 else sum(1 for i in range(len(settings)) if settings[i] != settings[i - 1])


def search_phase_schedule(
    trace: Trace, backend: Backend, *, measure: Callable[..., Measurement], baseline: Measurement,
    max_slowdown: float, reference: ClockSetting = DEFAULT_SETTING, study_prefix: str, storage=None,
    n_trials: int = 18, finalist_repeats: int = 4, seed: int = 0, max_blocks: int = 8, rounds: int = 8,
    patience: int | None = None,
    switching: bool = True, on_block: Callable[[int, int], None] | None = None, mem_clock_mhz: int | None = None,
    confirm: Callable[[Measurement], Measurement] | None = None,
    deliverable: Callable[[Measurement], bool] | None = None,
) -> PhaseScheduleResult:  # fmt: skip
    """Search a realizable phase schedule (module docstring).

    Args:
        trace, backend: the iteration and the GPU to measure on.
        measure: measures a per-kernel request schedule (shape (K,)) as the runtime applies it, switching
            included, as ``measure(schedule, key, limit_s=...)``, reading it again while its mean is too near the
            time limit to call: the search's validator (freqopt.search.validate.Validator.requests). A schedule
            meets the limit where its ``time_bound_s`` (the upper confidence bound of its time) does.
        baseline: the whole iteration at default settings, as ``measure`` measured it.
        max_slowdown: the budget, a fraction of the baseline's time.
        reference: the setting of every other block while one block is studied (the iteration level's choice).
        study_prefix: the search's study-name prefix; each block's study is named from it, the block and the
            reference, so a resumed search reads its studies back.
        storage: Optuna storage (None: in memory).
        n_trials, finalist_repeats, seed, patience: as search_unit's.
        max_blocks: see phase_blocks.
        rounds: allocations validated at most.
        switching: measure with each change of setting landing one switch latency late (as ``measure`` does);
            False only for a free-switching comparison.
        on_block: called as on_block(blocks_done, n_blocks) after each block's study (progress).
        mem_clock_mhz: the job's memory clock, where the GPU cannot change it while a job runs
            (GPUSpec.mem_clock_runtime): each block then searches the SM clock alone at it (the reference's);
            None: the memory clock is searched too.
        confirm: reads a chosen schedule's measurement again afresh (Validator.confirm): the schedules that met
            the limit are confirmed, least energy first (up to CONFIRM_TRIES), and the first whose fresh readings
            meet it too is the result, with their figures; None: the choice stands on its own readings.
        deliverable: whether a measured schedule's clock switches can be issued by one runtime thread
            (Validator.deliverable); a schedule that cannot is not kept. None: every one can.

    Returns:
        PhaseScheduleResult; its schedule is never worse than the reference or the defaults, whichever validated
        better within the budget.

    Raises:
        InvalidSettingError: max_slowdown outside [0, 1).
    """
    if not 0.0 <= max_slowdown < 1.0:
        raise InvalidSettingError(f"max_slowdown must be in [0, 1), not {max_slowdown!r}")
    blocks = tuple(search_blocks(trace, backend, max_blocks=max_blocks))
    finalist_slowdown = 1.5 * max_slowdown + 0.005  # where each block's study samples and repeats its finalists
    searches = _block_studies(trace, backend, blocks, reference, switching, study_prefix=study_prefix, storage=storage,
                              n_trials=n_trials, finalist_repeats=finalist_repeats,
                              finalist_slowdown=finalist_slowdown, seed=seed, mem_clock_mhz=mem_clock_mhz,
                              patience=patience, on_block=on_block)  # fmt: skip

    # Each block's options as changes from the reference schedule, each taken one standard error worse in time and
    # in energy than its estimate, so that a lucky reading does not win the allocation; the prediction sums the
    # same bounds. The means of the options the MILP picked as best-looking are optimistic by about that much (the
    # optimizer's curse: Smith and Winkler 2006, Management Science 52(3)); on gpt3-xl on the RTX 3080 Ti (1 %,
    # 100 ms switches, seeds 0-5) the means predicted up to 1.4 points more than validation measured, the bounds at
    # most 0.5. The estimates along the SM clock are a fit on all the block's readings (_block_choices).
    window = 1.0 + 2 * finalist_slowdown  # the fit's window, relative to each block's own default (_block_choices)
    choices = [_block_choices(s, reference, backend.spec.sm_clocks_mhz, s.default.time_s * window) for s in searches]
    deltas = [[(dt, de) for _, dt, de in c] for c in choices]
    limit_s = (1.0 + max_slowdown) * baseline.time_s
    uniform = measure(request_schedule(trace, blocks, [reference] * len(blocks)), "phase", limit_s=limit_s)
    accepted = [(tuple([DEFAULT_SETTING] * len(blocks)), baseline)]  # the defaults meet any budget
    ok = deliverable or (lambda m: True)
    if uniform.time_bound_s <= limit_s and uniform.energy_j < baseline.energy_j:
        accepted.append((tuple([reference] * len(blocks)), uniform))

    budget = limit_s - uniform.time_s  # the time the blocks' changes may add, s
    accepted += _validated_allocations(trace, blocks, choices, deltas, measure, budget, limit_s, baseline,
                                       max_slowdown, rounds, confirm, ok)  # fmt: skip
    best_settings, best = _confirmed(accepted, confirm, baseline, limit_s)
    model = BlockModel(blocks, uniform, tuple({s: (dt, de) for s, dt, de in c} for c in choices))
    predicted = model.predict(best_settings)
    if best_settings == tuple([DEFAULT_SETTING] * len(blocks)):
        predicted = baseline
    return PhaseScheduleResult(
        blocks=blocks, settings=best_settings, reference=reference, validated=best, predicted=predicted,
        searches=tuple(searches), n_switches=n_switches(best_settings), model=model,
    )  # fmt: skip


def _block_studies(trace: Trace, backend: Backend, blocks: tuple[PhaseBlock, ...], reference: ClockSetting,
                   switching: bool, *, study_prefix: str, storage, n_trials: int, finalist_repeats: int,
                   finalist_slowdown: float, seed: int, mem_clock_mhz: int | None, patience: int | None,
                   on_block: Callable[[int, int], None] | None) -> list[UnitSearch]:  # fmt: skip
    """Each block's in-situ study (module docstring), in block order: search_unit measuring the whole iteration
    with the block changed from the reference (_InSitu), named from the search's ``study_prefix``, the block and the
    reference so that a resumed search reads it back; the arguments as search_phase_schedule's."""
    ref_tag = setting_tag(reference)
    searches = []
    for i, block in enumerate(blocks):
        digest = hashlib.sha1(f"{block.name}|{block.request}|{ref_tag}".encode()).hexdigest()[:10]
        warm = [] if reference == DEFAULT_SETTING else [reference]
        searches.append(search_unit(
            _InSitu(backend, trace, blocks, i, reference, switching), (), name=f"phase {block.name} ref {ref_tag}",
            study_name=f"{study_prefix}-phase-{digest}", storage=storage, n_trials=n_trials,
            finalist_repeats=finalist_repeats, finalist_slowdown=finalist_slowdown, seed=seed,
            warm_start=warm, mem_clock_mhz=mem_clock_mhz, patience=patience, constrained=True,
        ))  # fmt: skip
        if on_block:
            on_block(i + 1, len(blocks))
    return searches


def _validated_allocations(trace: Trace, blocks: tuple[PhaseBlock, ...], choices: list, deltas: list,
                           measure: Callable[..., Measurement], budget: float, limit_s: float, baseline: Measurement,
                           max_slowdown: float, rounds: int, confirm, ok: Callable[[Measurement], bool]) -> list:  # fmt: skip
    """The budget calibrated by validation (module docstring, "Allocation"): up to ``rounds`` allocations of
    ``budget`` (the time the blocks' changes may add, s) over the blocks' options (``choices``: per block, (setting,
    change of time_s, change of energy_j); ``deltas`` the same changes alone), each schedule measured as the
    runtime requests it, the budget then moved by the validated overshoot (bisected between the largest budget
    that met ``limit_s`` and the smallest that broke it) until a schedule uses it to within a tenth of the slowdown
    budget. Returns the schedules that met ``limit_s``, saved energy and are ``ok`` (deliverable), as (settings,
    validated), in the order measured."""
    accepted = []
    meets, breaks = None, None
    for _ in range(rounds):
        try:
            picks = allocate(deltas, budget)
        except InvalidSettingError:
            meets = budget
            budget = budget + 0.001 * baseline.time_s if breaks is None else 0.5 * (budget + breaks)
            continue
        settings = tuple(cs[j][0] for cs, j in zip(choices, picks))
        validated = measure(request_schedule(trace, blocks, settings), "phase", limit_s=limit_s)
        if validated.time_bound_s <= limit_s and validated.energy_j < baseline.energy_j and ok(validated):
            accepted.append((settings, validated))
        over = validated.time_bound_s - limit_s  # its upper confidence bound's overshoot
        if -0.1 * max(max_slowdown, 0.001) * baseline.time_s <= over <= 0 and confirm is not None:
            over = max(over, confirm(validated).time_bound_s - limit_s)  # near the edge: its fresh readings' too
        if -0.1 * max(max_slowdown, 0.001) * baseline.time_s <= over <= 0:
            break  # uses the budget to within a tenth
        step = budget - over
        if over <= 0:
            meets = budget if meets is None else max(meets, budget)
        else:  # every budget down to the picks' own added time picks them again: go below it
            used = sum(deltas[b][j][0] for b, j in enumerate(picks))
            breaks = min(budget, used) if breaks is None else min(breaks, budget, used)
            step = min(step, used - 1e-6 * baseline.time_s)
        if meets is not None and breaks is not None:
            if breaks - meets <= 1e-4 * baseline.time_s:
                break
            if not meets < step < breaks:
                step = 0.5 * (meets + breaks)
        budget = step
    return accepted


def _confirmed(accepted: list, confirm, baseline: Measurement, limit_s: float) -> tuple:
    """Of ``accepted`` (settings, validated), the defaults first: the least validated energy without
    ``confirm``; with it, the least whose fresh readings (``confirm(validated)``) also meet ``limit_s`` and save
    energy, with those readings' figures (freqopt.budget.first_confirmed); the defaults where none is
    confirmed."""
    defaults, *chosen = accepted
    chosen = sorted({a[0]: a for a in chosen}.values(), key=lambda a: a[1].energy_j)
    if confirm is None:
        return chosen[0] if chosen else defaults
    hit = first_confirmed(chosen, lambda a: confirm(a[1]),
                          lambda m: m.time_bound_s <= limit_s and m.energy_j < baseline.energy_j)
    return defaults if hit is None else (hit[0][0], hit[1])


def _block_choices(search: UnitSearch, reference: ClockSetting, sm_clocks_mhz: Sequence[int],
                   max_time_s: float = np.inf) -> list[tuple[ClockSetting, float, float]]:  # fmt: skip
    """A block's options for the allocator as (setting, change of time_s, change of energy_j) from ``reference``,
    each change one standard error worse than its estimate: along the SM clock (of the reference's memory clock,
    or the one measured most), at every supported clock within the measured ones, the fit of
    freqopt.search.smooth.smoothed_changes on all the block's readings; elsewhere (the defaults, other memory
    clocks, or a block measured at fewer than three clocks) each setting's own mean against the reference's, for
    the settings read more than once (the study's finalists), the reference and the defaults. ``max_time_s``:
    the fit's window (smoothed_changes): twice the studies' finalist slowdown."""
    readings = search.readings or search.options
    sd_t, sd_e = _pooled_sd(readings)
    out = [(c.setting, c.time_s + c.time_se_s, c.energy_j + c.energy_se_j)
           for c in smoothed_changes(readings, reference, sm_clocks_mhz, sd_t, sd_e, max_time_s)]
    fitted = {c[0] for c in out}
    ref = next(o for o in search.options if o.setting == reference)
    for o in search.options:
        if o.setting in fitted or not (o.n_samples > 1 or o.setting in (reference, DEFAULT_SETTING)):
            continue
        se = np.sqrt(1 / o.n_samples + 1 / ref.n_samples) * (o is not ref)
        out.append((o.setting, o.time_s - ref.time_s + sd_t * se, o.energy_j - ref.energy_j + sd_e * se))
    return out


def _pooled_sd(options) -> tuple[float, float]:
    """The within-setting standard deviation of a study's time and energy readings, pooled over its options
    measured more than once (each weighted by its degrees of freedom); (0, 0) when none was."""
    dof = sum(o.n_samples - 1 for o in options)
    if dof == 0:
        return 0.0, 0.0
    var_t = sum((o.n_samples - 1) * o.time_sd_s**2 for o in options) / dof
    var_e = sum((o.n_samples - 1) * o.energy_sd_j**2 for o in options) / dof
    return float(np.sqrt(var_t)), float(np.sqrt(var_e))

