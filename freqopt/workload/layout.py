"""Parallelism layouts: data-parallel (dp), tensor-parallel (tp) and pipeline-parallel (pp) degrees, as DeepSpeed
runs them.

A layout of ``dp=N,tp=M,pp=P`` runs on N x M x P GPUs. Tensor-parallel ranks are the innermost (neighbouring GPUs
of one node, as Megatron-LM and DeepSpeed place them, Narayanan et al. 2021 section 3.3), so a tp group spans nodes
only when M exceeds the GPUs per node, and a dp group (stride M) spans nodes when N x M does. Pipeline stages are
the outermost axis (DeepSpeed's ``PipeModelDataParallelTopology``: axes pipe, data, model), so neighbouring stages
are N x M global ranks apart. How a model's layers are split into stages is freqopt.workload.pipeline_partition's.

A layout without pipeline parallelism (pp=1) reads, prints and serializes as it did before pp existed (study names,
table stems and recorded searches depend on it); pp appears only when it is above 1.

    >>> parse_layout("dp=8,tp=4")
    Layout(dp=8, tp=4)
    >>> parse_layout("dp=2,tp=2,pp=4")
    Layout(dp=2, tp=2, pp=4)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from freqopt.errors import InvalidSettingError

__all__ = ["Layout", "SINGLE_GPU", "parse_layout", "DEEPSPEED_BUCKET_ELEMENTS"]

# DeepSpeed's default reduce_bucket_size / allreduce_bucket_size: 5e8 elements per gradient all-reduce
# (DeepSpeed configuration docs, "zero_optimization.reduce_bucket_size"; engine allreduce_bucket_size).
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class Layout:
    """Data-parallel degree ``dp``, tensor-parallel degree ``tp`` and pipeline-parallel degree ``pp``.

    Attributes:
        dp: replicas of the model, each on its own micro-batch; gradients all-reduced in buckets (ZeRO stages 0-1).
        tp: ranks sharing one replica, AutoTP style: q/k/v/up projections column-parallel, o/down row-parallel.
        bucket_elements: gradient elements per data-parallel all-reduce (DeepSpeed's default 5e8).
        pp: pipeline stages, each holding consecutive layers of the model (DeepSpeed's PipelineModule; the
            partition: freqopt.workload.pipeline_partition). Last, so that positional ``Layout(dp, tp, bucket)``
            means what it did before pp existed.
    """

    dp: int = 1
    tp: int = 1
    bucket_elements: int = DEEPSPEED_BUCKET_ELEMENTS
    pp: int = 1

    def __post_init__(self):
        for name, value in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), ("bucket_elements", self.bucket_elements)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidSettingError(f"layout {name} must be a positive integer, not {value!r}", argument="layout")

    def __repr__(self) -> str:  # keeps study names and tables short; pp=1 prints as before pp existed
        pp = f", pp={self.pp}" if self.pp > 1 else ""
        extra = "" if self.bucket_elements == DEEPSPEED_BUCKET_ELEMENTS else f", bucket_elements={self.bucket_elements}"
        return f"Layout(dp={self.dp}, tp={self.tp}{pp}{extra})"

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp}" + (f",pp={self.pp}" if self.pp > 1 else "")

    @property
    def world_size(self) -> int:
        """GPUs the layout runs on: dp x tp x pp."""
        return self.dp * self.tp * self.pp

    @property
    def is_pipeline(self) -> bool:
        """Whether the layout has more than one pipeline stage."""
        return self.pp > 1

    def refuse_pipeline(self, what: str) -> None:
        """Refuse a pipeline layout (pp > 1) where ``what`` (e.g. "the search") cannot handle one yet, naming what
        works today; nothing that ignores pp may run on one silently.

        Raises:
            InvalidSettingError: pp > 1 (argument "layout").
        """
        if self.pp > 1:
            raise InvalidSettingError(
                f"layout {self}: {what} does not handle pipelines (pp > 1) yet; plan a pipeline from a measured "
                "stage profile with freqopt.plan_pipeline (freqopt plan --stage-profile), trace its stages with "
                "freqopt.workload.pipeline_trace.trace_pipeline_stages, or use dp and tp here", argument="layout",
            )

    @property
    def is_single_gpu(self) -> bool:
        return self.world_size == 1

    def check_model(self, model: str, n_heads: int) -> None:
        """Refuse a tensor-parallel degree that does not divide the model's attention heads.

        Raises:
            InvalidSettingError: tp does not divide n_heads.
        """
        if n_heads % self.tp:
            divisors = [d for d in range(1, n_heads + 1) if n_heads % d == 0]
            raise InvalidSettingError(
                f"layout tp={self.tp} does not divide the {n_heads} attention heads of {model}; "
                f"choose tp from {', '.join(map(str, divisors))}", argument="layout",
            )

    def as_dict(self) -> dict[str, int]:
        """The degrees as a table records them: ``{"dp", "tp"}``, and ``"pp"`` only when above 1."""
        return {"dp": self.dp, "tp": self.tp, **({"pp": self.pp} if self.pp > 1 else {})}

    def to_kwargs(self) -> dict[str, int]:
        """Every field, as ``dataclasses.asdict`` gave them before pp existed, with ``"pp"`` only when above 1:
        ``Layout(**layout.to_kwargs()) == layout`` (a search job's record, freqopt.search.workers)."""
        out = {"dp": self.dp, "tp": self.tp, "bucket_elements": self.bucket_elements}
        return {**out, **({"pp": self.pp} if self.pp > 1 else {})}


SINGLE_GPU = Layout()

_PART = re.compile(r"\s*(dp|tp|pp)\s*=\s*([^,]*)\s*")


def parse_layout(text: str | None) -> Layout:
    """A layout from ``"dp=8,tp=4"``, ``"tp=2"``, ``"dp=8"`` or ``"dp=2,tp=2,pp=4"`` (degrees in any order;
    missing degrees are 1; None or "" is one GPU).

    Raises:
        InvalidSettingError: not of that form, a degree that is not a positive integer, or a repeated degree
            (argument "layout").
    """
    if text is None or not str(text).strip():
        return SINGLE_GPU
    degrees: dict[str, int] = {}
    for part in str(text).split(","):
        match = _PART.fullmatch(part)
        if not match:
            raise InvalidSettingError(f"layout {text!r} is not a layout; write it like dp=8,tp=4 or dp=2,tp=2,pp=4 "
                                      "(dp, tp and pp, each a positive integer)", argument="layout")  # fmt: skip
        key, value = match.group(1), match.group(2).strip()
        if key in degrees:
            raise InvalidSettingError(f"layout {text!r} gives {key} twice; write it like dp=2,tp=2,pp=4",
                                      argument="layout")  # fmt: skip
        if not value.isdigit() or int(value) < 1:
            raise InvalidSettingError(f"layout {text!r}: {key} must be a positive integer, not {value!r}",
                                      argument="layout")  # fmt: skip
        degrees[key] = int(value)
    return Layout(**degrees)
