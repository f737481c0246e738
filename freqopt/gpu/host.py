"""The host that issues a training step's kernels: its CPU, Python and PyTorch, apart from the GPU they drive.

A GPU runs a kernel no earlier than the host issues it, so a step whose kernels are short waits on the host
(freqopt.gpu.backends.physics.host_gaps): gpt3-small at micro-batch 1 keeps a real H100 busy 10 ms of a 27.6 ms step.
How fast the host issues is a property of the machine and the framework, not of the GPU: the same GPU type in
another server waits on it for another time. So every GPU type's step is simulated with a host (search_spaces/hosts/,
one TOML file each), named by the GPU file's ``[host] name`` (default ``DEFAULT_HOST``) and replaceable per run
(``GPUSpec.with_host``; ``--host`` on ``freqopt search`` and ``freqopt profile``).

A host is four figures, in us per kernel: ``issue_us`` and ``gemm_issue_us``, what a replay loop's host spends to
issue one kernel (Python, dispatcher, launch; cuBLAS's heuristics for a GEMM); and ``step_us`` by pass (forward,
backward, optimizer), what a training step's host spends on top (autograd, module calls, the optimizer's Python).

To state your own: measure a step on your machine (``freqopt profile --backend nvml`` prints its host time per
kernel where the GPU waits on it), then ``HostSpec.scaled`` a shipped host by the ratio, or copy a host file and
edit it (``freqopt gpus`` lists the hosts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.gpu.search_spaces import search_spaces_dir, tomllib

__all__ = ["HostSpec", "DEFAULT_HOST", "PASSES", "get_host", "list_hosts", "hosts_dir"]

DEFAULT_HOST = "h100-node"
PASSES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class HostSpec:
    """One host: what it spends to issue a kernel, us.

    Attributes:
        name: freqopt's name for it (the file's stem, ``h100-node``), or what ``scaled`` named it.
        issue_us: a replay loop's host time per kernel, us (GEMMs: ``gemm_issue_us``).
        gemm_issue_us: the same for a GEMM, us.
        step_us: pass (forward, backward, optimizer) -> a training step's host time per kernel on top of the
            replay's, us.
        description: the machine, for people.
        sources: where each figure comes from.
    """

    name: str
    issue_us: float
    gemm_issue_us: float
    step_us: dict[str, float] = field(default_factory=dict)
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def scaled(self, factor: float, *, name: str | None = None) -> HostSpec:
        """This host ``factor`` times slower (every figure multiplied): a machine measured against this one.

        Raises:
            InvalidSettingError: ``factor`` is not a finite number > 0.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
            raise InvalidSettingError(f"a host's scale factor must be a finite number > 0, not {factor!r}")
        return dataclasses.replace(
            self, name=name or f"{self.name} x{factor:g}", issue_us=self.issue_us * factor,
            gemm_issue_us=self.gemm_issue_us * factor, step_us={p: v * factor for p, v in self.step_us.items()},
            description=f"{self.description} ({factor:g}x its times)".strip(),
        )  # fmt: skip


def hosts_dir() -> Path:
    """Folder of the host TOML files: search_spaces/hosts/ beside the GPU files (search_spaces_dir)."""
    return search_spaces_dir() / "hosts"


def list_hosts() -> list[str]:
    """Names of the known hosts, sorted."""
    return sorted(p.stem for p in hosts_dir().glob("*.toml"))


@lru_cache(maxsize=None)
def get_host(name: str) -> HostSpec:
    """Load a host by name (the TOML file stem, case-insensitive) or by a path to a TOML file.

    Raises:
        UnknownNameError: no such host; the message lists the known ones.
        InvalidSettingError: the file is not valid TOML or lacks a figure; one line naming the file.
    """
    if not isinstance(name, str) or not name:
        raise InvalidSettingError(f"host must be a host's name or a path to a host TOML file, not {name!r}")
    path = Path(name)
    if path.suffix != ".toml" or not path.is_file():
        path = hosts_dir() / f"{name.lower()}.toml"
    if not path.is_file():
        raise UnknownNameError(f"unknown host {name!r}; known hosts: {', '.join(list_hosts())} (files in {hosts_dir()})")
    fix = f"copy a host file of {hosts_dir()} and edit it"
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise InvalidSettingError(f"{path} is not valid TOML ({e}); {fix}") from None
    try:
        host, step = data["host"], data.get("step_us", {})
        values = [float(host["issue_us"]), float(host["gemm_issue_us"]), *(float(step.get(p, 0.0)) for p in PASSES)]
    except KeyError as e:
        raise InvalidSettingError(f"{path} is not a host file freqopt can read: it lacks {e.args[0]!r}; {fix}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise InvalidSettingError(f"{path} is not a host file freqopt can read ({e}); {fix}") from None
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise InvalidSettingError(f"{path}: host times must be finite numbers of us >= 0; {fix}")
    return HostSpec(name=path.stem, issue_us=values[0], gemm_issue_us=values[1], step_us=dict(zip(PASSES, values[2:])),
                    description=str(host.get("description", "")), sources={k: str(v) for k, v in data.get("sources", {}).items()})  # fmt: skip
