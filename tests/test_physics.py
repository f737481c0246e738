"""The simulated GPU's physics (freqopt/gpu/backends/simulated.py's module docstring)."""

import dataclasses

import numpy as np
import pytest

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import KernelPhysics, SimulatedGPU
from freqopt.gpu.specs import get_gpu
from freqopt.workload.trace import Kernel

H100 = get_gpu("h100-sxm")
N = 8192
GEMM = Kernel("aten.mm", "gemm", "forward", 2.0 * N**3, 3.0 * N * N * 2, "bfloat16", ((N, N), (N, N)), True)
COPY = Kernel("aten.add", "elementwise", "forward", 0.0, 3 * 2.0 * 2**28, "bfloat16", ((2**28,), (2**28,)))


def physics(kernel, spec=H100):
    return KernelPhysics(spec, [kernel], np.array([spec.max_mem_clock_mhz]))


def at(spec, clock):
    return spec.sm_clocks_mhz.index(clock)


def test_memory_bound_time_barely_moves_with_sm_clock():
    p = physics(COPY)
    t_max, t_lower = p.time_s[0, -1], p.time_s[0, at(H100, 1200)]
    assert t_lower / t_max < 1.03  # 40 % lower clock, under 3 % slower


def test_compute_bound_time_scales_with_sm_clock():
    p = physics(GEMM)
    ratio = p.time_s[0, at(H100, 990)] / p.time_s[0, at(H100, 1980)]
    assert ratio == pytest.approx(2.0, rel=0.05)


def test_power_rises_with_clock_and_activity():
    for kernel in (GEMM, COPY):
        power = physics(kernel).power_w[0]
        assert np.all(np.diff(power) > 0)
    assert physics(GEMM).power_w[0, -1] > physics(COPY).power_w[0, -1]


def test_memory_clock_matters_for_memory_bound_kernels():
    g = get_gpu("rtx3080ti")
    fast = KernelPhysics(g, [COPY], np.array([9501.0])).time_s[0, -1]
    slow = KernelPhysics(g, [COPY], np.array([5001.0])).time_s[0, -1]
    assert slow / fast == pytest.approx(9501 / 5001, rel=0.05)


def test_lowering_sm_clock_saves_energy_on_memory_bound_kernels():
    e = physics(COPY).energy_j[0]
    assert e[at(H100, 1200)] < 0.85 * e[-1]


def test_power_limit_throttles_dense_gemm():
    """An H200-class GPU at 700 W cannot hold its top clock on dense GEMM (published.md: ~1500 MHz sustained)."""
    sim = SimulatedGPU(H100, noise=False)
    _, _, clocks = sim.run([GEMM] * 50, [ClockSetting()] * 50, loop=True)
    assert 1400 <= clocks.mean() <= 1600
    m = sim.true_measure([GEMM] * 50, ClockSetting())
    assert m.avg_power_w <= H100.power_limit_default_w + 1e-6
    capped = sim.true_measure([GEMM] * 50, ClockSetting(power_limit_w=400))
    assert capped.avg_power_w <= 400 + 1e-6 and capped.time_s > m.time_s


def test_memory_bound_kernel_is_not_throttled():
    sim = SimulatedGPU(H100, noise=False)
    _, _, clocks = sim.run([COPY], [ClockSetting()], loop=True)
    assert clocks[0] == H100.max_sm_clock_mhz


def test_measurements_are_deterministic_per_seed_and_noisy_about_half_a_percent():
    kernels = [COPY] * 4
    a = [SimulatedGPU(H100, seed=1).measure(kernels, ClockSetting(), key="u") for _ in range(2)]
    b = [SimulatedGPU(H100, seed=1).measure(kernels, ClockSetting(), key="u") for _ in range(2)]
    assert a == [a[0], a[1]] and [m.energy_j for m in a] == [m.energy_j for m in b]
    sim = SimulatedGPU(H100, seed=2)
    true = sim.true_measure(kernels, ClockSetting()).energy_j
    samples = np.array([sim.measure(kernels, ClockSetting(), key="u").energy_j for _ in range(400)]) / true
    assert abs(samples.mean() - 1) < 0.002
    assert 0.003 < samples.std() < 0.008
    assert sim.measure(kernels, ClockSetting(), key="u").cost_gpu_s > 0


