"""The checks of a transfer's arguments that need no model built (nor PyTorch imported), and its source table read:
freqopt.apply.transfer.transfer runs them first, and the command line runs them before it imports the modules that
load PyTorch, so that a wrong argument is refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from freqopt.budget import DEFAULT_CONFIDENCE
from freqopt.gpu.specs import GPUSpec
from freqopt.tables import ClockTable

__all__ = ["TransferArguments", "check_transfer_arguments"]


@dataclass(frozen=True)
class TransferArguments:
    """A transfer's arguments, checked (check_transfer_arguments).

    Attributes:
        table: the source clock table, read; source: where it was read from ("clock table" for one given as an
            object), for messages.
        spec: the GPU type: the one asked for, else the table's.
        max_slowdown: the budget, a fraction: the one given, else the table's.
        switch_s: the clock-switch latency in place of the GPU file's, s, or None.
        backend: the backend's name, checked, or the Backend given.
        confidence: the one-sided confidence at which every schedule's slowdown is held to the budget.
    """

    table: ClockTable
    source: str
    spec: GPUSpec
    max_slowdown: float
    switch_s: float | None
    backend: object
    confidence: float = DEFAULT_CONFIDENCE


def check_transfer_arguments(table, model, *, gpu=None, max_slowdown: float | str | None = None, backend="sim",
                             n_trials: int | None = None, micro_batch_size: int | None = None,
                             seq_len: int | None = None, n_heads: int | None = None,
                             vocab_multiple: int | None = None, layout=None,
                             switch_latency_ms: float | None = None,
                             confidence: float = DEFAULT_CONFIDENCE, storage: str | None = None) -> TransferArguments:  # fmt: skip
    """Check the arguments of freqopt.apply.transfer.transfer (see there) that need no model built, in the order it
    always had: the model's name and overrides (freqopt.resolve.check_workload_arguments), the GPU type, the
    switch latency, the table (read, not a pipeline's, searched on the GPU type), the budget, the confidence,
    n_trials, the backend and the storage URL (freqopt.storage_url.check_storage_url; opened later). What needs the model (heads dividing d_model and tp, an ``hf:PATH`` config) is checked
    when transfer resolves it.

    Raises:
        UnknownNameError: unknown model, GPU type or backend.
        ClockTableError: the table cannot be read, is a pipeline's, or was searched on another GPU type than ``gpu``.
        InvalidSettingError: a bad slowdown, confidence, override, layout, n_trials or switch_latency_ms.
        StorageError, MissingDependencyError: a storage URL that cannot be opened, or whose driver is missing.
    """
    from freqopt.budget import check_confidence, parse_slowdown
    from freqopt.errors import check_positive_int
    from freqopt.gpu.specs import check_switch_latency_ms, get_gpu
    from freqopt.resolve import check_workload_arguments, resolve_backend, resolve_gpu
    from freqopt.storage_url import check_storage_url
    from freqopt.tables import load_table

    check_workload_arguments(model, micro_batch_size=micro_batch_size, seq_len=seq_len, n_heads=n_heads,
                             vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    requested = resolve_gpu(gpu)  # an unknown name fails as such before the table is read
    switch_s = check_switch_latency_ms(switch_latency_ms)
    source = "clock table" if isinstance(table, ClockTable) else str(table)
    if not isinstance(table, ClockTable):
        table = load_table(table)
    table.refuse_pipeline("freqopt transfer", source=source)  # a plan per stage, not settings per tuning unit
    spec = requested or get_gpu(table.gpu)
    table.check_gpu(spec, source=source)
    slowdown = parse_slowdown(max_slowdown) if max_slowdown is not None else table.data["max_slowdown"]
    confidence = check_confidence(confidence)
    check_positive_int("n_trials", n_trials, optional=True)
    backend = resolve_backend(backend)
    check_storage_url(storage)
    return TransferArguments(table, source, spec, slowdown, switch_s, backend, confidence)
