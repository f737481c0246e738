"""GPU types: supported clocks, power-limit range, peaks and power-model constants, from search_spaces/*.toml.

One TOML file per GPU type. Each file names the source of every figure (data sheet, whitepaper, an
``nvidia-smi -q -d SUPPORTED_CLOCKS,POWER`` dump, or the calibration fit in experiments/calibrate.py).

Its [actuation] table states what a runtime can do to the GPU while a job runs: how long an NVML clock-set
call blocks its caller, how long the clock then takes to change (request delay and transition), both as (min, max)
ranges in ms, the resulting plausible range of the effective switch latency and the value the simulator uses
([model] clock_switch_ms, the cautious end where a figure is unknown), and whether the memory clock can be locked
at run time, only per job (deferred to the next GPU initialisation) or not at all. Its [sources] say where each
figure comes from.
"""

from __future__ import annotations

import dataclasses
import math

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.gpu.host import DEFAULT_HOST, HostSpec, get_host
from freqopt.gpu.search_spaces import search_spaces_dir, tomllib
from freqopt.gpu.spec_parts import WAITING_CLOCK_SCALES, Interconnect, PowerModel, WaitingPower


__all__ = ["PowerModel", "WaitingPower", "WAITING_CLOCK_SCALES", "Interconnect", "GPUSpec", "DEFAULT_GPU", "MEM_CLOCK_LOCKS", "get_gpu", "list_gpus",
           "search_spaces_dir", "check_switch_latency_ms", "replace_toml_block", "PROVENANCE_FAMILIES", "PROVENANCE_KINDS"]

DEFAULT_GPU = "h100-sxm"

# How a GPU type's memory clock can be set (search_spaces/*.toml, [actuation] mem_clock_lock):
#   "runtime": nvmlDeviceSetMemoryLockedClocks changes it while a job runs (NVML API reference: Ampere and newer);
#   "per-job": only a deferred lock (nvidia-smi --lock-memory-clocks-deferred), applied at the GPU's next
#              initialisation (a driver reload), so one memory clock per job;
#   "none": it cannot be locked at all (before Ampere; the GPU lists one memory clock).
MEM_CLOCK_LOCKS = ("runtime", "per-job", "none")