def test_a_measurement_is_charged_the_whole_steps_it_ran():
    """Issue 35, item 7: a measurement replays whole steps through its warm-up and its window, so a long step's
    costs two steps (a 508 s step was charged about 1 s), a short one's the protocol's durations rounded up to
    whole steps."""
    from freqopt.gpu.backends.base import MeasurementProtocol

    protocol, period = MeasurementProtocol(), H100.energy_counter_period_s
    fixed = protocol.cost_gpu_s(period)
    assert fixed == pytest.approx(protocol.warmup_s + protocol.window_s(period))
    assert protocol.cost_gpu_s(period, 508.0) == pytest.approx(1016.0)
    short = protocol.cost_gpu_s(period, 0.027)
    assert fixed <= short < fixed + 2 * 0.027 and short / 0.027 == pytest.approx(round(short / 0.027))
    sim = SimulatedGPU(H100, seed=0)
    kernels = [COPY] * 4
    true = sim.true_measure(kernels, ClockSetting())
    assert sim.measure(kernels, ClockSetting(), key="u").cost_gpu_s == pytest.approx(
        protocol.cost_gpu_s(period, true.time_s))
    step = sim.step(kernels)
    assert sim.measure_schedule(kernels, [ClockSetting()] * 4).cost_gpu_s == pytest.approx(
        protocol.cost_gpu_s(period, step.time_s))


def test_unsupported_clock_is_refused():
    from freqopt.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError):
        SimulatedGPU(H100).measure([COPY], ClockSetting(sm_clock_mhz=1234))


# -- host issue time (launch-bound steps) -----------------------------------------------------------------------------

from freqopt.gpu.backends.simulated import host_gaps  # noqa: E402

TINY = Kernel("aten.add", "elementwise", "forward", 0.0, 3 * 2.0 * 1024, "bfloat16", ((1024,), (1024,)))


def test_host_gaps_follow_the_issue_times():
    """A GPU faster than the host waits for each kernel; one slower than it never waits after the first."""
    on = np.ones(3, dtype=bool)
    fast_gpu = host_gaps(np.array([1.0, 1.0, 1.0]), np.array([2.0, 2.0, 2.0]), on, loop=False)
    np.testing.assert_allclose(fast_gpu, [2.0, 1.0, 1.0])  # starts at 2, 4, 6: each waits for its issue
    slow_gpu = host_gaps(np.array([5.0, 5.0, 5.0]), np.array([1.0, 1.0, 1.0]), on, loop=False)
    np.testing.assert_allclose(slow_gpu, [1.0, 0.0, 0.0])
    # Short kernels after a long one find the host ahead, until the burst catches up with it (issued at 2.5).
    mixed = host_gaps(np.array([1.0, 0.1, 0.1, 0.1]), np.array([1.0, 0.5, 0.5, 0.5]), np.ones(4, bool), loop=False)
    np.testing.assert_allclose(mixed, [1.0, 0.0, 0.0, 0.3], atol=1e-12)
    # In a back-to-back loop the period is the slower side's: host 6 against GPU 3, then GPU 15 against host 3.
    assert host_gaps(np.array([1.0, 1.0, 1.0]), np.array([2.0, 2.0, 2.0]), on, loop=True).sum() == pytest.approx(3.0)
    assert host_gaps(np.array([5.0, 5.0, 5.0]), np.array([1.0, 1.0, 1.0]), on, loop=True).sum() == 0.0


def test_communication_kernels_do_not_wait_for_the_host():
    gaps = host_gaps(np.array([1.0, 1.0]), np.array([2.0, 2.0]), np.array([True, False]), loop=False)
    assert gaps[1] == 0.0


def test_launch_bound_kernels_idle_at_the_context_power():
    """Tiny kernels of a training step on the H100: the step takes the host's time per kernel (a replay's issue
    time and the training step's framework time of the kernel's pass) and draws little more than the idle power
    with a context open (~124 W measured, experiments/data/h100)."""
    gpu = SimulatedGPU(H100, noise=False)
    n = 50
    time_s, energy_j, _ = gpu.run([TINY] * n, [ClockSetting()] * n, loop=False)
    assert H100.step_host_s["forward"] > 0
    assert time_s.sum() == pytest.approx(n * (H100.host_issue_s + H100.step_host_s["forward"]), rel=0.05)
    baseline = physics(TINY).baseline_power_w[0, -1]
    assert baseline < energy_j.sum() / time_s.sum() < baseline + 60


