"""Shared fixtures: small traces (traced once per session) and GPU specs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from filelock import FileLock

from freqopt.gpu.host import HostSpec
from freqopt.workload.models import get_workload
from freqopt.workload.trace import trace_training_iteration

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import FakeGPU, FakeNVML  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Rich wraps what it prints to a file at the COLUMNS of the environment (else 80): a test that reads a table or a
# long line (a path under a deep checkout or tmp folder) must not depend on the terminal it was started from. Every
# command run in-process or as a subprocess of this session prints 200 columns, unless a test sets its own.
os.environ["COLUMNS"] = "200"

# A small kernel-level search (kernel level warm-starts from its coarser levels): many units, seconds each. Its
# switches take 1 ms: at the H100's 26 ms its short step could realize one clock only, and no finer level would run.
KERNEL_SEARCH = ["--model", "gpt3-small", "--micro-batch-size", "1", "--seq-len", "256", "--max-slowdown", "2%",
                 "--trials", "6", "--granularity", "kernel", "--seed", "1", "--switch-latency-ms", "1"]  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep the tests that share a module- or class-scoped fixture in one test process.

    pytest-xdist (``--dist loadgroup``, pyproject.toml's addopts) hands tests out one by one, and each worker process
    that gets a test builds the fixtures it uses: a module's search, trace or launched ranks would be built once in
    each worker. A test using such a fixture is marked ``xdist_group`` with its module's path, so those tests go to
    one worker and build it once, as a run in one process does; the other tests are spread over every worker.
    (Tryfirst: xdist reads the marks in its own collection hook.)
    """
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs.values() if fixtures is not None else ()
        if any(d[-1].scope in ("module", "class", "package") for d in defs if d):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session", autouse=True)
def _remove_deepspeeds_shared_memory_buffers():
    """DeepSpeed's CPU all-reduce (deepspeed.ops.comm's shared-memory op, which gloo runs beside) leaves a 66 MB
    /dev/shm/deepspeed_allreduce_buffer_* file per rank behind when its processes end; /dev/shm is memory, and a
    few suite runs filled a 24 GB machine's until a training test's ranks were killed for memory. Remove the ones
    this session made."""
    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_allreduce_buffer_*")) if shm.is_dir() else set()
    yield
    if shm.is_dir():
        for leaked in set(shm.glob("deepspeed_allreduce_buffer_*")) - before:
            leaked.unlink(missing_ok=True)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name`` filled by ``build(folder)`` once per test run, for every test process of the run.

    Under pytest-xdist each worker process has its own session, so a session fixture runs once per worker; this
    runs ``build`` in the first worker that asks, in a folder beside the workers' own temporary folders (their
    common parent, pytest-xdist's "Making session-scoped fixtures execute only once"), while the others wait on its
    lock and then read what it left. A build that raised leaves no finished mark, and the next caller builds again.
    Without xdist the folder is in the session's own temporary folder.

    Raises:
        whatever ``build`` raises.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, finished = root / name, root / f"{name}.finished"
    with FileLock(str(root / f"{name}.lock")):
        if not finished.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            finished.touch()
    return folder


# A small iteration-level search whose table a training or a transfer then uses: gpt3-small at 2 x 64 tokens.
ITERATION_SEARCH = ["--model", "gpt3-small", "--micro-batch-size", "2", "--seq-len", "64", "--max-slowdown", "2%",
                    "--granularity", "iteration", "--trials", "3"]  # fmt: skip


def _cli_search_once(tmp_path_factory, name: str, args: list[str]) -> Path:
    """``freqopt search ARGS --out out --json r.json`` run once per test run (built_once) by one process through the
    command line, in a folder of its own that it returns (its standard error in stderr.txt)."""

    def search(cwd: Path) -> None:
        proc = subprocess.run([sys.executable, "-m", "freqopt.cli", "search", *args, "--out", "out", "--json",
                               "r.json"], cwd=cwd, env={**os.environ, "COLUMNS": "200"}, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (cwd / "stderr.txt").write_text(proc.stderr)

    return built_once(tmp_path_factory, name, search)


@pytest.fixture(scope="session")
def kernel_search_cli(tmp_path_factory):
    """KERNEL_SEARCH run once per test run by one uninterrupted process (_cli_search_once): the reference that
    shared (tests/test_workers.py) and killed-and-resumed (tests/test_resume.py) runs of the same command must
    reproduce."""
    cwd = _cli_search_once(tmp_path_factory, "kernel-search", KERNEL_SEARCH)
    return {"args": KERNEL_SEARCH, "summary": json.loads((cwd / "r.json").read_text()),
            "stderr": (cwd / "stderr.txt").read_text()}  # fmt: skip


@pytest.fixture(scope="session")
def iteration_search_cli(tmp_path_factory):
    """ITERATION_SEARCH run once per test run (_cli_search_once), for the tests that train with or transfer its
    table: its arguments, its tables' folder (read only: each test writes in its own) and its standard error."""
    cwd = _cli_search_once(tmp_path_factory, "iteration-search", ITERATION_SEARCH)
    return {"args": ITERATION_SEARCH, "out": cwd / "out", "stderr": (cwd / "stderr.txt").read_text()}


@pytest.fixture
def short_measurements(monkeypatch):
    """Each real-GPU backend measurement's warm-up and window shortened from 0.5 s to 0.1 s (five of the stand-in's
    20 ms counter updates), for NVML and AMD SMI (which measures as NVML does): for tests of a search's path on a
    stand-in, not of its figures (about 60 s to 10 s each)."""
    import functools

    from freqopt.gpu.backends import nvml as nvml_backend

    short = functools.partial(nvml_backend.MeasurementProtocol, warmup_s=0.1, min_window_s=0.1)
    monkeypatch.setattr(nvml_backend, "MeasurementProtocol", short)


@pytest.fixture(scope="session")
def small_trace():
    """gpt3-small, one sequence of 256 tokens: the real kernel mix, small enough for quick searches."""
    return trace_training_iteration(get_workload("gpt3-small", micro_batch_size=1, seq_len=256))


@pytest.fixture(scope="session")
def gpt3_small_trace():
    return trace_training_iteration(get_workload("gpt3-small"))


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A stand-in NVML (tests/fake_pynvml.py) in place of pynvml, run as root, with one GPU at a 650 W limit, and
    freqopt's GPU-state files in the test's folder."""
    nvml = FakeNVML(gpus=[FakeGPU(uuid="GPU-test", power_limit_mw=650_000)], root=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    monkeypatch.setenv("FREQOPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return nvml


@pytest.fixture
def optuna_messages():
    """The messages Optuna's logger emits during the test, at whatever verbosity is set (its logger does not
    propagate to the root logger that pytest's caplog watches)."""

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler = Collect()
    logging.getLogger("optuna").addHandler(handler)
    yield handler.messages
    logging.getLogger("optuna").removeHandler(handler)


# A host that issues kernels in no time: for tests of a GPU's clock mechanics on stages so small that any real host
# (every GPU type's step is issued by one: freqopt.gpu.host) would set their pace instead of the clocks.
INSTANT_HOST = HostSpec("instant", 0.0, 0.0, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0},
                        description="issues kernels in no time (tests)")
