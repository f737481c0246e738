"""Parallelism layouts: data-parallel (dp) and tensor-parallel (tp) degrees, as DeepSpeed runs them.

A layout of ``dp=N,tp=M`` runs on N x M GPUs. Tensor-parallel ranks are the innermost (neighbouring GPUs of one
node, as Megatron-LM and DeepSpeed place them, Narayanan et al. 2021 section 3.3), so a tp group spans nodes only
when M exceeds the GPUs per node, and a dp group (stride M) spans nodes when N x M does.

    >>> parse_layout("dp=8,tp=4")
    Layout(dp=8, tp=4)
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
    """Data-parallel degree ``dp`` and tensor-parallel degree ``tp`` (ranks per model replica).

    Attributes:
        dp: replicas of the model, each on its own micro-batch; gradients all-reduced in buckets (ZeRO stages 0-1).
        tp: ranks sharing one replica, AutoTP style: q/k/v/up projections column-parallel, o/down row-parallel.
        bucket_elements: gradient elements per data-parallel all-reduce (DeepSpeed's default 5e8).
    """

    dp: int = 1
    tp: int = 1
    bucket_elements: int = DEEPSPEED_BUCKET_ELEMENTS

    def __post_init__(self):
        for name, value in (("dp", self.dp), ("tp", self.tp), ("bucket_elements", self.bucket_elements)):
            if not isinstance(value, int) or value < 1:
                raise InvalidSettingError(f"layout {name} must be a positive integer, not {value!r}", argument="layout")

    def __repr__(self) -> str:  # keeps study names and tables short
        extra = "" if self.bucket_elements == DEEPSPEED_BUCKET_ELEMENTS else f", bucket_elements={self.bucket_elements}"
        return f"Layout(dp={self.dp}, tp={self.tp}{extra})"

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp}"

    @property
    def world_size(self) -> int:
        """GPUs the layout runs on."""
        return self.dp * self.tp

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
        return {"dp": self.dp, "tp": self.tp}


SINGLE_GPU = Layout()

_PART = re.compile(r"\s*(dp|tp|pp)\s*=\s*([^,]*)\s*")


def parse_layout(text: str | None) -> Layout:
    """A layout from ``"dp=8,tp=4"``, ``"tp=2"`` or ``"dp=8"`` (missing degrees are 1; None or "" is one GPU).

    Raises:
        InvalidSettingError: not of that form, a degree that is not a positive integer, a repeated degree, or
            pipeline parallelism (pp), which freqopt does not model.
    """
    if text is None or not str(text).strip():
        return SINGLE_GPU
    degrees: dict[str, int] = {}
    for part in str(text).split(","):
        match = _PART.fullmatch(part)
        if not match:
            raise InvalidSettingError(f"layout {text!r} is not a layout; write it like dp=8,tp=4 (dp and tp, "
                                      "each a positive integer)", argument="layout")  # fmt: skip
        key, value = match.group(1), match.group(2).strip()
        if key == "pp":
            raise InvalidSettingError(f"layout {text!r}: pipeline parallelism is not supported; use dp and tp",
                                      argument="layout")  # fmt: skip
        if key in degrees:
            raise InvalidSettingError(f"layout {text!r} gives {key} twice; write it like dp=8,tp=4", argument="layout")
        if not value.isdigit() or int(value) < 1:
            raise InvalidSettingError(f"layout {text!r}: {key} must be a positive integer, not {value!r}",
                                      argument="layout")  # fmt: skip
        degrees[key] = int(value)
    return Layout(**degrees)