@dataclass(frozen=True)
class GPUSpec:
    """One GPU type. Clocks in MHz, power in W, rates at the highest clocks.

    Attributes:
        name: freqopt's name for the type, the TOML file's stem (``h100-sxm``).
        nvml_names: names that ``nvmlDeviceGetName`` returns for this type.
        amdsmi_names: for an AMD GPU, the ``market_name``s that AMD SMI's ``amdsmi_get_gpu_asic_info`` returns
            (freqopt.gpu.amdsmi); empty for NVIDIA GPUs.
        sm_clocks_mhz: supported SM (graphics) clocks, ascending.
        mem_clocks_mhz: supported memory clocks, ascending.
        max_sm_clock_for_mem_mhz: memory clocks that allow only SM clocks up to a bound (RTX 3080 Ti: 405 MHz
            memory only with SM <= 420 MHz).
        power_limit_default_w, power_limit_min_w, power_limit_max_w: ``nvmlDeviceGetPowerManagementLimitConstraints``
            and ``...DefaultLimit`` (converted from mW).
        idle_power_w: board power with no kernel running, at default clocks.
        n_sms: streaming multiprocessors.
        tensor_flops_per_clock_per_sm: dense FP16/BF16 tensor-core FLOPs per SM per clock.
        cuda_flops_per_clock_per_sm: FP32 FLOPs (2 x FMA lanes) per SM per clock.
        l2_bytes_per_clock: L2 bandwidth per SM clock, bytes; bounds memory traffic at low SM clocks.
        mem_bandwidth_gbs: device-memory bandwidth at the highest memory clock, GB/s (1e9 B/s).
        gemm_efficiency: fraction of tensor/CUDA peak a large GEMM reaches.
        mem_efficiency: fraction of memory bandwidth a streaming kernel reaches.
        overlap_exponent: p of the roofline with partial overlap, t = (t_c^p + t_m^p)^(1/p).
        kernel_fixed_s: launch and tail latency added to every kernel, s.
        gemm_k_overhead: a GEMM's per-tile prologue and epilogue, in units of its inner dimension K: it runs at
            ``gemm_efficiency * K / (K + gemm_k_overhead)`` of peak (0: size-independent).
        gemm_fixed_s: time a GEMM spends besides its tiles (ramp-up, the last wave's tail) with its tensor cores
            idle, s, on top of ``kernel_fixed_s``.
        attention_efficiency: fraction of tensor peak fused attention reaches on its causal work.
        layer_norm_bandwidth_rel: the layer-norm forward kernel's bandwidth relative to a streaming copy's.
        host: the name of the host that issues the kernels (freqopt.gpu.host.HostSpec: the file's [host] name,
            default DEFAULT_HOST; ``with_host`` replaces it); its figures are the three below.
        host_issue_s: host time to issue one kernel of a replay loop (Python, dispatcher, launch); the GPU
            idles when it outruns the host (0: an infinitely fast host).
        host_gemm_issue_s: the same for a GEMM (cuBLAS's heuristics and launch cost more).
        step_host_s: pass (forward, backward, optimizer) -> host time per kernel of a training step on top of
            ``host_issue_s`` / ``host_gemm_issue_s`` (autograd, module calls, the optimizer's Python), s.
        operator_bandwidth_rel: ATen operator name (or "multi_tensor" for the _foreach_ and _fused_ operators) ->
            its device-memory bandwidth relative to a streaming copy's; the file's [operator_bandwidth_rel]
            table; absent operators stream as a copy (freqopt.gpu.backends.physics.bandwidth_rel).
        row_overhead_elements: ATen operator name -> c0, elements: a kernel that reduces each row of C elements
            (its first input's last dimension) streams at C / (C + c0) of its wide-row rate (relative to its rate at
            rows of 768, where ``operator_bandwidth_rel`` and ``layer_norm_bandwidth_rel`` hold); the file's
            [row_overhead_elements] table.
        attention_head_dim_overhead: d0 of fused attention's efficiency at head dimension d, d / (d + d0), relative
            to its ``attention_efficiency`` at 64 (0: no dependence); the file's [attention] head_dim_overhead.
        attention_backward_efficiency_rel: fused attention's backward rate per FLOP relative to its forward's;
            [attention] backward_efficiency_rel.
        attention_key_overhead: L0 of fused attention's efficiency with L keys per query block, L / (L + L0),
            relative to 1024 (0: no dependence); [attention] key_overhead.
        attention_fixed_s: (forward, backward) time a fused attention kernel spends besides its tiles, s;
            [attention] fixed_us.
        attention_rate_rel: attention operator name -> its rate relative to the fitted model's (another
            implementation of the same attention: FlashAttention-2, which freqopt's own models call, against cuDNN's
            fused attention, PyTorch's default on Hopper); the file's [attention_rate_rel] table.
        gemm_epilogue_rel: how much of a GEMM's output store (its M x N outputs at a copy's bandwidth) adds to its
            time after its main loop (1: all of it, the tile's epilogue not overlapped; 0: the store overlaps the
            main loop as any traffic does); [model] gemm_epilogue_rel.
        gemm_unclocked_share: the share of a GEMM's main-loop time at the highest SM clock that does not stretch as
            the clock falls (waiting on memory and L2); at clock f its main loop takes
            ``(1 - share) f_max / f + share`` of its time at f_max (0: all of it scales);
            [model] gemm_unclocked_share.
        conv_efficiency_rel: convolution direction ("forward", "input", "weight") -> its efficiency relative to a
            GEMM of the same implicit-GEMM shape; the file's [conv_efficiency_rel] table.
        provenance: what each family of the simulator's figures rests on (the file's [provenance] table: kernel
            families, power, waiting power, host), each "measured ...", "carried from ..." or "assumed ...".
        clock_switch_s: the effective switch latency, s: from a runtime's request until the new clock holds, as
            the simulated GPU charges it (a schedule's switch lands this late) and as the search's phase blocks are
            sized (at least this long). It is the NVML call's own blocking time plus the transition (request delay
            and the clock's change), read cautiously where a figure is unknown; the file's [model] clock_switch_ms.
            ``with_switch_latency`` overrides it.
        nvml_call_s: how long an NVML clock-set call (nvmlDeviceSetGpuLockedClocks) blocks its caller, s, at the
            cautious end of its range: the time a runtime thread calling it in line would lose per switch, and the
            least spacing of switches issued from one worker. [actuation] nvml_call_ms (min, max).
        clock_switch_range_s: (min, max) plausible effective switch latency, s, where the figures are a range or
            unknown (one measured figure: both ends equal); ``clock_switch_s`` lies within it.
            [actuation] clock_switch_range_ms.
        mem_clock_lock: how the memory clock can be set, one of MEM_CLOCK_LOCKS ("runtime", "per-job", "none").
        mem_clock_runtime (property): whether the memory clock can change while a job runs (``mem_clock_lock``
            "runtime" and more than one memory clock).
        energy_counter_period_s: update period of nvmlDeviceGetTotalEnergyConsumption, s.
        power_model: see PowerModel.
        interconnect: see Interconnect.
        waiting_power: see WaitingPower (the file's [waiting_power] table; absent: the power model's baseline).
        power_model_bounds: each PowerModel parameter's physical (lower, upper) range, in its unit (the file's
            [power_model_bounds] block, written by experiments/power_bounds.py by freqopt.gpu.power_bounds's
            rules); empty where the file states none. freqopt.gpu.power_bounds.power_model_violations checks it.
        sources: where each group of figures comes from.
        memory_gb: device memory, GB, as the data sheet states it (the ``memory_gb`` key of the file's [gpu]
            table; the smaller size where a type comes in two); None where the file does not say.
    """

    name: str
    marketing_name: str
    nvml_names: tuple[str, ...]
    sm_clocks_mhz: tuple[int, ...]
    mem_clocks_mhz: tuple[int, ...]
    max_sm_clock_for_mem_mhz: dict[int, int]
    power_limit_default_w: float
    power_limit_min_w: float
    power_limit_max_w: float
    idle_power_w: float
    n_sms: int
    tensor_flops_per_clock_per_sm: float
    cuda_flops_per_clock_per_sm: float
    l2_bytes_per_clock: float
    mem_bandwidth_gbs: float
    gemm_efficiency: float
    mem_efficiency: float
    overlap_exponent: float
    kernel_fixed_s: float
    clock_switch_s: float
    energy_counter_period_s: float
    power_model: PowerModel
    interconnect: Interconnect
    sources: dict[str, str] = field(default_factory=dict)
    gemm_k_overhead: float = 0.0
    gemm_fixed_s: float = 0.0
    attention_efficiency: float | None = None
    layer_norm_bandwidth_rel: float = 1.0
    host: str = ""
    host_issue_s: float = 0.0
    host_gemm_issue_s: float = 0.0
    step_host_s: dict[str, float] = field(default_factory=dict)
    operator_bandwidth_rel: dict[str, float] = field(default_factory=dict)
    row_overhead_elements: dict[str, float] = field(default_factory=dict)
    attention_head_dim_overhead: float = 0.0
    attention_backward_efficiency_rel: float = 1.0
    attention_key_overhead: float = 0.0
    attention_fixed_s: tuple[float, float] = (0.0, 0.0)
    attention_rate_rel: dict[str, float] = field(default_factory=dict)
    gemm_epilogue_rel: float = 0.0
    gemm_unclocked_share: float = 0.0
    conv_efficiency_rel: dict[str, float] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)
    memory_gb: float | None = None
    nvml_call_s: float = 0.0
    clock_switch_range_s: tuple[float, float] = (0.0, 0.0)
    mem_clock_lock: str = "none"
    waiting_power: WaitingPower = WaitingPower()
    power_model_bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    amdsmi_names: tuple[str, ...] = ()

    @property
    def mem_clock_runtime(self) -> bool:
        """Whether the memory clock can change while a job runs: ``mem_clock_lock`` is "runtime" and the GPU lists
        more than one memory clock. False: the memory clock is one setting for the whole job."""
        return self.mem_clock_lock == "runtime" and len(self.mem_clocks_mhz) > 1

    @property
    def max_switches_per_s(self) -> float | None:
        """The most clock switches per second one runtime thread can ask this GPU for: NVML serves set calls one at
        a time, each blocking its caller ``nvml_call_s`` (the cautious end of [actuation] nvml_call_ms), so at most
        1 / nvml_call_s (50 on the H100 and the A100, at 20 ms). None where the GPU file gives no call time."""
        return 1.0 / self.nvml_call_s if self.nvml_call_s > 0 else None

    def over_switch_limit(self, switches_per_s: float | None) -> bool:
        """Whether a schedule asking this GPU for ``switches_per_s`` clock switches a second asks for more than one
        runtime thread can issue (``max_switches_per_s``); False where nothing switches or no limit is known."""
        limit = self.max_switches_per_s
        return bool(limit and switches_per_s and switches_per_s > limit)

    @property
    def switch_limit_text(self) -> str:
        """``max_switches_per_s`` and why, for a line of output ("" where the GPU file gives no call time); a rate
        over it is marked OVER_SWITCH_LIMIT."""
        limit = self.max_switches_per_s
        return f"one runtime thread issues at most {limit:g} (each NVML set call blocks {1e3 / limit:g} ms, one at a time)" if limit else ""

    def with_switch_latency(self, switch_s: float) -> GPUSpec:
        """This GPU type with another effective switch latency (``clock_switch_s``), s, e.g. one measured on the
        machine at hand or a point of a sensitivity study; everything else, the name included, is unchanged.

        Raises:
            InvalidSettingError: ``switch_s`` is not a finite number >= 0.
        """
        if not _finite_non_negative(switch_s):
            raise InvalidSettingError(f"switch latency must be a finite number of seconds >= 0, not {switch_s!r}")
        return dataclasses.replace(self, clock_switch_s=float(switch_s))

    def with_host(self, host: HostSpec | str) -> GPUSpec:
        """This GPU type issued by another host (freqopt.gpu.host: a HostSpec, or a host's name or TOML path); everything
        else, the name included, is unchanged.

        Raises:
            UnknownNameError, InvalidSettingError: no such host, or a host file freqopt cannot read.
        """
        host = host if isinstance(host, HostSpec) else get_host(host)
        return dataclasses.replace(self, **_host_fields(host))

    def with_waiting_clock_scale(self, clock_scale: float) -> GPUSpec:
        """This GPU type with its waiting power falling with the clock as much as ``clock_scale`` says
        (WaitingPower.clock_scale: 1 the model, 0 not at all); everything else, the name included, is unchanged.

        Raises:
            InvalidSettingError: ``clock_scale`` is not a number in [0, 1].
        """
        if not (isinstance(clock_scale, (int, float)) and 0.0 <= clock_scale <= 1.0):
            raise InvalidSettingError(f"clock_scale must be a number from 0 to 1, not {clock_scale!r}")
        return dataclasses.replace(self, waiting_power=dataclasses.replace(self.waiting_power,
                                                                           clock_scale=float(clock_scale)))

    @property
    def max_sm_clock_mhz(self) -> int:
        return self.sm_clocks_mhz[-1]

    @property
    def max_mem_clock_mhz(self) -> int:
        return self.mem_clocks_mhz[-1]

    @property
    def tensor_peak_flops(self) -> float:
        """Dense FP16/BF16 tensor-core peak at the highest SM clock, FLOP/s."""
        return self.n_sms * self.tensor_flops_per_clock_per_sm * self.max_sm_clock_mhz * 1e6

    def supports(self, sm_clock_mhz: int, mem_clock_mhz: int) -> bool:
        """Whether the pair is one the GPU accepts as locked clocks."""
        if sm_clock_mhz not in self.sm_clocks_mhz or mem_clock_mhz not in self.mem_clocks_mhz:
            return False
        return sm_clock_mhz <= self.max_sm_clock_for_mem_mhz.get(mem_clock_mhz, self.max_sm_clock_mhz)

    def check_clocks(self, sm_clock_mhz: int, mem_clock_mhz: int) -> None:
        """Raise InvalidSettingError unless the GPU supports the pair.

        Raises:
            InvalidSettingError: the message lists the supported range.
        """
        if not self.supports(sm_clock_mhz, mem_clock_mhz):
            raise InvalidSettingError(
                f"{self.name} does not support SM {sm_clock_mhz} MHz with memory {mem_clock_mhz} MHz; "
                f"SM clocks are {self.sm_clocks_mhz[0]}-{self.max_sm_clock_mhz} MHz "
                f"({len(self.sm_clocks_mhz)} values), memory clocks {list(self.mem_clocks_mhz)} MHz"
            )

    def resolve_clocks(self, sm_clock_mhz: int | None, mem_clock_mhz: int | None) -> tuple[int, int]:
        """A setting's clocks with None meaning the default (the highest clock); 0 is a clock, not a default."""
        return (self.max_sm_clock_mhz if sm_clock_mhz is None else sm_clock_mhz,
                self.max_mem_clock_mhz if mem_clock_mhz is None else mem_clock_mhz)  # fmt: skip

    def check_power_limit(self, power_limit_w: float) -> None:
        """Raise InvalidSettingError unless ``power_limit_w`` is within the GPU's constraints."""
        if not self.power_limit_min_w <= power_limit_w <= self.power_limit_max_w:
            raise InvalidSettingError(
                f"{self.name} accepts power limits {self.power_limit_min_w:g}-{self.power_limit_max_w:g} W, "
                f"not {power_limit_w:g} W"
            )

    def clock_pairs(self) -> list[tuple[int, int]]:
        """Every supported (sm_clock_mhz, mem_clock_mhz) pair."""
        return [(f, m) for m in self.mem_clocks_mhz for f in self.sm_clocks_mhz if self.supports(f, m)]


