"""How long each common refusal takes (issue 51, item 1: "every refusal in under a second"), as a user meets it:
``python -m freqopt.cli ARGS`` in a fresh process, wall time from start to exit, and the heavy modules (torch, optuna,
scipy) the refusal imported. The refusals are tests/test_refusals.py's REFUSALS (the test asserts what is checked
there: one line, before any heavy import; this script only measures, prints and asserts nothing).

    python experiments/refusal_times.py                       # this tree
    python experiments/refusal_times.py --tree /path/to/other # another checkout (e.g. before the change)
    python experiments/refusal_times.py --only plan,worker    # refusals of these commands only

Wall times depend on the machine and its load (the load average is printed first): compare runs made together.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from test_refusals import REFUSALS, _files  # noqa: E402  (the one list of refusals, shared with the test)

_PROBE = ("import json, sys; from freqopt.cli import main; code = main(json.loads(sys.argv[1])); "
          "print(json.dumps([code, [m for m in ('torch', 'optuna', 'scipy') if m in sys.modules]]))")  # fmt: skip


def time_refusal(argv: list[str], tree: Path, cwd: Path) -> tuple[float, int, list[str]]:
    """(wall seconds, exit code, heavy modules imported) of freqopt.cli.main(argv) run from ``tree`` in a fresh
    interpreter."""
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    wall = time.perf_counter() - started
    code, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    return wall, code, heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(REPO), help="the checkout whose freqopt runs (default this one)")
    parser.add_argument("--only", default=None, help="comma list of commands (plan, search, worker, ...)")
    args = parser.parse_args()
    tree = Path(args.tree).resolve()
    only = set(args.only.split(",")) if args.only else None
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; Python {platform.python_version()}; tree {tree}")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        _files(cwd)
        floor, _, _ = time_refusal(["--version"], tree, cwd)
        print(f"{'s':>6}  exit  heavy imports           refusal   (floor: `freqopt --version` {floor:.2f} s)")
        walls = []
        for argv, _ in REFUSALS:
            if only is not None and argv[0] not in only:
                continue
            argv = [a.replace("{tmp}", tmp) for a in argv]
            wall, code, heavy = time_refusal(argv, tree, cwd)
            walls.append(wall)
            shown = " ".join(a.replace(tmp, "TMP").replace(str(REPO) + "/", "") for a in argv)
            print(f"{wall:6.2f}  {code:4d}  {','.join(heavy) or '-':22s}  {shown}")
    print(f"{len(walls)} refusals: median {statistics.median(walls):.2f} s, slowest {max(walls):.2f} s, "
          f"{sum(w < 1.0 for w in walls)} under 1 s")


if __name__ == "__main__":
    main()
