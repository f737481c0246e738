"""Phases and switching costs: where a runtime can switch, what it realizes, and what a late switch costs."""

import numpy as np
import pytest
import torch

from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.workload.models import Workload, build_model, get_workload
from freqopt.workload.models.gpt3 import GPTConfig
from freqopt.workload.phases import STEP_MARK, PhaseHooks, phase_spans, quiet_backward_hooks
from freqopt.search.realize import realizable_settings
from freqopt.workload.trace import trace_iteration

TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16)
LOW, HIGH = ClockSetting(1200, 2619), ClockSetting(1800, 2619)


def test_the_runtime_sees_the_marks_the_tracer_recorded():
    trace = trace_iteration(Workload("tiny", TINY, 2), "train", dtype=torch.float32)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    seen = []
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    with PhaseHooks(model, seen.append) as hooks:
        loss = model(idx, idx)
        with quiet_backward_hooks():
            loss.backward()
        hooks.mark_step()
    assert seen == [label for label, _ in trace.meta["marks"]]
    assert seen[-1] == STEP_MARK and seen[0] == "fwd:wte" and "bwd:layers.1.mlp" in seen


def test_phase_spans_cover_every_kernel_once():
    marks = [("a", 0), ("b", 3), ("c", 3), ("d", 7)]
    assert phase_spans(marks, 9) == [("a", 0, 3), ("c", 3, 7), ("d", 7, 9)]


def test_a_uniform_schedule_is_realized_as_is_however_short():
    times = np.full(10, 1e-4)  # 1 ms in all, far below a 6 ms switch
    assert realizable_settings([("a", 0), ("b", 5)], [LOW] * 10, times, 6e-3) == [LOW] * 10


def test_short_runs_keep_the_clocks_already_set():
    marks = [(f"p{i}", 10 * i) for i in range(4)]
    times = np.array([1e-3] * 10 + [1e-4] * 10 + [1e-3] * 20)  # phases of 10, 1, 10, 10 ms
    wanted = [HIGH] * 10 + [LOW] * 10 + [HIGH] * 10 + [LOW] * 10
    realized = realizable_settings(marks, wanted, times, 6e-3)
    assert realized[10:20] == [HIGH] * 10  # a 1 ms phase is not worth a 6 ms switch
    assert realized[30:40] == [LOW] * 10 and realized[:10] == [HIGH] * 10
    # A phase's setting is the one its kernels spend most time in.
    mixed = [HIGH] * 3 + [LOW] * 7 + [HIGH] * 30
    assert realizable_settings(marks[:1], mixed, np.full(40, 1e-3), 6e-3) == [HIGH] * 40


@pytest.mark.slow
def test_a_switch_lands_one_latency_late():
    spec = get_gpu("h100-sxm")
    sim = SimulatedGPU(spec, noise=False)
    trace = trace_iteration(get_workload("gpt3-xl"), "train")  # 150 ms iterations: both switches land inside
    half = len(trace) // 2
    settings = [LOW] * half + [DEFAULT_SETTING] * (len(trace) - half)
    time_s, _, _ = sim.run(trace.kernels, settings, loop=True)
    starts = np.cumsum(time_s) - time_s
    latency = spec.clock_switch_s
    assert starts[half] + latency < time_s.sum()
    effective = sim._delayed(trace.kernels, settings, latency)
    for start, got in zip(starts, effective):
        # LOW is asked for at 0 and lands at the latency; DEFAULT is asked for at starts[half] and lands later.
        expected = LOW if latency <= start < starts[half] + latency else DEFAULT_SETTING
        assert got == expected
    free = sim.measure_schedule(trace.kernels, settings)
    late = sim.measure_schedule(trace.kernels, settings, switching=True)
    assert late.time_s != free.time_s
    uniform = [LOW] * len(trace)
    assert sim.measure_schedule(trace.kernels, uniform, switching=True) == sim.measure_schedule(trace.kernels, uniform)


