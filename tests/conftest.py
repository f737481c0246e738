"""Shared fixtures: small traces (traced once per session) and GPU specs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

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


@pytest.fixture(scope="session")
def kernel_search_cli(tmp_path_factory):
    """KERNEL_SEARCH run once per session through the command line by one uninterrupted process, in a folder of its
    own (``--out out --json r.json``): the reference that shared (tests/test_workers.py) and killed-and-resumed
    (tests/test_resume.py) runs of the same command must reproduce."""
    cwd = tmp_path_factory.mktemp("kernel-search")
    proc = subprocess.run([sys.executable, "-m", "freqopt.cli", "search", *KERNEL_SEARCH, "--out", "out", "--json",
                           "r.json"], cwd=cwd, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {"args": KERNEL_SEARCH, "summary": json.loads((cwd / "r.json").read_text()), "stderr": proc.stderr}


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
