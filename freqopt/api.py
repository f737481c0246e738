"""freqopt's one-call search: ``freqopt.search(model_or_trace, max_slowdown=...)``.

    >>> import freqopt
    >>> result = freqopt.search("gpt3-small", max_slowdown="1%", seq_len=256, micro_batch_size=1,
    ...                         granularity="pass", n_trials=6)  # doctest: +SKIP
    >>> result.summary()["results"]["pass"]["energy_saved_pct"]  # doctest: +SKIP

Every argument is checked before any work is done or any file is written; errors are freqopt.errors types whose
one-line messages begin with the argument's name (``n_trials``, ``out``), which they carry as ``.argument``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from freqopt.budget import DEFAULT_CONFIDENCE, check_confidence
from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.output import check_writable_dir, check_writable_file, open_output
from freqopt.storage_url import check_storage_url

# The output checks (check_writable_dir, check_writable_file, open_output) live in freqopt.output; they are
# re-exported here, where callers have always imported them from.
__all__ = ["search", "search_pipeline", "SearchStart", "check_writable_dir", "check_writable_file", "open_output"]


@dataclass(frozen=True)
class SearchStart:
    """What a search is about to do, passed to ``on_start`` once the iteration is traced and before any
    measurement.

    Attributes:
        trace: the iteration's kernels (freqopt.workload.trace.Trace).
        spec: the GPU type measured on (freqopt.gpu.specs.GPUSpec).
        backend: the backend's name ("sim", "nvml") or class name.
        study_name: the search's name in the storage: ``freqopt worker --storage URL --study NAME`` joins it.
        storage: the Optuna storage URL (None: in memory, so no worker can join).
        n_units: tuning units over all granularities (each is reported once through ``on_unit``).
    """

    trace: object = field(repr=False)
    spec: object = field(repr=False)
    backend: str
    study_name: str
    storage: str | None
    n_units: int


def _granularities(granularity: str | Sequence[str]) -> tuple[str, ...]:
    """The granularities to search, coarse to fine, from "all", one name or a sequence of names.

    Raises:
        UnknownNameError: a name that is not a granularity (the message lists them).
        InvalidSettingError: an empty sequence, "all" among other names, or something that is not a name.
    """
    from freqopt.granularities import GRANULARITIES, check_granularity

    choices = ", ".join(GRANULARITIES)
    if isinstance(granularity, str):
        return GRANULARITIES if granularity == "all" else (check_granularity(granularity),)
    if not isinstance(granularity, Sequence):
        raise InvalidSettingError(f"granularity must be 'all', a name or a sequence of names ({choices}), not "
                                  f"{type(granularity).__name__}", argument="granularity")  # fmt: skip
    if "all" in granularity and len(granularity) > 1:
        raise InvalidSettingError(f"granularity 'all' stands alone; give it or some of {choices}", argument="granularity")
    if list(granularity) == ["all"]:
        return GRANULARITIES
    chosen = {check_granularity(g) for g in granularity}
    if not chosen:
        raise InvalidSettingError(f"granularity is empty; give 'all' or some of {choices}", argument="granularity")
    return tuple(g for g in GRANULARITIES if g in chosen)  # coarse to fine: finer ones start from coarser ones


def search(
    model_or_trace,
    *,
    max_slowdown: float | str,
    gpu=None,
    granularity: str | Sequence[str] = "all",
    backend="sim",
    storage: str | None = None,
    out: str | Path | None = None,
    seed: int = 0,
    n_trials: int | None = None,
    n_jobs: int = 1,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    n_heads: int | None = None,
    vocab_multiple: int | None = None,
    layout=None,
    switch_latency_ms: float | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    host=None,
    on_unit: Callable[[str, int, int], None] | None = None,
    on_start: Callable[[SearchStart], None] | None = None,
    verbose: bool = False,
):
    """Search clock settings that cut the energy of one training iteration within a slowdown budget.

    Traces one training iteration (for a model name), runs the per-unit Optuna studies of each granularity,
    allocates the budget over the units and validates each schedule by measuring the whole iteration
    (freqopt.search.run_search).

    Args:
        model_or_trace: a model name (freqopt.workload.models.list_models), a Workload, or a Trace already traced.
        max_slowdown: allowed slowdown of the iteration: a fraction (0.01) or a string ("1%", "0.01").
        gpu: GPU type name or GPUSpec; default h100-sxm on the simulated GPU, the real GPU's type on nvml.
        granularity: "all", one of power-cap, iteration, pass, kernel, phase, or a sequence of them (searched
            coarse to fine, whatever their order).
        backend: "sim" (the simulated GPU), "nvml" (the first visible real GPU; needs root to set clocks) or a
            Backend object (then used as given and not closed here).
        storage: Optuna storage URL (freqopt.search.storage.open_storage); default journal:OUT/freqopt.journal
            with ``out`` (freqopt.search.storage.default_storage_url), else in memory.
        out: folder for the clock tables (STEM-GRANULARITY.json and .csv, STEM naming the model, GPU, layout,
            budget and seed: freqopt.tables.table_stem) and the default storage; None writes no file.
        seed: seeds the samplers and the simulated GPU's noise.
        n_trials: trials per tuning unit; default 14, plus 4 per memory clock beyond the first (SearchConfig).
        n_jobs: processes that run tuning units in parallel; simulated GPU only (one ``freqopt worker`` per
            real GPU instead).
        micro_batch_size, seq_len, n_heads, vocab_multiple, layout: get_workload overrides, model names only.
        switch_latency_ms: the GPU's effective clock-switch latency, ms, in place of its file's (GPUSpec.clock_switch_s,
            search_spaces/*.toml [model] clock_switch_ms): what the schedules are sized for and realized with. 0:
            switches land at once. Default: the file's value.
        confidence: the one-sided confidence, in [0.5, 1), at which each schedule's slowdown is held to the budget:
            the upper confidence bound of its slowdown, from readings paired with the defaults', must be within it
            (freqopt.search.validate.Validator; 0.5: the paired mean alone).
        host: the host that issues the kernels on the simulated GPU, in place of the GPU file's (freqopt.gpu.host: a
            HostSpec, or a host's name or TOML path; ``freqopt gpus`` lists the hosts): a launch-bound step waits
            on it. Default: the GPU file's host (h100-node, the measured H100's server, unless it names another).
        on_unit: called as on_unit(granularity, units_done, units_total) after each tuning unit's study.
        on_start: called once with a SearchStart after tracing, before the first measurement.
        verbose: let Optuna log at INFO (a line per study it creates); by default its studies run at WARNING,
            and the caller's Optuna verbosity is restored on return (freqopt.search.study.optuna_logging).

    Returns:
        SearchResult: ``.summary()`` (the JSON document), ``.table(granularity)``, ``.write_tables(folder)``;
        ``.table_paths`` lists the tables written under ``out``, and ``.figure_paths`` the PNGs beside them
        (freqopt.search.plots; written when matplotlib is installed, the ``plots`` extra). ``.n_new_measurements``
        counts the measurements this call took, ``.n_stored_measurements`` those a resumed search read back from
        ``storage``.

    Raises:
        UnknownNameError: unknown model, GPU type, host, backend or granularity.
        InvalidSettingError: a bad slowdown, override, layout, granularity list, n_trials, n_jobs,
            switch_latency_ms, confidence or host file, or n_jobs > 1 on a real GPU; a pipeline layout (pp > 1): search it with
            freqopt.search_pipeline; on a real GPU, a model whose step does not fit its memory
            (freqopt.workload.memory.check_step_fits, as profile checks it).
        OutputError: ``out`` is a file or cannot be made or written, or holds a table of another search (another
            micro-batch, sequence length or backend) under a name this search writes (refused before measuring).
        StorageError: ``storage`` cannot be opened (nothing is made under ``out`` then).
        NVMLError, GPUPermissionError: the real GPU cannot be opened or set (freqopt.gpu.nvml).

    Warns:
        GPUMemoryWarning: on the simulated GPU, a model whose step does not fit one GPU's memory: searched all the
            same, as a what-if.
    """
    from freqopt.gpu.backends.base import switch_latency
    from freqopt.resolve import open_backend, resolve_trace_or_workload

    # Every check before any work or any file is touched; those that need no model built (nor PyTorch imported)
    # first, so that a wrong argument is refused at once.
    checked = _check_arguments(model_or_trace, max_slowdown=max_slowdown, gpu=gpu, granularity=granularity,
                               backend=backend, seed=seed, n_trials=n_trials, n_jobs=n_jobs,
                               switch_latency_ms=switch_latency_ms, confidence=confidence, host=host)  # fmt: skip
    check_storage_url(storage)  # refused before the model is traced; opened (and made) later, by open_output
    trace, workload = resolve_trace_or_workload(model_or_trace, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                                n_heads=n_heads, vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    if workload.layout.is_pipeline:
        raise InvalidSettingError(f"layout {workload.layout}: freqopt.search searches one GPU's iteration; search a "
                                  "pipeline (pp > 1) with freqopt.search_pipeline(..., micro_batches=M)",
                                  argument="layout")  # fmt: skip
    from freqopt.search.study import optuna_logging
    from freqopt.workload.memory import check_step_fits

    # A real GPU is opened (and its permissions checked) before anything is written.
    measuring, opened = open_backend(checked.backend, checked.gpu, seed=seed)
    try:
        if trace is None:  # a model (not a step traced already): its memory per rank, as profile checks it
            check_step_fits(workload, measuring.spec, simulated=measuring.simulated, what="searched anyway")
        # The override replaces the GPU file's latency for this search (and its storage name).
        with switch_latency(measuring, checked.switch_s), optuna_logging(verbose):
            return _search(trace, workload, measuring, checked.slowdown, checked.granularities, storage, out, seed,
                           n_trials, n_jobs, on_unit, on_start, checked.confidence)  # fmt: skip
    finally:
        if opened:
            measuring.close()  # a real GPU goes back to the clocks and power limit it was found with


@dataclass(frozen=True)
class _Checked:
    """search's arguments that need no model built, checked (_check_arguments).

    Attributes:
        slowdown: the budget, a fraction of the iteration's time.
        confidence: the one-sided confidence the slowdown is held to the budget at.
        gpu: the GPU type asked for (GPUSpec), or None for the backend's default.
        backend: the backend's name ("sim", "nvml") or the Backend object given.
        granularities: the granularities to search, coarse to fine.
        switch_s: the clock-switch latency in place of the GPU file's, s; None: the file's.
    """

    slowdown: float
    confidence: float
    gpu: object = field(repr=False)
    backend: object
    granularities: tuple[str, ...]
    switch_s: float | None


def _check_arguments(model_or_trace, *, max_slowdown, gpu, granularity, backend, seed, n_trials, n_jobs,
                     switch_latency_ms, confidence, host=None) -> _Checked:  # fmt: skip
    """search's checks that need no model built (nor PyTorch imported), in the order search makes them: the
    model's name where one is given, and every argument but the model's overrides (search's Raises)."""
    from freqopt.resolve import resolve_backend, resolve_gpu
    from freqopt.budget import parse_slowdown
    from freqopt.gpu.specs import check_switch_latency_ms
    from freqopt.workload.model_names import check_model_name

    slowdown = parse_slowdown(max_slowdown)
    confidence = check_confidence(confidence)
    if isinstance(model_or_trace, str):
        check_model_name(model_or_trace)
    requested = resolve_gpu(gpu, host=host)
    backend = resolve_backend(backend)
    granularities = _granularities(granularity)
    check_positive_int("n_trials", n_trials, optional=True)
    check_positive_int("n_jobs", n_jobs)
    if n_jobs > 1 and not (backend == "sim" or (not isinstance(backend, str) and backend.simulated)):
        raise InvalidSettingError("n_jobs > 1 applies to the simulated GPU (backend 'sim'); with real GPUs start "
                                  "one `freqopt worker` per GPU against the search's storage", argument="n_jobs")  # fmt: skip
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidSettingError(f"seed must be an integer, not {seed!r}", argument="seed")
    switch_s = check_switch_latency_ms(switch_latency_ms)
    return _Checked(slowdown, confidence, requested, backend, granularities, switch_s)


def _n_units(trace, granularity: str, backend, config, one_clock: bool = False) -> int:
    """Tuning units of one granularity as the search runs them (unit_studies.run_unit_studies): the kernel level's
    families of classes (search_units), the phase level's blocks from the backend's kernel times; where one clock
    is all a runtime can realize (``one_clock``: runner.one_clock_reason), none for the phase level and the pass
    and kernel levels' units searched for their free-switching figure only (free_switching.FREE_SWITCHING_SEARCHED)."""
    from freqopt.search.free_switching import FREE_SWITCHING_SEARCHED
    from freqopt.search.schedule import search_blocks
    from freqopt.search.units import search_units

    searched_free = granularity in FREE_SWITCHING_SEARCHED and config.free_switching
    if one_clock and granularity in ("pass", "kernel", "phase") and not searched_free:
        return 0
    if granularity != "phase":
        return len(search_units(trace, granularity, config.share_classes and granularity == "kernel"))
    return len(search_blocks(trace, backend, max_blocks=config.max_phase_blocks))


def _check_table_targets(workload, gpu: str, backend: str, slowdown: float, granularities, seed: int,
                         out: Path) -> dict[str, Path]:  # fmt: skip
    """Refuse, before any measurement, a search whose tables would replace another search's in ``out``
    (freqopt.tables.check_table_target): the tables' names carry the model, GPU, layout, budget and seed, but not
    the micro-batch, sequence length or backend. Returns granularity -> the table's path."""
    from freqopt.tables import check_table_target, table_identity, table_stem, workload_doc

    stem = table_stem(workload, gpu, slowdown, seed)
    paths = {g: out / f"{stem}-{g}.json" for g in granularities}
    for g, path in paths.items():
        check_table_target(path, table_identity({
            "gpu": {"name": gpu}, "workload": workload_doc(workload), "granularity": g,
            "max_slowdown": slowdown, "provenance": {"backend": backend, "seed": seed}}))  # fmt: skip
    return paths


def _search(trace, workload, measuring, slowdown, granularities, storage, out, seed, n_trials, n_jobs, on_unit,
            on_start, confidence):  # fmt: skip
    from freqopt.search import SearchConfig, run_search
    from freqopt.gpu.backends.base import DEFAULT_SETTING
    from freqopt.search.runner import levels_to_run, one_clock_reason
    from freqopt.search.storage import study_prefix
    from freqopt.workload.trace import trace_training_iteration

    out, storage = open_output(out, storage)  # a bad URL fails here, before any work or any folder is made
    counts = {"n_trials_1d": n_trials, "n_trials_2d": n_trials} if n_trials else {}
    config = SearchConfig(max_slowdown=slowdown, granularities=granularities, seed=seed, storage=storage,
                          n_jobs=n_jobs, confidence=confidence, **counts)  # fmt: skip
    if trace is None:
        trace = trace_training_iteration(workload)
    if out is not None:  # another search's tables under the names this one writes: refused before any measurement
        _check_table_targets(trace.workload, measuring.spec.name, measuring.name, slowdown, granularities, seed, out)
    if on_start is not None:
        levels = levels_to_run(granularities, config.switching)
        one_clock = config.switching and "iteration" in levels and bool(one_clock_reason(
            trace, measuring, config, measuring.kernel_times_s(trace.kernels, DEFAULT_SETTING)))  # fmt: skip
        on_start(SearchStart(trace, measuring.spec, measuring.name, study_prefix(trace, measuring.spec, seed), storage,
                             sum(_n_units(trace, g, measuring, config, one_clock) for g in levels)))  # fmt: skip
    result = run_search(trace, measuring, config, on_unit=on_unit)  # its backend_name is measuring.name
    if out is not None:
        from freqopt.search.plots import have_matplotlib, write_search_figures

        result = replace(result, table_paths=result.write_tables(out))
        if have_matplotlib():  # the plots extra
            result = replace(result, figure_paths=write_search_figures(result, out))
    return result


def search_pipeline(
    model,
    *,
    max_slowdown: float | str,
    micro_batches: int,
    gpu=None,
    layout=None,
    granularities: str | Sequence[str] = "all",
    partition_method: str = "parameters",
    backend="sim",
    seed: int = 0,
    storage: str | None = None,
    out: str | Path | None = None,
    n_trials: int | None = None,
    validation_repeats: int | None = None,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    n_heads: int | None = None,
    vocab_multiple: int | None = None,
    switch_latency_ms: float | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    host=None,
    on_unit: Callable[[str, int, int], None] | None = None,
    on_start: Callable[[SearchStart], None] | None = None,
    verbose: bool = False,
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
):
    """Search the clocks of a pipeline-parallel training iteration (a layout with pp > 1) on the simulated pipeline:
    one SM clock for the whole iteration ("iteration"), one per stage never switching ("stage") and one per
    instruction ("instruction": each stage's forward and backward fronts by Bayesian search, then one plan over
    DeepSpeed's 1F1B schedule; the stage level plans on the same fronts), each validated on
    the noisy simulated pipeline with clock-switch latency (freqopt.pipeline.search).

    Args:
        model: a built-in model name (freqopt.workload.models.list_models) or a Workload whose layout has pp > 1.
        max_slowdown: allowed slowdown of the iteration: a fraction (0.01) or a string ("1%").
        micro_batches: M, micro-batches per iteration (DeepSpeed's gradient_accumulation_steps).
        gpu: GPU type name or GPUSpec of every stage; default h100-sxm.
        layout: "dp=1,tp=8,pp=8" or a Layout (model names only); pp must be above 1.
        granularities: "all" (iteration, stage and instruction), "iteration", "stage", "instruction" or a sequence
            of them.
        partition_method: DeepSpeed's PipelineModule partition: "parameters" (its default), "uniform",
            "type:REGEX".
        backend: "sim" only: the pipeline is simulated (a real pipeline is planned from a measured stage profile,
            freqopt.plan_pipeline).
        seed: seeds the samplers and the simulated GPUs' noise.
        storage: Optuna storage URL; default journal:OUT/freqopt.journal with ``out``, else in memory.
        out: folder for the default storage and the instruction level's pipeline clock table,
            ``STEM-instruction.json`` and ``.csv`` (freqopt.tables.table_stem; written where a plan won its
            validation); None writes no file.
        n_trials: trials per study (each instruction's and the iteration level's); default 14.
        validation_repeats: measurements of the whole iteration averaged per schedule; default 4.
        micro_batch_size, seq_len, n_heads, vocab_multiple: get_workload overrides, model names only.
        switch_latency_ms: the GPU's clock-switch latency (ms) in place of its file's.
        confidence: the one-sided confidence, in [0.5, 1), at which each level's slowdown is held to the budget
            (freqopt.pipeline.validate.PipelineValidator).
        on_unit: called as on_unit(granularity, done, total) after each study.
        on_start: called once with a SearchStart (its ``trace`` the first stage's StageTrace) before measuring.
        verbose: Optuna's own INFO log lines.
        schedule: the pipeline schedule: "1f1b" (DeepSpeed's, the default) or one of torch.distributed.pipelining's
            (freqopt.pipeline.dag.SCHEDULES; their per-GPU orders are the classes' own); those that run several
            model stages per GPU trace the model as pp x that many stages, and the zero-bubble ones run each
            backward as its input and weight gradients. Only 1F1B writes a pipeline clock table so far.
        virtual_stages: model stages per GPU for the looped schedules (default 2).

    Returns:
        PipelineSearchResult: ``.summary()`` (the JSON document), ``.pipeline_doc()`` (what a pipeline clock
        table holds), ``.profile``, ``.plan``, ``.levels``.

    Raises:
        UnknownNameError: unknown model, GPU type or granularity (power-cap, pass, kernel and phase are not
            searched on a pipeline).
        InvalidSettingError: a bad slowdown, override, layout (pp must be above 1), micro_batches, n_trials,
            validation_repeats, partition_method, seed, switch_latency_ms or confidence; a backend other than
            "sim".
        OutputError, StorageError: as freqopt.search.
    """
    from freqopt.budget import parse_slowdown
    from freqopt.gpu.specs import DEFAULT_GPU, check_switch_latency_ms, get_gpu
    from freqopt.granularities import pipeline_granularities
    from freqopt.pipeline.dag import schedule_dag
    from freqopt.resolve import check_workload_arguments, resolve_gpu

    # The checks that need no model built first, before the modules that load PyTorch and Optuna.
    slowdown = parse_slowdown(max_slowdown, allow_zero=True)  # slack off the critical path saves at no slowdown
    confidence = check_confidence(confidence)
    _check_micro_batches(micro_batches)
    sizes = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
             "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    parsed = check_workload_arguments(model, **sizes)
    if not parsed.is_pipeline:
        raise InvalidSettingError(f"layout {parsed} has no pipeline stages; give pp > 1 (e.g. pp=4), or "
                                  "search one GPU's iteration with freqopt.search", argument="layout")  # fmt: skip
    spec = resolve_gpu(gpu) or get_gpu(DEFAULT_GPU)
    levels = pipeline_granularities(granularities)
    _check_pipeline_run(backend, n_trials, validation_repeats, seed)
    switch_s = check_switch_latency_ms(switch_latency_ms)
    if switch_s is not None:
        spec = spec.with_switch_latency(switch_s)
    dag = schedule_dag(schedule, parsed.pp, micro_batches, virtual_stages=virtual_stages)  # checks both
    check_storage_url(storage)
    from freqopt.pipeline.config import PipelineSearchConfig
    from freqopt.pipeline.result import result_pipeline_table
    from freqopt.pipeline.search import fronts_prefix, run_pipeline_search
    from freqopt.resolve import resolve_workload
    from freqopt.search.storage import open_storage
    from freqopt.search.study import optuna_logging
    from freqopt.workload.pipeline_trace import trace_pipeline_stages

    workload = resolve_workload(model, **sizes)
    stage_traces = trace_pipeline_stages(workload, partition_method=partition_method,
                                         model_stages=dag.stages)  # checks the partition  # fmt: skip
    out, storage = open_output(out, storage)
    counts = {"n_trials": n_trials} if n_trials else {}
    if validation_repeats:
        counts["validation_repeats"] = validation_repeats
    config = PipelineSearchConfig(max_slowdown=slowdown, granularities=levels, seed=seed, storage=storage,
                                  confidence=confidence, schedule=schedule, virtual_stages=virtual_stages,
                                  **counts)  # fmt: skip
    table_path = None
    if out is not None and "instruction" in levels and schedule == "1f1b":  # another search's table: refused first
        table_path = _check_table_targets(workload, spec.name, "sim", slowdown, ("instruction",), seed,
                                          out)["instruction"]  # fmt: skip
    if on_start is not None:
        prefix = fronts_prefix(workload, spec, partition_method, seed, dag.stages)  # the name workers join by
        fronts = "stage" in levels or "instruction" in levels  # both plan on the instructions' fronts
        on_start(SearchStart(stage_traces[0], spec, "sim", prefix, storage, _pipeline_n_units(levels, dag, fronts)))
    with optuna_logging(verbose):
        result = run_pipeline_search(stage_traces, spec, micro_batches, config, storage=open_storage(storage),
                                     on_unit=on_unit, partition_method=partition_method)  # fmt: skip
    table = result_pipeline_table(result) if table_path is not None else None
    if table is not None:
        result = _with_pipeline_table(result, table, table_path)
    return result


def _check_micro_batches(micro_batches) -> None:
    """search_pipeline's ``micro_batches``: given, and a positive integer.

    Raises:
        InvalidSettingError: it is None, or not a positive integer.
    """
    if micro_batches is None:
        raise InvalidSettingError("micro_batches is required for a pipeline: the micro-batches per iteration "
                                  "(DeepSpeed's gradient_accumulation_steps), e.g. 8", argument="micro_batches")  # fmt: skip
    check_positive_int("micro_batches", micro_batches)


def _check_pipeline_run(backend, n_trials: int | None, validation_repeats: int | None, seed) -> None:
    """search_pipeline's checks of how the pipeline is searched, in its order: on the simulated GPU, with positive
    counts (None: the defaults) and an integer seed.

    Raises:
        InvalidSettingError: a backend other than "sim", a count that is not a positive integer, or a seed that is
            not an integer.
    """
    if backend != "sim":
        raise InvalidSettingError(f"backend {backend!r}: a pipeline is searched on the simulated GPU (backend "
                                  "'sim'); plan a measured pipeline with freqopt.plan_pipeline", argument="backend")  # fmt: skip
    check_positive_int("n_trials", n_trials, optional=True)
    check_positive_int("validation_repeats", validation_repeats, optional=True)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidSettingError(f"seed must be an integer, not {seed!r}", argument="seed")


def _pipeline_n_units(levels, dag, fronts: bool) -> int:
    """The studies a pipeline search of ``levels`` runs on schedule ``dag``: the iteration level's one, and with
    ``fronts`` (the stage or instruction level) one per stage and kind of instruction."""
    return (1 if "iteration" in levels else 0) + (len({(i.stage, i.kind) for i in dag.instructions})
                                                  if fronts else 0)  # fmt: skip


def _with_pipeline_table(result, table, table_path: Path):
    """``result`` with its pipeline clock table written to ``table_path`` (JSON) and beside it as .csv."""
    from freqopt.tables import write_table, write_table_csv

    write_table(table, table_path)
    write_table_csv(table, table_path.with_suffix(".csv"))
    return replace(result, table_path=table_path)