def test_a_switch_asked_for_while_the_set_call_before_runs_waits_for_it():
    """Issue 35, item 6: one runtime thread serves set calls one at a time (nvml_call_s each), so a change asked for
    less than a call after the one before lands a call later than one latency after it is asked for; one still
    waiting when a newer one comes is never served."""
    spec = get_gpu("h100-sxm")
    sim = SimulatedGPU(spec, noise=False)
    trace = trace_iteration(get_workload("gpt3-xl"), "train")
    time_s, _, _ = sim.run(trace.kernels, [DEFAULT_SETTING] * len(trace), loop=True)
    starts = np.cumsum(time_s) - time_s
    first = int(np.searchsorted(starts, 0.040))  # LOW asked for 40 ms in
    second = int(np.searchsorted(starts, starts[first] + spec.nvml_call_s / 3))  # DEFAULT a third of a call later
    third = int(np.searchsorted(starts, starts[first] + spec.nvml_call_s / 2))

    def kernel_starts(settings):  # as _delayed times them: the kernels at the settings asked for
        t, _, _ = sim.run(trace.kernels, settings, loop=True)
        return np.cumsum(t) - t

    settings = [DEFAULT_SETTING] * first + [LOW] * (second - first) + [DEFAULT_SETTING] * (len(trace) - second)
    at = kernel_starts(settings)
    assert at[second] < at[first] + spec.nvml_call_s  # DEFAULT is asked for while LOW's call runs
    low = at[[i for i, s in enumerate(sim._delayed(trace.kernels, settings, spec.clock_switch_s)) if s == LOW]]
    # LOW lands one latency after it is asked for; DEFAULT's call starts when LOW's ends, and lands a latency on.
    assert low.min() >= at[first] + spec.clock_switch_s
    assert at[first] + spec.nvml_call_s + spec.clock_switch_s - 0.002 <= low.max()
    assert low.max() < at[first] + spec.nvml_call_s + spec.clock_switch_s
    # LOW asked for again before DEFAULT's call starts drops DEFAULT: LOW holds from its landing to the end.
    again = settings[:third] + [LOW] * (len(trace) - third)
    at = kernel_starts(again)
    held = sim._delayed(trace.kernels, again, spec.clock_switch_s)
    assert all(s == LOW for s, t in zip(held, at) if t >= at[first] + spec.clock_switch_s)
    assert any(s == LOW for s, t in zip(held, at) if t >= at[first] + spec.nvml_call_s + spec.clock_switch_s)


def test_the_realizer_weighs_kernels_by_the_backend_it_is_given():
    """Realizer(trace, backend) takes its kernel times from backend.kernel_times_s at the default setting: on the
    simulated GPU, the noiseless physics whatever the backend's noise; a backend with other times realizes the
    same schedule differently."""
    from freqopt.search.realize import Realizer

    spec = get_gpu("h100-sxm")
    trace = trace_iteration(Workload("tiny", TINY, 2), "train", dtype=torch.float32)
    sim = SimulatedGPU(spec, seed=5)  # noisy measurements; kernel times are noiseless
    expected, _, _ = SimulatedGPU(spec, noise=False).run(trace.kernels, [DEFAULT_SETTING] * len(trace), loop=True)
    realizer = Realizer(trace, sim)
    assert np.array_equal(realizer.kernel_time_s, expected)

    class Slow(SimulatedGPU):  # every kernel a millisecond: every phase outlasts the switch
        def kernel_times_s(self, kernels, setting):
            return np.full(len(kernels), 1e-3)

    wanted = tuple(LOW if k.pass_name == "backward" else HIGH for k in trace.kernels)
    # A tiny model's phases are far shorter than a switch: none is made, the clocks stay as they were set.
    assert realizer(wanted) == (DEFAULT_SETTING,) * len(trace)
    assert set(Realizer(trace, Slow(spec))(wanted)) == {LOW, HIGH}  # switches into forward and backward
