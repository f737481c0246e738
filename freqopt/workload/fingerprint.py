"""Which module a trace belongs to: a fingerprint of the module's structure, recorded when it is traced and
checked when a DVFS runtime is attached to a running job.

The runtime follows a job by counting the phase marks the tracer recorded (freqopt.workload.phases), and applies the
settings a table found for the traced kernels. Attached to another module (another model, another size, another
tensor-parallel degree) it would still count marks, silently applying settings searched for other kernels. So the
tracer records ``module_fingerprint(model)`` in ``Trace.meta["module_fingerprint"]``, and the runtime refuses a
module whose fingerprint differs (``check_trace_module``).

The fingerprint hashes (SHA-256, first 16 hex digits) two things that do not depend on device, dtype or values:

* the phase modules' names in forward order (``phase_modules``: the names the marks carry);
* the sorted (name, shape) list of the parameters one rank holds. Tensor-parallel layers are compared by their
  rank-local shapes (the tracer traces one rank, ``shard_tensor_parallel``; DeepSpeed's AutoTP ``LinearLayer`` and
  ``LinearAllreduce`` keep the names ``weight`` and ``bias``), and ZeRO stage 3 parameters by ``ds_shape``, the
  shape DeepSpeed records before it partitions a parameter across data-parallel ranks.

Wrappers are looked through (``unwrap_module``): a DeepSpeed engine, DistributedDataParallel or DataParallel
(``.module``) and ``torch.compile`` (``._orig_mod``).
"""

from __future__ import annotations

import hashlib
import json
import warnings

import torch.nn as nn

from freqopt.errors import TraceMismatchError
from freqopt.workload.phases import phase_modules

__all__ = ["FINGERPRINT_KEY", "TraceFingerprintWarning", "unwrap_module", "module_fingerprint", "check_trace_module"]

FINGERPRINT_KEY = "module_fingerprint"

_WRAPPERS = ("DeepSpeedEngine", "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


class TraceFingerprintWarning(UserWarning):
    """A trace recorded without a module fingerprint (by a freqopt older than the check): it cannot be checked."""


def unwrap_module(model: nn.Module) -> nn.Module:
    """The module a wrapper trains: ``.module`` of a DeepSpeed engine, DDP, DataParallel or FSDP (by class name, so
    that DeepSpeed need not be imported), ``._orig_mod`` of a ``torch.compile``d module; any other module itself."""
    for _ in range(8):  # wrappers nest at most a few deep (a compiled DDP module)
        names = {cls.__name__ for cls in type(model).__mro__}
        inner = getattr(model, "_orig_mod", None) if "OptimizedModule" in names else None
        if inner is None and names & set(_WRAPPERS):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def module_fingerprint(model: nn.Module) -> str:
    """The structure fingerprint of ``model`` (module docstring): 16 hex digits.

    Args:
        model: the module (or a wrapper of it, see ``unwrap_module``), on any device, including "meta".
    """
    model = unwrap_module(model)
    phases = [name for name, _ in phase_modules(model)]
    params = sorted((name, [int(n) for n in getattr(p, "ds_shape", None) or p.shape])
                    for name, p in model.named_parameters())  # fmt: skip
    text = json.dumps({"phases": phases, "parameters": params}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_trace_module(trace, model: nn.Module) -> None:
    """Refuse ``model`` if ``trace`` was recorded from a module of another structure.

    Args:
        trace: a freqopt.workload.trace.Trace; one without a fingerprint (recorded before freqopt kept one) is not checked,
            with a ``TraceFingerprintWarning``.
        model: the module the runtime is attached to (or a wrapper of it).

    Raises:
        TraceMismatchError: the fingerprints differ; the message names the traced workload and both parameter counts.
    """
    expected = trace.meta.get(FINGERPRINT_KEY)
    workload = trace.workload
    if expected is None:
        warnings.warn(
            f"the trace of {workload.model} carries no module fingerprint, so freqopt cannot check that it belongs to "
            "the module it is attached to; trace the workload again (freqopt.workload.trace.trace_iteration) to have it checked",
            TraceFingerprintWarning, stacklevel=3,
        )  # fmt: skip
        return
    if module_fingerprint(model) == expected:
        return
    module = unwrap_module(model)
    n_params = sum(p.numel() if not hasattr(p, "ds_numel") else p.ds_numel for p in module.parameters())
    traced = trace.meta.get("n_params")
    traced = f"{traced:,}" if isinstance(traced, int) else "an unknown number of"
    layout = "/".join(f"{k}={v}" for k, v in trace.meta.get("layout", {}).items() if k in ("dp", "tp"))
    raise TraceMismatchError(
        f"the trace is of {workload.model} ({layout or 'one GPU'}; {traced} parameters per rank) but the module "
        f"{type(module).__name__} has {n_params:,} parameters or other phase modules; trace the model you train "
        "(trace_iteration of its workload: same config and tensor-parallel degree) and pass that trace"
    )
