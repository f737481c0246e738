"""Running a user's command as a child process that signals reach: what ``freqopt measure`` measures and what
``freqopt apply`` holds a GPU setting for.

SIGINT, SIGTERM and SIGHUP sent to freqopt while the command runs are passed on to it (a Ctrl-C that the terminal
already sent to the command, which shares freqopt's foreground process group, is not sent twice), and freqopt
waits for the command to end, so that what freqopt does after it (end a measurement window, restore a GPU) still
runs. The handlers go in before the child starts, so that no signal in between ends freqopt instead of reaching it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from freqopt.errors import InvalidSettingError

__all__ = ["CommandRun", "FORWARDED_SIGNALS", "check_command", "run_command", "exit_status"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class CommandRun:
    """A command that ran to its end.

    Attributes:
        returncode: the child's exit status as subprocess gives it (negative: killed by that signal).
        received: the signals (of FORWARDED_SIGNALS) that reached freqopt while the command ran, in order; each was
            passed on to the command unless the terminal had already sent it there.
    """

    returncode: int
    received: tuple[int, ...] = ()

    @property
    def exit_code(self) -> int:
        """The exit status a shell would report: the child's, or 128 + N where signal N killed it."""
        return exit_status(self.returncode)


def exit_status(returncode: int) -> int:
    """A subprocess return code as a shell reports it: as it is, or 128 + N for a child that signal N killed."""
    return returncode if returncode >= 0 else 128 - returncode


def check_command(command: Sequence[str]) -> list[str]:
    """``command`` (a program and its arguments, no shell) as strings, checked before anything else is done.

    Raises:
        InvalidSettingError: an empty command, or a program that is not found on PATH (argument ``command``).
    """
    argv = [str(a) for a in command]
    if not argv:
        raise InvalidSettingError("command is missing; give the program to run and its arguments, e.g. "
                                  "python train.py", argument="command")  # fmt: skip
    if shutil.which(argv[0]) is None:
        raise InvalidSettingError(f"command {argv[0]!r} is not an executable program (not found, or not on PATH); "
                                  "check its spelling or give its path", argument="command")  # fmt: skip
    return argv


def _terminal_signals_the_child(pid: int) -> bool:
    """Whether a Ctrl-C typed at the terminal reaches the child directly: it shares this process's group and that
    group is the terminal's foreground group (the terminal driver signals the whole foreground group)."""
    try:
        if os.getpgid(pid) != os.getpgrp():
            return False
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal (a batch job, a test): nobody else signals the child
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def run_command(argv: Sequence[str]) -> CommandRun:
    """Run ``argv`` (checked by check_command) and wait for it, passing FORWARDED_SIGNALS on to it (module
    docstring). Signal handlers are installed only in the main thread (Python allows no other); the ones found are
    put back when the command ends.

    Raises:
        InvalidSettingError: the program cannot be run (argument ``command``: not executable, a bad interpreter).
    """
    argv = [str(a) for a in argv]
    received: list[int] = []
    started: list[subprocess.Popen] = []  # the child, once started
    terminal_did = False

    def forward(signum, frame):
        received.append(signum)
        if not started or (signum == signal.SIGINT and terminal_did):
            return  # before the child exists: delivered once it does (below)
        with contextlib.suppress(ProcessLookupError):
            started[0].send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
    try:
        try:
            child = subprocess.Popen(argv)
        except OSError as e:
            raise InvalidSettingError(f"command {argv[0]!r} cannot be run ({e.strerror or e})",
                                      argument="command") from e  # fmt: skip
        terminal_did = _terminal_signals_the_child(child.pid)
        started.append(child)
        for signum in list(received):  # arrived while the child was starting
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)
        returncode = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return CommandRun(returncode, tuple(received))
