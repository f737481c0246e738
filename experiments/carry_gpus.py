"""Carry a fitted GPU type's power model to a GPU type with no measurements of its own (issue 51: the GPU files of
H100 PCIe, A100 40GB, GH200, A10G, L40S, L4, RTX 4090 and B200; issue 56: A100 PCIe 80GB and Quadro RTX 6000;
issue 59: the AMD Instinct MI300X and MI250X), and
write it into that type's file. (The Tesla P100 was carried from the V100 SXM2 until issue 56 fitted it on its own
Zeus sweeps: experiments/fit_zeus_power.py.)

    python experiments/carry_gpus.py           # write the [power_model] block of every carried GPU file
    python experiments/carry_gpus.py --check   # exit 1 where a file's block is not what its rule gives

Nothing here is measured: each carried power model is its sibling's, fitted on measurements (search_spaces/*.toml
names each fit), changed by one of two rules, both assumptions that the files' [provenance] power line states.

* "same-die": the same die as the sibling on another board (fewer SMs enabled, a lower top clock, other memory).
  The SM terms (p_sm_clock_w, p_sm_active_w and the per-operator p_*_w) are watts at the highest clocks of
  ``n_sms`` SMs, ~ n_sms C V^2 f: they scale by the SM count and by (V/V_max)^2 f/f_max at the target's top clock
  on the sibling's voltage curve (freqopt.gpu.backends.physics.voltage_rel), p_leak_w by the SM count and V; the
  curve itself carries over (the knee at the same MHz, v_min_rel re-expressed against the lower V_max); the
  board's constant p_const_w is kept; the memory terms scale with memory bandwidth (energy per bit held, as
  freqopt.gpu.calibration.v100.derive_power_model assumes).
* "other-die": another die of the sibling's family or the next one. Every SM-side term, the constant and the
  leakage scale by the ratio of default power limits (the board is sized so that dense work reaches its limit, as
  the sibling's is); the memory terms scale with memory bandwidth; the voltage curve keeps its shape, its knee at
  the same fraction of the highest SM clock. AMD's Instinct boards, of which nothing is measured, take this rule
  from the NVIDIA board of their process generation and memory (MI300X from the H100 SXM, MI250X from the A100
  SXM): the weakest carry here, since another vendor's voltage curve and power split are not the sibling's.

Either way a carried term outside the target's [power_model_bounds] (freqopt.gpu.power_bounds: a constant above
the board's idle draw, say) is clipped into it, and the file's note says so (issue 56).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from freqopt.files import atomic_write_text
from freqopt.gpu.backends.physics import voltage_rel
from freqopt.gpu.specs import GPUSpec, PowerModel, get_gpu, replace_toml_block, search_spaces_dir

# GPU type -> (fitted sibling, rule).
CARRIED = {
    "h100-pcie": ("h100-sxm", "same-die"),
    "gh200": ("h100-sxm", "same-die"),
    "a100-sxm4-40gb": ("a100-sxm4-80gb", "same-die"),
    "a10g": ("a40", "same-die"),
    "l40s": ("a40", "other-die"),
    "l4": ("a40", "other-die"),
    "rtx4090": ("a40", "other-die"),
    "b200": ("h200-sxm", "other-die"),
    "a100-pcie-80gb": ("a100-sxm4-80gb", "same-die"),
    "quadro-rtx6000": ("v100-pcie", "other-die"),
    "mi300x": ("h100-sxm", "other-die"),
    "mi250x": ("a100-sxm4-80gb", "other-die"),
}
SM_TERMS = ("p_sm_clock_w", "p_sm_active_w", "p_sfu_w", "p_sm_stream_w", "p_norm_w", "p_attention_w")
MEM_TERMS = ("p_mem_clock_w", "p_mem_active_w")


def carried_power_model(sibling: GPUSpec, target: GPUSpec, rule: str) -> tuple[PowerModel, str]:
    """The power model ``target`` carries from ``sibling`` by ``rule`` ("same-die" or "other-die"; the module
    docstring), and one line that says how.

    Raises:
        ValueError: an unknown rule.
    """
    pm = sibling.power_model
    mem = target.mem_bandwidth_gbs / sibling.mem_bandwidth_gbs
    out = {k: getattr(pm, k) * mem for k in MEM_TERMS}
    if rule == "same-die":
        v = float(voltage_rel(sibling, target.max_sm_clock_mhz))
        sms = target.n_sms / sibling.n_sms
        sm = sms * v * v * target.max_sm_clock_mhz / sibling.max_sm_clock_mhz
        out.update({k: getattr(pm, k) * sm for k in SM_TERMS})
        out.update(p_leak_w=pm.p_leak_w * sms * v, v_min_rel=min(1.0, pm.v_min_rel / v))
        how = (f"SM terms x {sm:.4g} ({target.n_sms}/{sibling.n_sms} SMs, V/V_max {v:.4g} at "
               f"{target.max_sm_clock_mhz} MHz on {sibling.name}'s curve), knee kept at {pm.f_knee_mhz:g} MHz, "
               f"p_const_w kept, memory terms x {mem:.4g} (bandwidth)")  # fmt: skip
    elif rule == "other-die":
        limit = target.power_limit_default_w / sibling.power_limit_default_w
        out.update({k: getattr(pm, k) * limit for k in (*SM_TERMS, "p_const_w", "p_leak_w")})
        out["f_knee_mhz"] = pm.f_knee_mhz / sibling.max_sm_clock_mhz * target.max_sm_clock_mhz
        how = (f"SM terms, constant and leakage x {limit:.4g} (default power limits "
               f"{target.power_limit_default_w:g}/{sibling.power_limit_default_w:g} W), knee at the same fraction of "
               f"the top clock, memory terms x {mem:.4g} (bandwidth)")  # fmt: skip
    else:
        raise ValueError(f"unknown rule {rule!r}: same-die or other-die")
    clipped = []
    for k, v in out.items():  # issue 56: a carried term never leaves the target's physical range
        lo, hi = target.power_model_bounds[k]
        if not lo <= v <= hi:
            out[k] = min(max(v, lo), hi)
            clipped.append(f"{k} {v:.4g} clipped to {out[k]:.4g}")
    if clipped:
        how += "; " + ", ".join(clipped) + " (the file's [power_model_bounds])"
    return dataclasses.replace(pm, **out), how


def block(name: str) -> list[str]:
    """The [power_model] block's lines for GPU type ``name`` (one of CARRIED)."""
    sibling, rule = CARRIED[name]
    pm, how = carried_power_model(get_gpu(sibling), get_gpu(name), rule)
    note = (f"# Carried from {sibling} by the {rule} rule (experiments/carry_gpus.py; nothing measured on this GPU): "
            f"{how}.")
    return [note, "[power_model]", *(f"{k} = {v:.6g}" for k, v in dataclasses.asdict(pm).items())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that every carried file holds its rule's block")
    args = parser.parse_args()
    stale = []
    for name in CARRIED:
        path = search_spaces_dir() / f"{name}.toml"
        text = path.read_text()
        new = replace_toml_block(text, "power_model", block(name), writer="experiments/carry_gpus.py")
        if new != text:
            stale.append(name)
            if not args.check:
                atomic_write_text(path, new)
    get_gpu.cache_clear()
    print(("stale: " if args.check else "written: ") + (", ".join(stale) or "none"))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
