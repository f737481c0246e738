"""The checks of a training run's arguments that need no model built (nor PyTorch imported), and its table read:
freqopt.apply.train.plan_training runs them first, and the command line runs them before it imports the modules that
load PyTorch, so that a wrong argument is refused at once. Also the check that this torch can
train on a device (check_training_device), which imports PyTorch when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass

from freqopt.errors import InvalidSettingError, MissingDependencyError, install_hint
from freqopt.gpu.specs import GPUSpec
from freqopt.tables import ClockTable
from freqopt.workload.layout import Layout

__all__ = ["TrainingArguments", "check_training_arguments", "check_training_device", "refuse_another_models_table",
           "refuse_pipeline_options", "check_layout_packages"]


@dataclass(frozen=True)
class TrainingArguments:
    """A training run's arguments, checked (check_training_arguments).

    Attributes:
        table: the clock table, read, or None; source: where it was read from, for messages.
        gpu: the GPU type asked for, else the table's, else None.
        switch_s: the clock-switch latency in place of the GPU file's, s, or None.
    """

    table: ClockTable | None
    source: str
    gpu: GPUSpec | None
    switch_s: float | None


def check_training_arguments(model, *, table=None, steps: int = 8, backend: str = "sim", gpu=None,
                             compare: bool = False, read_only: bool = False, micro_batch_size: int | None = None,
                             seq_len: int | None = None, n_heads: int | None = None,
                             vocab_multiple: int | None = None, layout=None, switch_latency_ms: float | None = None,
                             micro_batches: int | None = None, partition_method: str | None = None,
                             small_step: bool = False) -> TrainingArguments:  # fmt: skip
    """Check the arguments of freqopt.apply.train.plan_training (see there) that need no model built, in the order it
    always had: the model's name and overrides (freqopt.resolve.check_workload_arguments), the backend, steps,
    small_step off the simulated backend, the switch latency, compare without a table and read_only with one, the table
    (read), micro_batches or partition_method without pipeline stages where the layout is known before the table is
    (given, or a Workload's, or no table to take it from), micro_batches a positive integer where given, the packages
    the layout (given, else the table's) trains with (check_layout_packages), and the GPU type (given, else the
    table's). What needs the model (heads, the table's workload, a pipeline's stages, the device
    and the host's memory) is checked when plan_training resolves it.

    Raises:
        UnknownNameError: unknown model, backend or GPU type (the table's included).
        ClockTableError: the table cannot be read.
        InvalidSettingError: a bad override, layout, steps or switch_latency_ms; small_step on another backend than
            "sim"; compare without a table; read_only with one; micro_batches or partition_method without pipeline
            stages; micro_batches not a positive integer.
        MissingDependencyError: a tensor-parallel layout without transformers (check_layout_packages).
    """
    from freqopt.errors import check_positive_int
    from freqopt.gpu.backends import check_backend
    from freqopt.gpu.specs import check_switch_latency_ms
    from freqopt.resolve import check_workload_arguments, resolve_gpu
    from freqopt.tables import load_table

    given_layout = check_workload_arguments(model, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                            n_heads=n_heads, vocab_multiple=vocab_multiple, layout=layout)  # fmt: skip
    check_backend(backend)
    check_positive_int("steps", steps)
    if small_step and backend != "sim":
        raise InvalidSettingError(f"small_step applies to the simulated backend, whose step figures come from the "
                                  f"trace; on {backend!r} the step measured is the step run",
                                  argument="small_step")  # fmt: skip
    switch_s = check_switch_latency_ms(switch_latency_ms)
    if compare and table is None:
        raise InvalidSettingError("compare needs a table: it alternates steps with and without the table",
                                  argument="compare")  # fmt: skip
    if read_only and table is not None:
        raise InvalidSettingError("read_only cannot apply a table (that changes clocks); drop one of them",
                                  argument="read_only")  # fmt: skip
    if table is not None and not isinstance(table, ClockTable):
        table = load_table(table)
    source = "clock table" if table is None else table.source or "the clock table"
    if layout is not None or not isinstance(model, str) or table is None:  # no table's layout can replace it
        refuse_pipeline_options(given_layout, micro_batches, partition_method)
    check_positive_int("micro_batches", micro_batches, optional=True)
    if table is not None:
        refuse_another_models_table(table, model, source, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                    n_heads=n_heads, layout=given_layout if layout is not None else None)  # fmt: skip
    if layout is None and isinstance(model, str) and table is not None:  # the table's layout is the one trained
        found = table.workload.get("layout") or {}
        check_layout_packages(Layout(found.get("dp", 1), found.get("tp", 1), pp=found.get("pp", 1)))
    else:
        check_layout_packages(given_layout)
    requested = resolve_gpu(gpu) if gpu is not None else (resolve_gpu(table.gpu) if table is not None else None)
    return TrainingArguments(table, source, requested, switch_s)


def refuse_another_models_table(table: ClockTable, model, source: str, *, micro_batch_size: int | None,
                                seq_len: int | None, n_heads: int | None, layout: Layout | None) -> None:
    """Refuse, before the model is built (PyTorch imported: seconds), a one-GPU-layout table that certainly does not
    fit the workload plan_training would build (each size given, else the table's): one found for another built-in
    model than ``model`` (a built-in name), or for ``model`` with another micro-batch, sequence length or layout
    than one given. ClockTable.check_workload says so in the words and with the ``freqopt transfer`` command it uses
    once the model is built. Anything else (an ``hf:PATH``, a Workload, a pipeline's table, an n_heads given) is
    left to that later check.

    Raises:
        TableWorkloadError: as above.
    """
    from freqopt.workload.model_names import MODEL_NAMES

    found = table.workload
    if not (isinstance(model, str) and model in MODEL_NAMES and found.get("model") in MODEL_NAMES) or \
            n_heads is not None or table.is_pipeline or (layout is not None and layout.is_pipeline):  # fmt: skip
        return
    target = {"model": model, "n_layers": None, "d_model": None, "n_heads": None,
              "seq_len": seq_len if seq_len is not None else found.get("seq_len"),
              "micro_batch_size": micro_batch_size if micro_batch_size is not None else found.get("micro_batch_size"),
              "layout": layout.as_dict() if layout is not None else found.get("layout")}  # fmt: skip
    if found["model"] == model:
        # the same model: its sizes are the table's (plan_training takes the table's heads where none is given)
        target.update({k: found.get(k) for k in ("n_layers", "d_model", "n_heads")})
    table.check_workload(target, source=source, model=model)


def refuse_pipeline_options(layout: Layout, micro_batches: int | None, partition_method: str | None) -> None:
    """Refuse a pipeline's options (micro_batches, partition_method) on a layout without pipeline stages.

    Raises:
        InvalidSettingError: either given and ``layout`` has pp 1.
    """
    if not layout.is_pipeline and (micro_batches is not None or partition_method is not None):
        name = "micro_batches" if micro_batches is not None else "partition_method"
        raise InvalidSettingError(f"{name} applies to a pipeline layout (pp > 1), not {layout}",
                                  argument=name)  # fmt: skip


def check_layout_packages(layout: Layout) -> None:
    """Refuse a layout whose training needs a package that is not installed, before any model is built or rank
    started: tensor parallelism (tp > 1) runs DeepSpeed's AutoTP, which imports transformers while it picks its
    linear-layer policies (AutoTP.update_linear_policies, deepspeed/module_inject/auto_tp.py), freqopt's own models
    included.

    Raises:
        MissingDependencyError: tp > 1 and transformers cannot be found (importlib.util.find_spec); the message says
            how to install it (pyproject.toml's ``tp`` extra).
    """
    import importlib.util

    if layout.tp > 1 and importlib.util.find_spec("transformers") is None:
        raise MissingDependencyError(f"layout {layout}: tensor parallelism (tp > 1) trains through DeepSpeed's AutoTP, "
                                     f"which needs transformers, not installed: {install_hint('tp')}",
                                     argument="layout")  # fmt: skip


def check_training_device(device: str) -> None:
    """Check that this torch can train on ``device`` ("cpu", "cuda", "cuda:N").

    Raises:
        InvalidSettingError: ``device`` is CUDA and this torch is a CPU build (``torch.version.cuda`` is None) or
            sees no CUDA device; the message says what to install or to train on "cpu".
    """
    if not str(device).startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise InvalidSettingError(
            f"device {device!r}: torch {torch.__version__} is a CPU build; install a CUDA build of torch (on Linux "
            "x86-64 a plain `pip install 'torch>=2.4,<2.14'` from PyPI is one) or train on device 'cpu'"
        )
    if not torch.cuda.is_available():
        raise InvalidSettingError(
            f"device {device!r}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; check the "
            "NVIDIA driver and CUDA_VISIBLE_DEVICES, or train on device 'cpu'"
        )