def replace_toml_block(text: str, marker: str, body: list[str], *, writer: str) -> str:
    """``text`` (a GPU type's TOML) with the lines from ``# BEGIN <marker> ...`` to ``# END <marker>`` replaced by
    ``body``, between a BEGIN line that names ``writer`` (the script that fits them) and the END line: how the
    calibration scripts in experiments/ write what they fit.

    Raises:
        ValueError: ``text`` holds no such block, or more than one.
    """
    block = [f"# BEGIN {marker} (written by {writer}; edit there)", *body, f"# END {marker}"]
    new, n = re.subn(rf"# BEGIN {re.escape(marker)} .*?# END {re.escape(marker)}", lambda _: "\n".join(block), text,
                     flags=re.S)  # fmt: skip
    if n != 1:
        raise ValueError(f"expected one '# BEGIN {marker}' block, found {n}")
    return new


def list_gpus() -> list[str]:
    """Names of the known GPU types, sorted."""
    return sorted(p.stem for p in search_spaces_dir().glob("*.toml"))


def _clock_list(table: dict[str, Any], key: str) -> tuple[int, ...]:
    """A clock list given as a list, or as {max, min, step} counted down from max (V100's 7.5 MHz steps
    alternate 7 and 8 MHz: 1380, 1372, 1365, ...)."""
    spec = table[key]
    if isinstance(spec, list):
        return tuple(sorted(int(v) for v in spec))
    top, bottom, step = float(spec["max"]), float(spec["min"]), float(spec["step"])
    n = int(math.floor((top - bottom) / step + 1e-9)) + 1
    return tuple(sorted(int(math.floor(top - i * step + 1e-9)) for i in range(n)))


