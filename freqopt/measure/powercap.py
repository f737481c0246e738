"""Power capping alone, as McDonald et al. 2022 (arXiv 2205.09646) measured it: one iteration at each power
limit, relative to the GPU's default limit (freqopt.search.powercap.sweep_power_caps does the measuring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from freqopt.errors import InvalidSettingError

__all__ = ["parse_caps", "powercap", "PowercapReport"]


def parse_caps(text: str) -> list[float]:
    """Power limits in watts from "100,150,200".

    Raises:
        InvalidSettingError: not a comma-separated list of positive numbers.
    """
    try:
        caps = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        caps = []
    if not caps or any(not (c > 0) or c != c for c in caps):
        raise InvalidSettingError(f"caps {text!r} is not a list of watts; write it like 100,150,200,250", argument="caps")
    return caps


@dataclass(frozen=True)
class PowercapReport:
    """The sweep's result.

    Attributes:
        workload: what ran; mode: "train" or "inference"; spec: the GPU type (GPUSpec).
        baseline: the iteration at the default power limit (Measurement, s and J per iteration).
        points: one freqopt.search.powercap.CapPoint per cap, in the order given.
    """

    workload: object = field(repr=False)
    mode: str
    spec: object = field(repr=False)
    baseline: object
    points: tuple

    def summary(self) -> dict:
        """{"baseline_power_limit_w", "caps": [{power_limit_w, time_rel, energy_rel, avg_power_w,
        power_limit_met}]} (power_limit_met: CapPoint's, false where the GPU ran above the limit)."""
        return {"baseline_power_limit_w": self.spec.power_limit_default_w,
                "caps": [{"power_limit_w": p.power_limit_w, "time_rel": p.time_rel, "energy_rel": p.energy_rel,
                          "avg_power_w": p.avg_power_w, "power_limit_met": p.power_limit_met}
                         for p in self.points]}  # fmt: skip


def powercap(model, *, gpu=None, caps: str | Sequence[float] | None = None, mode: str = "train", backend="sim",
             seed: int = 0, host_gap_ms: float = 0.0, micro_batch_size: int | None = None, seq_len: int | None = None,
             n_heads: int | None = None, vocab_multiple: int | None = None, layout=None) -> PowercapReport:  # fmt: skip
    """Measure one iteration of ``model`` at the GPU's default power limit and at each of ``caps``.

    Args:
        model: a model name (with the get_workload overrides below) or a Workload.
        gpu: GPU type name or GPUSpec; default h100-sxm (nvml: the real GPU's).
        caps: power limits in W, a sequence or text "100,150,200"; default four from the GPU's lowest limit to
            its default (freqopt.search.powercap.default_caps). A cap at the default limit is the baseline's
            measurement (relative figures 1), not measured twice.
        mode: "train" (one training step) or "inference" (one forward batch).
        backend: "sim" or "nvml"; closed when done (a real GPU goes back to the limit it was found with).
        seed: seed of the simulated noise.
        host_gap_ms: host time per iteration in which the GPU idles (data loading, Python), ms; not negative.

    Raises:
        UnknownNameError: unknown model, GPU type or backend.
        InvalidSettingError: a bad override, layout or mode, caps that are not watts or lie outside the GPU's
            power-limit range, or a negative host_gap_ms.
        NVMLError, GPUPermissionError: the real GPU cannot be opened or set.
    """
    from freqopt.gpu.specs import DEFAULT_GPU, get_gpu
    from freqopt.resolve import check_workload_arguments, resolve_backend, resolve_gpu, resolve_workload

    # The checks that need no model built first, before the modules that load PyTorch and Optuna.
    sizes = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
             "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    check_workload_arguments(model, **sizes)
    spec = resolve_gpu(gpu) or get_gpu(DEFAULT_GPU)
    if caps is not None:
        caps_w = parse_caps(caps if isinstance(caps, str) else ",".join(str(c) for c in caps))
        for cap in caps_w:
            spec.check_power_limit(cap)
    if host_gap_ms < 0:
        raise InvalidSettingError(f"host_gap_ms must not be negative, not {host_gap_ms:g}", argument="host_gap_ms")
    backend = resolve_backend(backend)
    from freqopt.gpu.backends import get_backend
    from freqopt.search.powercap import default_caps, sweep_power_caps
    from freqopt.search.study import optuna_logging
    from freqopt.workload.trace import MODES, trace_iteration

    workload = resolve_workload(model, **sizes)
    if mode not in MODES:
        raise InvalidSettingError(f"mode {mode!r} is not a mode; choose train or inference", argument="mode")
    if caps is None:
        caps_w = default_caps(spec)
    measuring = get_backend(backend, spec, seed=seed) if isinstance(backend, str) else backend
    try:
        trace = trace_iteration(workload, mode)
        with optuna_logging(False):  # its measurement log is a study; no line per study
            base, points = sweep_power_caps(trace, measuring, caps_w, host_gap_s=host_gap_ms / 1000)
    finally:
        if isinstance(backend, str):
            measuring.close()  # a real GPU goes back to the power limit it was found with
    return PowercapReport(workload, mode, measuring.spec, base, tuple(points))
