"""One rank of ``freqopt train`` under DeepSpeed's launcher, watched, so that freqopt can say which rank died of
what (freqopt.cli.train).

DeepSpeed's launcher reports a rank that a signal ended only as "... exits with return code = -9", naming neither
the rank nor the cause. So the launcher starts this module for each rank (``--module freqopt.cli.rank ARGS``); it
runs the rank, ``python -m freqopt.cli ARGS``, as its child and waits. When the child dies of a signal, it writes
``rank{RANK}.json`` ({"rank": RANK, "signal": N}) into the folder $FREQOPT_RANK_STATUS_DIR names, then ends as the
child did (by the same signal), so the launcher sees what it always saw. It imports neither torch nor DeepSpeed: a
process of some 20 MB beside each rank.

SIGINT (Ctrl-C reaches the whole process group) is left to the rank, which this process then waits for; SIGTERM
ends this process at once, as before, and the launcher ends the rank itself (DeepSpeed's terminate_process_tree
signals every descendant).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["STATUS_DIR_ENV", "killed_ranks", "main"]

STATUS_DIR_ENV = "FREQOPT_RANK_STATUS_DIR"


def killed_ranks(status_dir: str | Path) -> dict[int, int]:
    """Rank -> the signal that ended it, from the files ranks left in ``status_dir`` (none: no rank died of one)."""
    found = {}
    for path in sorted(Path(status_dir).glob("rank*.json")):
        try:
            doc = json.loads(path.read_text())
            found[int(doc["rank"])] = int(doc["signal"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written by a rank killed while writing: as good as absent
    return found


def main(argv: list[str] | None = None, *, command: list[str] | None = None) -> int:
    """Run ``python -m freqopt.cli ARGV`` (or ``command``) and report its death by a signal (module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    child = subprocess.Popen(command or [sys.executable, "-m", "freqopt.cli", *argv])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # after the start: the rank must not inherit the ignoring
    code = child.wait()
    status_dir = os.environ.get(STATUS_DIR_ENV)
    if code < 0 and status_dir:
        rank = os.environ.get("RANK", "0")
        tmp = Path(status_dir) / f".rank{rank}.json.tmp"
        try:
            tmp.write_text(json.dumps({"rank": int(rank), "signal": -code}))
            tmp.replace(Path(status_dir) / f"rank{rank}.json")  # whole or absent
        except (OSError, ValueError):
            pass  # the launcher's own report still stands
    if code < 0:  # end as the rank did, so that the launcher reads the same return code
        try:
            signal.signal(-code, signal.SIG_DFL)  # SIGKILL's cannot be changed, and needs no change
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default is not to end a process: the shell's convention
    return code


if __name__ == "__main__":
    sys.exit(main())