def test_a_replay_loop_pays_a_replays_host_time_and_a_step_its_passes():
    """A unit's replay issues operators back to back (no autograd, no modules): only ``host_issue_s`` per kernel;
    a training step's host costs more per kernel, most in the forward pass (h100_steps.HOST_SPLIT_US)."""
    gpu = SimulatedGPU(H100, noise=False)
    n = 50
    replay, _, _ = gpu.run([TINY] * n, [ClockSetting()] * n, loop=True)
    assert replay.sum() == pytest.approx(n * H100.host_issue_s, rel=0.05)
    by_pass = {}
    for name in ("forward", "backward", "optimizer"):
        kernel = dataclasses.replace(TINY, pass_name=name)
        by_pass[name] = gpu.step([kernel] * n).time_s
    assert by_pass["forward"] > by_pass["backward"] > by_pass["optimizer"] > replay.sum()


def test_the_waiting_part_of_a_step_is_its_host_gaps_at_the_baseline_power():
    """SimulatedGPU.waiting (issue 35, item 4): a launch-bound step is mostly the GPU waiting, at its baseline power;
    a lower clock lowers that power and not the wait; a step of large GEMMs barely waits."""
    gpu = SimulatedGPU(H100, noise=False)
    n = 50
    step, waiting = gpu.step([TINY] * n), gpu.waiting([TINY] * n)
    assert 0.8 * step.time_s < waiting.time_s < step.time_s
    baseline = physics(TINY).baseline_power_w[0, -1]
    assert waiting.energy_j == pytest.approx(waiting.time_s * baseline, rel=1e-6)
    low = [ClockSetting(sm_clock_mhz=H100.sm_clocks_mhz[len(H100.sm_clocks_mhz) // 2])] * n
    assert gpu.waiting([TINY] * n, low).time_s == pytest.approx(waiting.time_s, rel=0.01)
    assert gpu.waiting([TINY] * n, low).energy_j < 0.95 * waiting.energy_j
    assert gpu.waiting([GEMM] * 4).time_s < 0.01 * gpu.step([GEMM] * 4).time_s


def test_an_infinitely_fast_host_leaves_no_gaps():
    """Every GPU type's step is issued by a host (tests/test_host.py); one that issues in no time leaves the kernels'
    own times."""
    from freqopt.gpu.host import HostSpec

    v100 = get_gpu("v100-pcie").with_host(HostSpec("instant", 0.0, 0.0, {"forward": 0.0, "backward": 0.0}))
    assert v100.host_issue_s == 0.0 and v100.host == "instant"
    time_s, _, _ = SimulatedGPU(v100, noise=False).run([TINY] * 5, [ClockSetting()] * 5, loop=False)
    np.testing.assert_allclose(time_s, physics(TINY, v100).time_s[0, -1])


def test_short_inner_dimension_gemms_draw_less_and_throttle_less():
    """Measured on the H100: an 8192^3 GEMM is held lower (1358 MHz) than the GPT-3 Small MLP GEMM (1467 MHz)."""
    gpu = SimulatedGPU(H100, noise=False)
    mlp = Kernel("aten.mm", "gemm", "forward", 2.0 * 8192 * 768 * 3072, 2.0 * (8192 * 768 + 768 * 3072 + 8192 * 3072),
                 "bfloat16", ((8192, 768), (768, 3072)), True)  # fmt: skip
    big, short = gpu.true_measure([GEMM], ClockSetting()), gpu.true_measure([mlp], ClockSetting())
    assert big.sm_clock_mhz < short.sm_clock_mhz < 1980


def test_simulated_gpu_backend_interface():
    """apply records a supported setting and refuses others; energy_j counts each measurement's replay loop (its
    average power over the protocol's GPU-seconds, at 1 mJ); the context manager closes the backend."""
    from freqopt.errors import InvalidSettingError

    with SimulatedGPU(H100, noise=False) as gpu:
        assert gpu.name == "sim" and gpu.simulated
        assert gpu.applied == ClockSetting()
        gpu.apply(ClockSetting(sm_clock_mhz=1200, mem_clock_mhz=2619, power_limit_w=500.0))
        assert gpu.applied == ClockSetting(1200, 2619, 500.0)
        with pytest.raises(InvalidSettingError):
            gpu.apply(ClockSetting(sm_clock_mhz=1201))
        with pytest.raises(InvalidSettingError):
            gpu.apply(ClockSetting(power_limit_w=5000.0))
        assert gpu.applied == ClockSetting(1200, 2619, 500.0)  # a refused setting leaves the held one
        assert gpu.energy_j() == 0.0
        m = gpu.measure([GEMM, COPY], ClockSetting(sm_clock_mhz=1200))
        assert gpu.energy_j() == pytest.approx(m.avg_power_w * m.cost_gpu_s, abs=1e-3)
        before = gpu.energy_j()
        s = gpu.measure_schedule([GEMM, COPY], [ClockSetting(1200), ClockSetting(1500)])
        assert gpu.energy_j() - before == pytest.approx(s.avg_power_w * s.cost_gpu_s, abs=2e-3)
        gpu.true_measure([GEMM, COPY], ClockSetting())  # the oracle's view runs nothing
        assert gpu.energy_j() - before == pytest.approx(s.avg_power_w * s.cost_gpu_s, abs=2e-3)


@pytest.mark.slow
def test_kernel_terms_computed_once_give_the_same_physics():
    """KernelPhysics with KernelTerms computed earlier (as SimulatedGPU keeps them per kernel list) gives exactly the
    arrays it computes on its own, at any memory clocks."""
    from freqopt.gpu.backends.physics import KernelPhysics, KernelTerms
    from freqopt.gpu.specs import get_gpu
    from freqopt.workload.models import get_workload
    from freqopt.workload.trace import trace_iteration

    spec = get_gpu("h100-sxm")
    kernels = trace_iteration(get_workload("gpt3-small"), "train").kernels
    terms = KernelTerms(spec, kernels)
    for mem in spec.mem_clocks_mhz:
        m = np.full(len(kernels), float(mem))
        alone, shared = KernelPhysics(spec, kernels, m), KernelPhysics(spec, kernels, m, terms=terms)
        for name in ("time_s", "power_w", "energy_j", "baseline_power_w"):
            np.testing.assert_array_equal(getattr(alone, name), getattr(shared, name))


def test_a_power_limit_below_what_the_lowest_clock_draws_is_run_there_and_reported_not_met():
    """Issue 56, item 2: the firmware runs the highest clock whose window average meets the limit; where even the
    lowest clock draws more, the GPU runs there, above the limit, and the measurement says the limit was not met."""
    spec = dataclasses.replace(H100, power_limit_min_w=1.0)  # let the test ask for any limit
    gpu = SimulatedGPU(spec, noise=False)
    kernels = [GEMM] * 4
    lowest = gpu.true_measure(kernels, ClockSetting(sm_clock_mhz=min(spec.sm_clocks_mhz)))
    below = lowest.avg_power_w * 0.8  # a limit the lowest clock cannot hold
    unmet = gpu.true_measure(kernels, ClockSetting(power_limit_w=below))
    assert unmet.power_limit_met is False
    assert unmet.avg_power_w > below
    assert unmet.sm_clock_mhz == pytest.approx(min(spec.sm_clocks_mhz))
    assert unmet.avg_power_w == pytest.approx(lowest.avg_power_w)
    held = gpu.true_measure(kernels, ClockSetting(power_limit_w=lowest.avg_power_w * 1.5))
    assert held.power_limit_met is True and held.avg_power_w <= lowest.avg_power_w * 1.5 + 1e-9
    assert gpu.step(kernels, [ClockSetting(power_limit_w=below)] * 4).power_limit_met is False
    assert SimulatedGPU(spec, seed=1).measure(kernels, ClockSetting(power_limit_w=below)).power_limit_met is False
    assert "power_limit_met=False" in repr(unmet)
