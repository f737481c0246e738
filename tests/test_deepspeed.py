"""freqopt's per-rank traces of parallel layouts against real DeepSpeed: two CPU ranks (gloo), torch.profiler.

For dp=2 (ZeRO stage 0) and tp=2 (AutoTP training), freqopt/workload/deepspeed_profile.py trains a tiny GPT under the
DeepSpeed launcher and records each rank's GEMMs and all-reduces; freqopt's meta-device trace of the same
workload and layout must have the same GEMM shapes per rank and the same collectives with the same sizes and
groups. (All-reduces over a group of one rank, which DeepSpeed issues for its data-parallel group under pure
tensor parallelism, move no data and are not in freqopt's trace.)
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import Counter

import pytest
import torch

import freqopt.workload.deepspeed_profile as ds_profile
from freqopt.workload.layout import parse_layout
from freqopt.workload.models import Workload
from freqopt.workload.models.gpt3 import GPTConfig
from freqopt.workload.trace import trace_iteration
from conftest import built_once

pytest.importorskip("deepspeed")
MICRO_BATCH = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAYOUTS = ["dp=2", "tp=2"]


def _launch(layout: str, out) -> None:
    """Train the tiny GPT under the DeepSpeed launcher on two CPU ranks in ``layout``; each rank writes
    ``out/rank{r}.json``."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
           # As a module: run as a script, freqopt/workload/ would lead sys.path and its trace.py shadow stdlib trace.
           "--master_port", str(_free_port()), "--module", "freqopt.workload.deepspeed_profile", "--layout", layout,
           "--micro-batch-size", str(MICRO_BATCH), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(params=LAYOUTS)
def real_run(request, tmp_path_factory):
    """The layout's DeepSpeed run, launched once for the whole test run (conftest.built_once): a module fixture is
    set up again whenever the run interleaves this module's tests with others, as it did four times a suite."""
    layout = request.param
    if layout.startswith("tp"):
        pytest.importorskip("transformers", reason="AutoTP needs transformers: pip install -e '.[tp]'")
    out = built_once(tmp_path_factory, f"deepspeed-{layout.replace('=', '')}", lambda folder: _launch(layout, folder))
    return parse_layout(layout), [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def freqopt_trace(layout):
    workload = Workload("tiny-gpt", GPTConfig(**ds_profile.TINY_GPT), MICRO_BATCH, layout)
    return trace_iteration(workload, "train", dtype=torch.float32)  # CPU ranks train in FP32


@pytest.mark.slow
def test_same_gemm_shapes_per_rank(real_run):
    layout, ranks = real_run
    trace = freqopt_trace(layout)
    gemms = [k for k in trace.kernels if k.name in ("aten.mm", "aten.addmm")]
    ours = Counter(tuple(k.shapes[-2]) + (k.shapes[-1][1],) for k in gemms)  # (M, K, N)
    for rank in ranks:
        theirs = Counter(tuple(g) for g in rank["gemms"])
        assert theirs == ours, f"rank {rank['rank']}: DeepSpeed {dict(theirs)} vs freqopt {dict(ours)}"
        assert rank["n_params"] == trace.meta["n_params"]


@pytest.mark.slow
def test_same_collectives_with_the_same_sizes(real_run):
    layout, ranks = real_run
    trace = freqopt_trace(layout)
    ours = Counter((k.shapes[0], k.group_size, k.dtype) for k in trace.kernels if k.is_collective)
    assert ours, "a two-rank layout has collectives"
    for rank in ranks:
        theirs = Counter((tuple(c["shape"]), c["group_size"], c["dtype"]) for c in rank["collectives"]
                         if c["group_size"] > 1)  # fmt: skip
        assert theirs == ours, f"rank {rank['rank']}: DeepSpeed {dict(theirs)} vs freqopt {dict(ours)}"
    if layout.tp > 1:  # the activation all-reduces: 2 in forward and 4 in backward per block
        d, blocks = ds_profile.TINY_GPT["d_model"], ds_profile.TINY_GPT["n_layers"]
        assert ours[((MICRO_BATCH, ds_profile.TINY_GPT["seq_len"], d), 2, "float32")] == 6 * blocks
    else:  # one bucket holding every gradient
        assert ours[((trace.meta["n_params"],), 2, "float32")] == 1
