"""The trace's module fingerprint (freqopt.workload.fingerprint) and DVFSRuntime in a user's own training loop: a trace of
another module is refused, a matching one is followed, and PyTorch's backward-hook warning never reaches the user."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.errors import TraceMismatchError
from freqopt.workload.fingerprint import (FINGERPRINT_KEY, TraceFingerprintWarning, check_trace_module, module_fingerprint,
                                 unwrap_module)
from freqopt.gpu.specs import get_gpu
from freqopt.workload.layout import Layout
from freqopt.workload.models import Workload, build_model, get_workload
from freqopt.workload.models.gpt3 import GPTConfig
from freqopt.workload.models.parallel import shard_tensor_parallel
from freqopt.workload.phases import HOOK_WARNING, PhaseHooks
from freqopt.apply.runtime import DVFSRuntime
from freqopt.tables import ClockTable, workload_doc
from freqopt.workload.trace import Trace, trace_training_iteration

H100 = get_gpu("h100-sxm")
TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16)
INSTANT = dataclasses.replace(H100, clock_switch_s=0.0)  # an H100 whose clock switches land at once


def pass_table(forward: int, backward: int, optimizer: int, workload=None) -> ClockTable:
    """A pass-level table, found for ``workload`` when given (the runtime refuses another workload's table)."""
    entries = [{"unit": p, "sm_clock_mhz": c, "mem_clock_mhz": 2619, "power_limit_w": None}
               for p, c in (("forward", forward), ("backward", backward), ("optimizer", optimizer))]  # fmt: skip
    doc = {"granularity": "pass", "entries": entries, "gpu": {"name": "h100-sxm"}}
    return ClockTable({**doc, "workload": workload_doc(workload)} if workload is not None else doc)


def hook_warnings(caught) -> list:
    return [w for w in caught if HOOK_WARNING in str(w.message)]


def test_the_trace_records_the_fingerprint_of_the_module_it_traced():
    trace = trace_training_iteration(Workload("tiny", TINY, 2))
    # Device and dtype do not matter: the trace's module is bf16 on "meta", the trained one fp32 on the CPU.
    assert trace.meta[FINGERPRINT_KEY] == module_fingerprint(build_model(TINY, device="cpu", dtype=torch.float32))
    wider = dataclasses.replace(TINY, d_model=128)
    deeper = dataclasses.replace(TINY, n_layers=3)
    assert len({module_fingerprint(build_model(c)) for c in (TINY, wider, deeper)}) == 3


def test_a_tensor_parallel_trace_matches_one_rank_of_the_sharded_module():
    config = dataclasses.replace(TINY, n_heads=4)
    trace = trace_training_iteration(Workload("tiny", config, 1, Layout(dp=1, tp=2)))
    rank = shard_tensor_parallel(build_model(config, device="cpu", dtype=torch.float32), 2)
    check_trace_module(trace, rank)  # one rank's shapes: accepted
    with pytest.raises(TraceMismatchError, match=r"dp=1/tp=2"):
        check_trace_module(trace, build_model(config, device="cpu", dtype=torch.float32))  # the whole model


def test_wrappers_are_looked_through_and_zero3_shapes_read_from_ds_shape():
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    trace = trace_training_iteration(Workload("tiny", TINY, 2))

    class DeepSpeedEngine(nn.Module):  # what unwrap_module recognizes of deepspeed.DeepSpeedEngine: name, .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    engine = DeepSpeedEngine(model)
    assert unwrap_module(engine) is model
    check_trace_module(trace, engine)
    # ZeRO stage 3 leaves each rank an empty partition and the full shape in ds_shape.
    zero3 = build_model(TINY, device="cpu", dtype=torch.float32)
    for p in zero3.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    check_trace_module(trace, zero3)
    for p in zero3.parameters():
        del p.ds_shape
    with pytest.raises(TraceMismatchError):
        check_trace_module(trace, zero3)


def test_runtime_refuses_a_trace_of_another_module_in_one_line():
    trace = trace_training_iteration(get_workload("gpt3-small", seq_len=64, micro_batch_size=1))
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    with pytest.raises(TraceMismatchError) as info:
        DVFSRuntime(model, None, table=None, backend=SimulatedGPU(H100), trace=trace)
    message = str(info.value)
    assert "\n" not in message and "gpt3-small" in message and "trace the model you train" in message
    assert f"{trace.meta['n_params']:,}" in message and f"{sum(p.numel() for p in model.parameters()):,}" in message
    assert not model._forward_pre_hooks  # refused before any hook was installed


def test_a_trace_without_fingerprint_is_followed_with_a_warning():
    trace = trace_training_iteration(Workload("tiny", TINY, 2))
    old = Trace(trace.workload, trace.kernels, {k: v for k, v in trace.meta.items() if k != FINGERPRINT_KEY})
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    with pytest.warns(TraceFingerprintWarning, match="trace the workload again"):
        runtime = DVFSRuntime(model, None, table=None, backend=SimulatedGPU(H100), trace=old)
    assert runtime.plan.settings and set(runtime.plan.settings) == {DEFAULT_SETTING}


def test_phase_hooks_alone_raise_the_backward_hook_warning():
    """The control for the next test: without the runtime, PyTorch does warn (so its absence there means
    something)."""
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    with warnings.catch_warnings(record=True) as caught, PhaseHooks(model, lambda label: None):
        warnings.simplefilter("always")
        model(idx, idx).backward()
    assert hook_warnings(caught)


@pytest.mark.slow
def test_user_loop_with_gpt3_small_under_the_runtime():
    """A user's own loop: gpt3-small (seq_len 32) trained on the CPU, the runtime on a simulated H100 whose clock
    switches are instant (so every pass boundary switches), the matching trace, a pass table."""
    workload = get_workload("gpt3-small", seq_len=32, micro_batch_size=1)
    trace = trace_training_iteration(workload)
    torch.manual_seed(0)
    model = build_model(workload.config, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    table = pass_table(1500, 1200, 1005, workload)
    steps = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters_before = list(warnings.filters)
        with DVFSRuntime(model, optimizer, table=table, backend=SimulatedGPU(INSTANT, noise=False),
                         trace=trace) as runtime:  # fmt: skip
            for _ in range(steps):
                idx = torch.randint(0, workload.config.vocab_size, (1, 32))
                loss = model(idx, idx)
                loss.backward()  # no quiet_backward_hooks(): the runtime silences the hook warning itself
                optimizer.step()
                optimizer.zero_grad()
            measured = runtime.step_measurement()
        assert warnings.filters == filters_before  # the runtime's filter is gone once it exits
        warnings.warn(HOOK_WARNING + " (after the runtime)")
    assert not hook_warnings(caught[:-1]) and hook_warnings(caught[-1:])
    assert set(runtime.plan.settings) == {ClockSetting(1500, 2619), ClockSetting(1200, 2619), ClockSetting(1005, 2619)}
    # Per step: into forward (the clocks start at the optimizer's, the last phase's), backward, optimizer.
    assert runtime.switches == 3 * steps
    default = SimulatedGPU(INSTANT, noise=False).measure_schedule(trace.kernels, [DEFAULT_SETTING] * len(trace))
    assert measured.energy_j < default.energy_j
