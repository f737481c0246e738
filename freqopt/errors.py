"""freqopt's exceptions: one shallow tree, each kind something a user can act on.

Every message says what went wrong and what to do, in one line, so that the CLI can print it as is.
"""

from __future__ import annotations

__all__ = [
    "FreqoptError",
    "UnknownNameError",
    "InvalidSettingError",
    "ClockTableError",
    "TableWorkloadError",
    "OutputError",
    "StorageError",
    "GPUPermissionError",
    "DaemonError",
    "DaemonRefusedError",
    "TraceMismatchError",
    "MissingDependencyError",
    "check_positive_int",
    "EXTRA_PACKAGES",
    "install_hint",
]

# The optional-dependency groups of pyproject.toml ([project.optional-dependencies]) that a refusal points to, and
# what each installs, as pyproject.toml writes them (tests/test_install.py holds the two together).
EXTRA_PACKAGES: dict[str, tuple[str, ...]] = {
    "hf": ("transformers>=4.47", "accelerate>=1.1"),
    "tp": ("transformers>=4.40",),
    "plots": ("matplotlib>=3.7",),
    "postgres": ("psycopg[binary]>=3.1",),
}


class FreqoptError(Exception):
    """Base of every error freqopt raises on purpose; the CLI prints its message and exits non-zero.

    Attributes:
        argument: the name of the argument the error is about, as the library's caller wrote it (``n_trials``),
            or None; the message then begins with that name, which ``naming`` replaces (the CLI puts the flag the
            user typed in its place, ``--trials``).
    """

    exit_code: int = 2

    def __init__(self, *args, argument: str | None = None):
        if argument is not None and not (args and str(args[0]).startswith(argument)):
            raise ValueError(f"the message of an error about {argument!r} must begin with that name: {args!r}")
        super().__init__(*args)
        self.argument = argument

    def naming(self, label: str) -> str:
        """The message with ``label`` in place of the argument's name it begins with (the message as it is when
        the error names no argument)."""
        message = str(self)
        return message if self.argument is None else label + message[len(self.argument):]


class UnknownNameError(FreqoptError):
    """An unknown model, GPU or granularity name; the message lists the known ones."""


class InvalidSettingError(FreqoptError):
    """A value outside what is allowed: a slowdown outside [0, 100 %), clocks the GPU does not support, ..."""


class ClockTableError(FreqoptError):
    """A clock table that cannot be used: unreadable, corrupt, of another schema version or another GPU."""


class TableWorkloadError(ClockTableError):
    """A clock table found for another workload (model, layout, micro-batch or sequence length) than the one it is
    applied to; the message names ``freqopt transfer``, which lays a table onto another workload."""


class OutputError(FreqoptError):
    """An output directory or file that cannot be written."""


class StorageError(FreqoptError):
    """An Optuna storage URL that cannot be opened."""


class GPUPermissionError(FreqoptError):
    """Changing clocks or the power limit needs root or CAP_SYS_ADMIN."""


class DaemonError(FreqoptError):
    """freqoptd, the daemon that sets GPUs for users without root, does not answer or breaks its protocol."""


class DaemonRefusedError(DaemonError):
    """freqoptd refused a request; the message is the daemon's reason.

    Attributes:
        kind: the daemon's word for why (freqopt.daemon.server): ``policy``, ``busy``, ``invalid``,
            ``not_supported`` or ``nvml``.
    """

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TraceMismatchError(FreqoptError):
    """A trace recorded from another module than the one a DVFS runtime is attached to (freqopt.workload.fingerprint)."""


class MissingDependencyError(FreqoptError, ImportError):
    """An optional dependency is not installed; the message says how to install it (install_hint)."""


def install_hint(extra: str) -> str:
    """How to install the packages of pyproject.toml's optional-dependency group ``extra`` (EXTRA_PACKAGES), in
    words that work where freqopt was installed from its source checkout (no package index serves freqopt):
    ``pip install 'transformers>=4.47' 'accelerate>=1.1' (or pip install -e '.[hf]' in the freqopt checkout)``.

    Raises:
        KeyError: ``extra`` is not one of EXTRA_PACKAGES.
    """
    import shlex

    packages = " ".join(shlex.quote(package) for package in EXTRA_PACKAGES[extra])
    return f"pip install {packages} (or pip install -e '.[{extra}]' in the freqopt checkout)"


def check_positive_int(name: str, value, *, optional: bool = False) -> None:
    """Raise InvalidSettingError("NAME must be a positive integer, not VALUE") unless ``value`` is an int >= 1
    (None passes when ``optional``; a bool never does). ``name`` is the argument's name, as the caller wrote it
    (the error's ``argument``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSettingError(f"{name} must be a positive integer, not {value!r}", argument=name)


class GPUMemoryWarning(UserWarning):
    """A simulated step was profiled although it does not fit one GPU (freqopt.workload.memory.check_gpu_memory's
    message, and what the figures then mean). Defined here, with the errors, so that a caller can filter it without
    importing the memory model (and PyTorch)."""
