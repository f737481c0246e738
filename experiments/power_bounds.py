"""Write every GPU file's [power_model_bounds] block: the physical range of each power-model parameter, from the
file's own [power] and [clocks] figures by freqopt.gpu.power_bounds's rules (issue 56, item 1).

    python experiments/power_bounds.py           # write the block of every GPU file (a new file gets one after its [power_model])
    python experiments/power_bounds.py --check   # exit 1 where a file's block is not what the rules give, or a
                                                 # power model lies outside its range

Fits (experiments/fit_dvfs.py, calibrate.py, calibrate_h100.py, zeus sweeps) read the block and stay within it;
tests/test_gpu_files.py holds every file to it.
"""

from __future__ import annotations

import argparse
import re
import sys

from freqopt.files import atomic_write_text
from freqopt.gpu.power_bounds import BOUND_SOURCES, physical_bounds, power_model_violations
from freqopt.gpu.specs import get_gpu, list_gpus, replace_toml_block, search_spaces_dir

WRITER = "experiments/power_bounds.py"


def block(name: str) -> list[str]:
    """The block's lines for GPU type ``name``."""
    spec = get_gpu(name)
    bounds = physical_bounds(idle_power_w=spec.idle_power_w, power_limit_max_w=spec.power_limit_max_w,
                             min_sm_clock_mhz=min(spec.sm_clocks_mhz), max_sm_clock_mhz=spec.max_sm_clock_mhz)
    lines = ["# Each [power_model] parameter's physical range [lower, upper], in its unit, and why: freqopt.gpu.power_bounds",
             "[power_model_bounds]"]  # fmt: skip
    lines += [f"{k} = [{lo:.6g}, {hi:.6g}]  # {BOUND_SOURCES[k]}" for k, (lo, hi) in bounds.items()]
    return lines


def write(name: str, check: bool) -> bool:
    """Write (or with ``check`` compare) ``name``'s block; True where the file already held it."""
    path = search_spaces_dir() / f"{name}.toml"
    text = path.read_text()
    body = block(name)
    if "# BEGIN power_model_bounds" in text:
        new = replace_toml_block(text, "power_model_bounds", body, writer=WRITER)
    else:
        marked = [f"# BEGIN power_model_bounds (written by {WRITER}; edit there)", *body, "# END power_model_bounds"]
        new, n = re.subn(r"(# END power_model\n)", lambda m: m.group(1) + "\n" + "\n".join(marked) + "\n", text, count=1)
        if n != 1:
            raise SystemExit(f"{path}: no '# END power_model' line to put the bounds after")
    if check:
        return new == text
    if new != text:
        atomic_write_text(path, new)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    bad = 0
    for name in list_gpus():
        if not write(name, args.check):
            print(f"{name}: [power_model_bounds] is not what the rules give (run {WRITER})")
            bad += 1
        for line in power_model_violations(get_gpu(name)):
            print(line)
            bad += args.check
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