def _finite_non_negative(value) -> bool:
    """A real number (not a bool), finite and >= 0: what a switch latency may be."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def check_switch_latency_ms(value, *, argument: str = "switch_latency_ms") -> float | None:
    """A switch-latency override given in ms (an argument of the search API and CLI), checked and converted to s;
    None stays None (no override: the GPU file's value).

    Raises:
        InvalidSettingError: not a finite number >= 0; the message names ``argument``.
    """
    if value is None:
        return None
    if not _finite_non_negative(value):
        raise InvalidSettingError(f"{argument} must be a number of milliseconds >= 0 (0: switches land at once), "
                                  f"not {value!r}", argument=argument)  # fmt: skip
    return float(value) / 1e3


def _range_ms(table: dict[str, Any], key: str, path: Path) -> tuple[float, float]:
    """A (min, max) pair of non-negative milliseconds from the [actuation] table, in seconds."""
    value = table.get(key)
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
            and 0 <= value[0] <= value[1]):  # fmt: skip
        raise InvalidSettingError(f"{path}: [actuation] {key} must be [min, max] in ms with 0 <= min <= max, not {value!r}")
    return float(value[0]) / 1e3, float(value[1]) / 1e3


def _actuation(data: dict[str, Any], path: Path, clock_switch_s: float) -> dict[str, Any]:
    """GPUSpec's actuation fields from a file's [actuation] table, checked against its effective latency."""
    a = data.get("actuation")
    if not isinstance(a, dict):
        raise InvalidSettingError(f"{path} has no [actuation] table: add nvml_call_ms, transition_ms, "
                                  "clock_switch_range_ms and mem_clock_lock (see search_spaces/h100-sxm.toml)")
    call = _range_ms(a, "nvml_call_ms", path)
    _range_ms(a, "transition_ms", path)  # stated with its source; the effective value already counts it
    low, high = _range_ms(a, "clock_switch_range_ms", path)
    if not low - 1e-12 <= clock_switch_s <= high + 1e-12:
        raise InvalidSettingError(f"{path}: [model] clock_switch_ms {clock_switch_s * 1e3:g} lies outside "
                                  f"[actuation] clock_switch_range_ms [{low * 1e3:g}, {high * 1e3:g}]")
    lock = a.get("mem_clock_lock")
    if lock not in MEM_CLOCK_LOCKS:
        raise InvalidSettingError(f"{path}: [actuation] mem_clock_lock must be one of {', '.join(MEM_CLOCK_LOCKS)}, "
                                  f"not {lock!r}")
    return {"nvml_call_s": call[1], "clock_switch_range_s": (low, high), "mem_clock_lock": lock}


# How output marks a schedule asking one GPU for more clock switches per second than GPUSpec.max_switches_per_s.
OVER_SWITCH_LIMIT = "more than a runtime can issue"


def _waiting_power(data: dict[str, Any], path: Path) -> WaitingPower:
    """The file's [waiting_power] table (top_clocks_w, clock_share) as a WaitingPower; absent: the baseline's.

    Raises:
        InvalidSettingError: a figure is missing or out of range; the message names the file.
    """
    table = data.get("waiting_power")
    if table is None:
        return WaitingPower()
    top, share = table.get("top_clocks_w"), table.get("clock_share")
    if not (_finite_non_negative(top) and _finite_non_negative(share) and share <= 1.0):
        raise InvalidSettingError(f"{path}: [waiting_power] needs top_clocks_w (W >= 0) and clock_share (0 to 1); "
                                  f"fix or remove the table")  # fmt: skip
    return WaitingPower(top_clocks_w=float(top), clock_share=float(share))


@lru_cache(maxsize=None)
def get_gpu(name: str) -> GPUSpec:
    """Load a GPU type by name (the TOML file stem, case-insensitive) or by a path to a TOML file.

    Raises:
        UnknownNameError: no such GPU type; the message lists the known ones.
        InvalidSettingError: the file is not valid TOML, lacks a table or figure a GPU type needs, holds one of the
            wrong kind, or its [actuation] table is inconsistent; one line that names the file and says what to do.
    """
    path = Path(name)
    if path.suffix != ".toml" or not path.is_file():
        path = search_spaces_dir() / f"{name.lower()}.toml"
    if not path.is_file():
        raise UnknownNameError(f"unknown GPU {name!r}; known GPUs: {', '.join(list_gpus())} (see `freqopt gpus`)")
    fix = f"copy a GPU file of {search_spaces_dir()} and edit it (`freqopt gpus` lists them)"
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise InvalidSettingError(f"{path} is not valid TOML ({e}); {fix}") from None
    try:
        return _spec_from_toml(data, path)
    except KeyError as e:
        raise InvalidSettingError(f"{path} is not a GPU file freqopt can read: it lacks {e.args[0]!r}; {fix}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise InvalidSettingError(f"{path} is not a GPU file freqopt can read ({e}); {fix}") from None


def _host_fields(host: HostSpec) -> dict[str, Any]:
    """GPUSpec's host fields from a host."""
    return {"host": host.name, "host_issue_s": host.issue_us * 1e-6, "host_gemm_issue_s": host.gemm_issue_us * 1e-6,
            "step_host_s": {p: us * 1e-6 for p, us in host.step_us.items()}}


# [kernel_families] keys (a GPU type's kernel model, written by experiments/h200_check.py where it is fitted or carried)
# and the GPUSpec field each sets; its subtables merge into the file's tables of the same name.
_FAMILY_FIELDS = {"gemm_efficiency": "gemm_efficiency", "gemm_k_overhead": "gemm_k_overhead",
                  "gemm_epilogue_rel": "gemm_epilogue_rel", "gemm_unclocked_share": "gemm_unclocked_share",
                  "attention_efficiency": "attention_efficiency",
                  "attention_head_dim_overhead": "attention_head_dim_overhead",
                  "attention_key_overhead": "attention_key_overhead",
                  "attention_backward_efficiency_rel": "attention_backward_efficiency_rel",
                  "layer_norm_bandwidth_rel": "layer_norm_bandwidth_rel", "mem_efficiency": "mem_efficiency"}
_FAMILY_TABLES = ("attention_rate_rel", "conv_efficiency_rel", "operator_bandwidth_rel", "row_overhead_elements")
# What a GPU file's [provenance] says, per family of the simulator's figures; each value starts with one of
# PROVENANCE_KINDS and names its source.
PROVENANCE_FAMILIES = ("gemm", "attention", "convolution", "memory_bound", "cross_entropy", "batch_norm", "power",
                       "waiting_power", "host")
PROVENANCE_KINDS = ("measured", "carried", "assumed")


def _kernel_families(data: dict[str, Any]) -> dict[str, Any]:
    """GPUSpec fields the file's [kernel_families] table sets (over [model], [attention] and the file's tables)."""
    table = data.get("kernel_families")
    if not table:
        return {}
    out: dict[str, Any] = {field: float(table[key]) for key, field in _FAMILY_FIELDS.items() if key in table}
    if "gemm_fixed_us" in table:
        out["gemm_fixed_s"] = float(table["gemm_fixed_us"]) * 1e-6
    if "attention_fixed_us" in table:
        fixed = [float(v) * 1e-6 for v in table["attention_fixed_us"]]
        if len(fixed) != 2:
            raise ValueError("[kernel_families] attention_fixed_us must be [forward, backward]")
        out["attention_fixed_s"] = tuple(fixed)
    for name in _FAMILY_TABLES:
        merged = {k: float(v) for k, v in data.get(name, {}).items()}
        merged.update({k: float(v) for k, v in table.get(name, {}).items()})
        if merged:
            out[name] = merged
    return out


def _spec_from_toml(data: dict[str, Any], path: Path) -> GPUSpec:
    """The GPUSpec a GPU file's tables describe (get_gpu; its search_spaces/*.toml files name every figure's source).

    Raises:
        KeyError, TypeError, ValueError, AttributeError: a table or figure missing or of the wrong kind (get_gpu
            turns them into one line naming the file).
        InvalidSettingError: [actuation] or [waiting_power] inconsistent.
    """
    g, c, p, r, m = data["gpu"], data["clocks"], data["power"], data["rates"], data["model"]
    pm = data["power_model"]
    mem_clocks = _clock_list(c, "mem_clocks_mhz")
    clock_switch_s = float(m["clock_switch_ms"]) / 1e3
    families = _kernel_families(data)
    host = get_host(str(data.get("host", {}).get("name", DEFAULT_HOST)))
    spec = GPUSpec(
        name=path.stem,
        marketing_name=g["marketing_name"],
        nvml_names=tuple(g.get("nvml_names", ())),
        amdsmi_names=tuple(g.get("amdsmi_names", ())),
        sm_clocks_mhz=_clock_list(c, "sm_clocks_mhz"),
        mem_clocks_mhz=mem_clocks,
        max_sm_clock_for_mem_mhz={int(k): int(v) for k, v in c.get("max_sm_clock_for_mem_mhz", {}).items()},
        power_limit_default_w=float(p["power_limit_default_w"]),
        power_limit_min_w=float(p["power_limit_min_w"]),
        power_limit_max_w=float(p["power_limit_max_w"]),
        idle_power_w=float(p["idle_power_w"]),
        n_sms=int(r["n_sms"]),
        tensor_flops_per_clock_per_sm=float(r["tensor_flops_per_clock_per_sm"]),
        cuda_flops_per_clock_per_sm=float(r["cuda_flops_per_clock_per_sm"]),
        l2_bytes_per_clock=float(r["l2_bytes_per_clock"]),
        mem_bandwidth_gbs=float(r["mem_bandwidth_gbs"]),
        gemm_efficiency=float(m["gemm_efficiency"] if "gemm_efficiency" not in families else families["gemm_efficiency"]),
        mem_efficiency=float(m["mem_efficiency"] if "mem_efficiency" not in families else families["mem_efficiency"]),
        overlap_exponent=float(m["overlap_exponent"]),
        kernel_fixed_s=float(m["kernel_fixed_us"]) * 1e-6,
        clock_switch_s=clock_switch_s,
        energy_counter_period_s=float(m["energy_counter_period_ms"]) * 1e-3,
        power_model=PowerModel(**{k: float(v) for k, v in pm.items()}),
        interconnect=Interconnect(**data["interconnect"]),
        sources=dict(data.get("sources", {})),
        gemm_k_overhead=float(m.get("gemm_k_overhead", 0.0)),
        gemm_fixed_s=float(m.get("gemm_fixed_us", 0.0)) * 1e-6,
        attention_efficiency=float(m["attention_efficiency"]) if "attention_efficiency" in m else None,
        layer_norm_bandwidth_rel=float(m.get("layer_norm_bandwidth_rel", 1.0)),
        **_host_fields(host),
        operator_bandwidth_rel={k: float(v) for k, v in data.get("operator_bandwidth_rel", {}).items()},
        row_overhead_elements={k: float(v) for k, v in data.get("row_overhead_elements", {}).items()},
        attention_head_dim_overhead=float(data.get("attention", {}).get("head_dim_overhead", 0.0)),
        attention_backward_efficiency_rel=float(data.get("attention", {}).get("backward_efficiency_rel", 1.0)),
        attention_key_overhead=float(data.get("attention", {}).get("key_overhead", 0.0)),
        attention_fixed_s=tuple(float(v) * 1e-6 for v in data.get("attention", {}).get("fixed_us", (0.0, 0.0))),
        attention_rate_rel={k: float(v) for k, v in data.get("attention_rate_rel", {}).items()},
        gemm_epilogue_rel=float(m.get("gemm_epilogue_rel", 0.0)),
        gemm_unclocked_share=float(m.get("gemm_unclocked_share", 0.0)),
        conv_efficiency_rel={k: float(v) for k, v in data.get("conv_efficiency_rel", {}).items()},
        provenance={k: str(v) for k, v in data.get("provenance", {}).items()},
        memory_gb=float(g["memory_gb"]) if "memory_gb" in g else None,
        waiting_power=_waiting_power(data, path),
        power_model_bounds={k: (float(v[0]), float(v[1])) for k, v in data.get("power_model_bounds", {}).items()},
        **_actuation(data, path, clock_switch_s),
    )
    return dataclasses.replace(spec, **families) if families else spec
