"""The physical range of every power-model parameter of a GPU type.

A GPU file's [power_model] is fitted (or carried) within the ranges its [power_model_bounds] block states, and
tests/test_gpu_files.py holds every file to them. The block is written by experiments/power_bounds.py from the
file's own [power] figures by the rules below (``physical_bounds``); a fit that meets a bound says the data pushes
past physics there (experiments/fidelity.md reports it).

The rules, in watts at the highest clocks unless named otherwise:

* ``p_const_w`` (the static floor: what the board draws whatever its clocks: fans, VRM losses, the memory's and the
  board's standby), at most ``idle_power_w``, the board's measured or data-sheet idle draw: at idle, with nothing
  running and the memory still clocked, the board draws its floor and more. The issue's rule, that the constant
  can never exceed idle plus memory power, follows (``static_floor_violation``).
* ``p_leak_w`` (leakage at V_max), at most 30 % of the highest power limit: assumed; static power is 10-30 % of
  board power on the GPUs modelled in AccelWattch (Kandiah et al., MICRO 2021: the GV100's constant and static
  power against its 250-300 W board) and GPUWattch (Leng et al., ISCA 2013).
* ``p_sm_clock_w`` (the SM clock tree, idle SMs' switching), at most the highest power limit; ``p_sm_active_w``
  (a dense GEMM's SM activity), at most 3x it: the firmware throttles a board whose work would draw more, so a
  fitted activity power beyond that is not seen in any measurement (assumed).
* ``p_mem_clock_w`` (memory clocked, no traffic), at most 30 %, and ``p_mem_active_w`` (full-bandwidth traffic),
  at most 50 % of the highest power limit (assumed: GDDR6 and HBM draw 10-40 % of board power under streaming work;
  AccelWattch's DRAM component of the GV100).
* ``v_min_rel`` (V at the knee over V_max) in [0.5, 1]: NVIDIA's voltage/frequency tables run about 0.65-0.75 V at
  the lowest clocks and 1.0-1.1 V at the highest (assumed from the public V/F readings of nvidia-smi and
  MSI Afterburner curves), so the ratio stays above one half; a fit at 0.3 has moved dynamic power into static terms.
* ``f_knee_mhz`` within the GPU's supported SM clocks.
* ``power_window_s`` (the firmware's power-control window) in [0.1 ms, 1 s]: NVIDIA documents no figure; the
  measured V100 and A100 fits sit at 1-5 ms (assumed).
* the per-operator terms (``p_sfu_w``, ``p_sm_stream_w``, ``p_norm_w``, ``p_attention_w``), at most the highest
  power limit (assumed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["physical_bounds", "power_model_violations", "static_floor_violation", "BOUND_SOURCES"]

# parameter -> (lower, upper) as a function of the file's figures; the sources are the module docstring's rules.
BOUND_SOURCES: dict[str, str] = {
    "p_const_w": "at most idle_power_w: the board's idle draw, memory clocked, bounds its static floor",
    "p_leak_w": "at most 30 % of power_limit_max_w (assumed: static power 10-30 % of board power, AccelWattch, GPUWattch)",
    "p_sm_clock_w": "at most power_limit_max_w (assumed)",
    "p_sm_active_w": "at most 3x power_limit_max_w (assumed: the firmware throttles work that would draw more)",
    "p_mem_clock_w": "at most 30 % of power_limit_max_w (assumed: memory 10-40 % of board power)",
    "p_mem_active_w": "at most 50 % of power_limit_max_w (assumed: memory 10-40 % of board power)",
    "v_min_rel": "0.5-1 (assumed: V/F tables run about 0.65-0.75 V low to 1.0-1.1 V high)",
    "f_knee_mhz": "within the supported SM clocks",
    "power_window_s": "0.1 ms - 1 s (assumed: fitted windows sit at 1-5 ms)",
    "p_sfu_w": "at most power_limit_max_w (assumed)",
    "p_sm_stream_w": "at most power_limit_max_w (assumed)",
    "p_norm_w": "at most power_limit_max_w (assumed)",
    "p_attention_w": "at most power_limit_max_w (assumed)",
}


def physical_bounds(*, idle_power_w: float, power_limit_max_w: float, min_sm_clock_mhz: float,
                    max_sm_clock_mhz: float) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Every PowerModel parameter's (lower, upper) range by the module docstring's rules, from a GPU file's figures
    (W, MHz). Units: W, except ``v_min_rel`` (1), ``f_knee_mhz`` (MHz) and ``power_window_s`` (s)."""
    limit = float(power_limit_max_w)
    return {
        "p_const_w": (0.0, float(idle_power_w)),
        "p_leak_w": (0.0, 0.3 * limit),
        "p_sm_clock_w": (0.0, limit),
        "p_sm_active_w": (0.0, 3.0 * limit),
        "p_mem_clock_w": (0.0, 0.3 * limit),
        "p_mem_active_w": (0.0, 0.5 * limit),
        "v_min_rel": (0.5, 1.0),
        "f_knee_mhz": (float(min_sm_clock_mhz), float(max_sm_clock_mhz)),
        "power_window_s": (1e-4, 1.0),
        "p_sfu_w": (0.0, limit),
        "p_sm_stream_w": (0.0, limit),
        "p_norm_w": (0.0, limit),
        "p_attention_w": (0.0, limit),
    }


def static_floor_violation(spec: Any) -> str | None:
    """Why a GPU type's constant power term is unphysical, or None: ``p_const_w`` may never exceed what the board
    draws idle with its memory clocked, ``idle_power_w + p_mem_clock_w``. ``spec``: a GPUSpec."""
    pm = spec.power_model
    ceiling = spec.idle_power_w + pm.p_mem_clock_w
    if pm.p_const_w > ceiling + 1e-9:
        return (f"{spec.name}: p_const_w {pm.p_const_w:.1f} W exceeds idle_power_w {spec.idle_power_w:.1f} W + "
                f"p_mem_clock_w {pm.p_mem_clock_w:.1f} W = {ceiling:.1f} W")
    return None


def power_model_violations(spec: Any, bounds: Mapping[str, tuple[float, float]] | None = None) -> list[str]:
    """One line per power-model parameter of ``spec`` (a GPUSpec) outside its range (``bounds``, default the file's
    [power_model_bounds], ``spec.power_model_bounds``), and the static-floor rule's line (static_floor_violation).
    Empty: the power model is within physics as stated."""
    bounds = spec.power_model_bounds if bounds is None else bounds
    out = []
    for name, value in dataclasses.asdict(spec.power_model).items():
        if name not in bounds:
            out.append(f"{spec.name}: {name} has no stated range in [power_model_bounds]")
            continue
        lo, hi = bounds[name]
        if not lo - 1e-9 <= value <= hi + 1e-9:
            out.append(f"{spec.name}: {name} {value:g} outside [{lo:g}, {hi:g}] ({BOUND_SOURCES.get(name, '')})")
    floor = static_floor_violation(spec)
    return out + ([floor] if floor else [])
