"""The DVFS runtime and `freqopt train`: phases followed through hooks, switches off the training thread, the
simulated timeline, and the GPU restored on every exit path (SIGTERM mid-run; `freqopt reset` after SIGKILL)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.cli import main
from freqopt.gpu.specs import get_gpu
from freqopt.workload.models import Workload, build_model
from freqopt.workload.models.gpt3 import GPTConfig
from freqopt.workload.phases import quiet_backward_hooks
from freqopt.apply.runtime import _STOP, DVFSRuntime, ClockWorker, plan_phases
from freqopt.tables import ClockTable, workload_doc
from freqopt.workload.trace import trace_training_iteration

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import FakeGPU, FakeNVML  # noqa: E402

H100 = get_gpu("h100-sxm").with_switch_latency(0.006)  # the GH200's 6 ms: this file's 2-layer phases can switch
TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16)


WIDE = Workload("wide", GPTConfig(n_layers=2, d_model=2048, n_heads=16, seq_len=2048), 4)


def pass_table(forward: int, backward: int, workload: Workload = WIDE) -> ClockTable:
    """A pass-level table for ``workload`` (by default WIDE: phases of milliseconds on an H100, followed through
    the hooks of a TINY model, which has the same phase modules)."""
    entries = [{"unit": p, "sm_clock_mhz": c, "mem_clock_mhz": 2619, "power_limit_w": None}
               for p, c in (("forward", forward), ("backward", backward))]  # fmt: skip
    return ClockTable({"granularity": "pass", "entries": entries, "gpu": {"name": "h100-sxm"},
                       "workload": workload_doc(workload)})  # fmt: skip


def train_steps(runtime_model, optimizer, steps=2):
    for _ in range(steps):
        idx = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
        loss = runtime_model(idx, idx)
        with quiet_backward_hooks():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_plan_phases_refuses_a_gpu_type_for_a_backend():
    """Realization times kernels on a backend; a GPU type (what plan_phases took before) gets one clear line."""
    from freqopt.errors import InvalidSettingError

    trace = trace_training_iteration(Workload("tiny", TINY, 2))
    with pytest.raises(InvalidSettingError, match="backend must be a Backend.*not GPUSpec"):
        plan_phases(pass_table(1500, 1500), trace, H100)
    assert plan_phases(None, trace, SimulatedGPU(H100)).settings  # a backend is taken


def test_simulated_runtime_measures_the_phases_it_requested():
    # A big trace for the GPU timeline (phases of milliseconds), driven by a tiny model's hooks: same phase modules.
    trace = trace_training_iteration(WIDE)
    sim = SimulatedGPU(H100, noise=False)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    table = pass_table(1500, 1200)
    with DVFSRuntime(model, optimizer, table=table, backend=sim, trace=trace, check_trace=False) as runtime:
        train_steps(model, optimizer)
        measured = runtime.step_measurement()
        plan = runtime.plan
    assert set(plan.settings) == {ClockSetting(1500, 2619), ClockSetting(1200, 2619)}
    assert sim.applied == plan.settings[-1]  # the worker applied the last phase's setting to the simulated GPU
    expected = sim.measure_schedule(trace.kernels, plan.per_kernel(list(plan.settings), len(trace)), switching=True)
    assert measured == expected
    default = sim.measure_schedule(trace.kernels, plan_phases(None, trace, sim).per_kernel(
        list(plan_phases(None, trace, sim).settings), len(trace)))  # fmt: skip
    assert measured.energy_j < default.energy_j and measured.time_s > default.time_s
    assert runtime.switches == 2 * 2  # into backward and back into forward, per step


def test_runtime_switches_through_the_worker_and_restores(fake_gpu):
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices

    # Phases of milliseconds (a wide 2-layer model's trace) followed through a tiny model's hooks (same modules).
    trace = trace_training_iteration(WIDE)
    backend = NVMLBackend(open_devices()[0], torch_device="cpu")
    # The phases are weighed by the kernels' times on an H100 (the simulated physics), not by replaying this wide
    # model's kernels on the CPU (minutes); NVMLBackend.kernel_times_s itself is tested in test_nvml.py.
    backend.kernel_times_s = SimulatedGPU(backend.spec, noise=False).kernel_times_s
    backend.spec = backend.spec.with_switch_latency(H100.clock_switch_s)  # 6 ms, as the simulated tests here
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    with DVFSRuntime(model, optimizer, table=pass_table(1500, 1200), backend=backend, trace=trace,
                     check_trace=False) as runtime:
        train_steps(model, optimizer)
    worker = runtime._worker
    assert worker.error is None and runtime.switches == 2 * 2
    # Every request (the first clocks, then each switch) was applied, superseded by a later one, or skipped.
    assert worker.n_applied + worker.n_superseded + worker.n_skipped == 1 + runtime.switches
    locks = [c[2] for c in fake_gpu.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
    assert len(locks) == worker.n_applied >= 2 and set(locks) == {1500, 1200}  # forward and backward clocks
    assert all(a != b for a, b in zip(locks, locks[1:]))  # a switch only where the setting changes
    gpu = fake_gpu.gpus[0]
    assert (gpu.locked_sm_mhz, gpu.power_limit_mw) == (None, 650_000)


class SlowSetGPU(SimulatedGPU):
    """The simulated GPU with a set call that blocks for ``set_s`` (NVML's take 10-20 ms, ml-energy/zeus #29), and
    counts its calls."""

    def __init__(self, *args, set_s: float = 0.05, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_s, self.calls = set_s, []

    def apply(self, setting):
        time.sleep(self.set_s)
        self.calls.append(setting)
        super().apply(setting)


class GatedSetGPU(SimulatedGPU):
    """The simulated GPU whose set call blocks until ``gate`` opens (a set call that takes as long as the test
    wants), recording the threads that call it and the calls that finished."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.started, self.finished = threading.Event(), [], []

    def apply(self, setting):
        self.started.append(threading.get_ident())
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the gate never opened")
        self.finished.append(setting)
        super().apply(setting)


def test_a_slow_set_call_never_blocks_the_training_thread():
    """The set call blocks until the test opens its gate, after three whole training steps: had the training
    thread called it (or waited for it) at any phase boundary, the steps could not have finished first. No timing:
    a timed check is flaky on a loaded machine (a hook preempted for 42 ms failed one)."""
    trace = trace_training_iteration(WIDE)
    gated = GatedSetGPU(H100, noise=False)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    runtime = DVFSRuntime(model, optimizer, table=pass_table(1500, 1200), backend=gated, trace=trace,
                          check_trace=False)  # fmt: skip
    with runtime:
        train_steps(model, optimizer, steps=3)
        assert runtime.switches == 2 * 3  # every phase boundary went through the handler and asked for a switch
        assert gated.finished == []  # the steps ran while the first set call was still blocked
        assert gated.started and threading.get_ident() not in gated.started  # called, off the training thread
        gated.gate.set()
    assert gated.finished  # applied once the call returned; the runtime drained its queue on exit


def test_unchanged_settings_make_no_set_call():
    """One setting for the whole iteration: set once, whatever the steps; two: one call per change, never a call
    for the setting the GPU holds already."""
    trace = trace_training_iteration(WIDE)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    uniform = SlowSetGPU(H100, noise=False, set_s=0.0)
    with DVFSRuntime(model, optimizer, table=pass_table(1500, 1500), backend=uniform, trace=trace,
                     check_trace=False) as runtime:  # fmt: skip
        train_steps(model, optimizer, steps=3)
    assert runtime.switches == 0 and uniform.calls == [ClockSetting(1500, 2619)]
    two = SlowSetGPU(H100, noise=False, set_s=0.0)
    with DVFSRuntime(model, optimizer, table=pass_table(1500, 1200), backend=two, trace=trace,
                     check_trace=False) as runtime:  # fmt: skip
        train_steps(model, optimizer, steps=3)
    assert len(two.calls) == runtime._worker.n_applied <= 1 + runtime.switches
    assert all(a != b for a, b in zip(two.calls, two.calls[1:]))
    # The worker itself skips a request for the setting the GPU holds (one a queue of stale requests left).
    worker = ClockWorker(SlowSetGPU(H100, noise=False, set_s=0.0), applied=ClockSetting(1200, 2619))
    for item in [(None, ClockSetting(1200, 2619)), _STOP]:
        worker.requests.put(item)
    worker.run()
    assert worker.backend.calls == [] and worker.n_skipped == 1
    # And a request the GPU has passed the boundary of is superseded by the later one: one call, the latest.
    worker = ClockWorker(SlowSetGPU(H100, noise=False, set_s=0.0))
    for item in [(None, ClockSetting(1500, 2619)), (None, ClockSetting(1200, 2619)), _STOP]:
        worker.requests.put(item)
    worker.run()
    assert worker.backend.calls == [ClockSetting(1200, 2619)] and worker.n_superseded == 1


def test_switches_slower_than_the_plan_assumed_are_reported_and_warned_about(monkeypatch):
    """Each switch is timed: a set call that blocks 50 ms against the plan's 6 ms switch latency is reported late,
    with an ActuationWarning at exit; a set call that takes no time is not. How many requests a slow worker applies
    rather than lets a later one supersede depends on the machine's timing, so the runtime judges from the first
    switch here (MIN_SWITCHES_TO_JUDGE 1); the first request is always applied."""
    import freqopt.apply.runtime as runtime_module
    from freqopt.apply.runtime import ActuationWarning

    monkeypatch.setattr(runtime_module, "MIN_SWITCHES_TO_JUDGE", 1)

    trace = trace_training_iteration(WIDE)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    slow = SlowSetGPU(H100, noise=False, set_s=0.05)
    with pytest.warns(ActuationWarning, match=r"switches took a median \d+\.\d ms .* longer than the 6 ms"):
        with DVFSRuntime(model, optimizer, table=pass_table(1500, 1200), backend=slow, trace=trace,
                         check_trace=False) as runtime:  # fmt: skip
            train_steps(model, optimizer, steps=3)
    report = runtime.actuation()
    assert report["n_switches"] == runtime._worker.n_applied >= 1 and report["late"]
    assert report["median_switch_s"] >= 0.05 and report["assumed_switch_s"] == pytest.approx(0.006)
    assert report["daemon_median_latency_s"] is None  # not set through freqoptd
    fast = SlowSetGPU(H100, noise=False, set_s=0.0)
    with DVFSRuntime(model, optimizer, table=pass_table(1500, 1200), backend=fast, trace=trace,
                     check_trace=False) as runtime:  # fmt: skip
        train_steps(model, optimizer, steps=3)
    assert not runtime.actuation()["late"]
    # Set through freqoptd, the worker keeps the daemon's own timing of each switch's last call.
    through_daemon = SlowSetGPU(H100, noise=False, set_s=0.0)
    through_daemon.device = type("DaemonSet", (), {"last_call": (0.002, 0.015)})()
    worker = ClockWorker(through_daemon)
    for item in [(None, ClockSetting(1500, 2619)), _STOP]:
        worker.requests.put(item)
    worker.run()
    assert worker.daemon_calls == [(0.002, 0.015)] and len(worker.switch_s) == 1


def test_each_request_is_enqueued_one_switch_latency_ahead_of_its_phase():
    """On an H100 (6 ms switches; WIDE's iteration is 22 ms, its forward 8 ms, backward 11 ms) the runtime asks
    for each run's setting at the last phase boundary at least 6 ms of kernel time before the run, computed here
    from the kernel times and the realized (landing) schedule."""
    from freqopt.workload.phases import phase_spans
    from freqopt.search.realize import realizable_settings
    from freqopt.apply.transfer import transfer_table

    latency = H100.clock_switch_s
    trace = trace_training_iteration(WIDE)
    sim = SimulatedGPU(H100, noise=False)
    table = pass_table(1500, 1200)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    runtime = DVFSRuntime(model, optimizer, table=table, backend=sim, trace=trace, check_trace=False)
    enqueued, put = [], runtime._worker.requests.put

    def recording_put(item, *args, **kwargs):
        if item is not _STOP:
            enqueued.append((runtime.plan.labels[runtime._position], item[1]))
        put(item, *args, **kwargs)

    runtime._worker.requests.put = recording_put
    with runtime:
        train_steps(model, optimizer, steps=2)

    # Independently: where each setting must land, and the boundary one latency ahead of it.
    times = sim.kernel_times_s(trace.kernels, ClockSetting())
    spans = phase_spans(trace.meta["marks"], len(trace))
    landed = realizable_settings(trace.meta["marks"], transfer_table(table, trace).per_kernel(), times, latency)
    landing = [landed[a] for _, a, _ in spans]
    duration = [float(times[a:b].sum()) for _, a, b in spans]
    start = [sum(duration[:p]) for p in range(len(spans))]
    total = sum(duration)
    expected = []
    for p in range(len(spans)):
        if landing[p] != landing[p - 1]:  # a run begins: asked for at the last boundary >= 6 ms before it
            ahead = [q for q in range(len(spans)) if (start[p] - start[q]) % total >= latency]
            request = max(ahead, key=lambda q: ((start[q] - start[p]) % total))  # the nearest one before p
            expected.append((request, spans[request][0], landing[p], (start[p] - start[request]) % total))
    expected.sort()
    assert len(expected) == 2 and all(lead >= latency for *_, lead in expected)
    assert any(label not in (spans[p][0] for p in range(len(spans)) if landing[p] != landing[p - 1])
               for _, label, _, _ in expected)  # the look-ahead reaches an earlier phase than the run's own
    per_step = [(label, setting) for _, label, setting, _ in expected]
    assert enqueued[0][1] == runtime.plan.settings[-1]  # the clocks set on entering, before the first step
    assert enqueued[1:] == per_step * 2
    assert runtime.plan.requests == tuple(per_step)


def test_the_runtime_applies_what_the_search_validates():
    """The simulated step of a runtime applying a table is the search's validation of that table (switching
    included): the same realized schedule, requested one latency ahead."""
    from freqopt.search.validate import Validator
    from freqopt.apply.transfer import transfer_table

    trace = trace_training_iteration(WIDE)
    sim = SimulatedGPU(H100, noise=False)
    table = pass_table(1500, 1200)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    with DVFSRuntime(model, optimizer, table=table, backend=sim, trace=trace, check_trace=False) as runtime:
        train_steps(model, optimizer, steps=2)
        measured = runtime.step_measurement()
    validated = Validator(trace, sim, 1, switching=True)(transfer_table(table, trace).per_kernel())
    assert (measured.time_s, measured.energy_j) == pytest.approx((validated.time_s, validated.energy_j), rel=1e-12)
    ideal = Validator(trace, sim, 1)(transfer_table(table, trace).per_kernel())
    assert measured.time_s != ideal.time_s  # switching costs something, so the comparison above means something


def test_the_queue_is_drained_and_the_gpu_restored_at_exit(fake_gpu):
    """Requests queued behind a set call that has not returned when training stops: the worker takes them all
    (applying only the latest) and stops, and the GPU is restored; the same when training raises."""
    import threading

    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices

    trace = trace_training_iteration(WIDE)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    for fail in (False, True):
        backend = NVMLBackend(open_devices()[0], torch_device="cpu")
        backend.kernel_times_s = SimulatedGPU(backend.spec, noise=False).kernel_times_s
        backend.spec = backend.spec.with_switch_latency(H100.clock_switch_s)  # 6 ms: these phases can switch
        gate, apply = threading.Event(), backend.apply
        backend.apply = lambda setting, apply=apply, gate=gate: (gate.wait(30), apply(setting))[1]  # a stuck set call
        runtime = DVFSRuntime(model, optimizer, table=pass_table(1500, 1200), backend=backend, trace=trace,
                              check_trace=False)  # fmt: skip
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
            with runtime:
                train_steps(model, optimizer, steps=3)  # returns although the first set call has not
                # Queued behind the stuck call. On a loaded machine the worker may start late and take the entry
                # request together with the first switch (keeping only the latest): what it took is superseded.
                worker = runtime._worker
                assert runtime.switches == 2 * 3 and worker.n_applied == 0
                assert worker.requests.qsize() + worker.n_superseded == runtime.switches
                gate.set()
                if fail:
                    raise RuntimeError("the training failed")
        worker = runtime._worker
        assert runtime._worker.requests.empty() and not runtime._thread.is_alive()
        assert worker.n_applied + worker.n_superseded + worker.n_skipped == 1 + runtime.switches
        gpu = fake_gpu.gpus[0]
        assert (gpu.locked_sm_mhz, gpu.locked_mem_mhz, gpu.power_limit_mw) == (None, None, 650_000)


def test_the_runtime_refuses_a_table_of_another_workload():
    from freqopt.errors import TableWorkloadError

    trace = trace_training_iteration(WIDE)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    other = Workload("wide", WIDE.config, 8)  # another micro-batch
    with pytest.raises(TableWorkloadError, match=r"was found for wide dp=1,tp=1 micro-batch 8 seq 2048, not wide "
                                                 r"dp=1,tp=1 micro-batch 4 seq 2048: .*`freqopt transfer --table "
                                                 r"the clock table --model wide --layout dp=1,tp=1 "
                                                 r"--micro-batch-size 4 --seq-len 2048`") as caught:  # fmt: skip
        DVFSRuntime(model, None, table=pass_table(1500, 1200, other), backend=SimulatedGPU(H100), trace=trace,
                    check_trace=False)  # fmt: skip
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_cli_train_compare_on_the_simulated_gpu(tmp_path, capsys):
    assert main(["search", "--model", "gpt3-small", "--max-slowdown", "2%", "--granularity", "iteration", "--trials",
                 "3", "--seq-len", "64", "--micro-batch-size", "1", "--out", str(tmp_path / "s")]) == 0  # fmt: skip
    table_path = next((tmp_path / "s").glob("*-iteration.json"))
    out = tmp_path / "train.json"
    assert main(["train", "--model", "gpt3-small", "--seq-len", "64", "--micro-batch-size", "1", "--steps", "4",
                 "--table", str(table_path), "--compare", "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert [s["with_table"] for s in doc["steps"]] == [True, False, True, False]
    assert doc["energy_saved_pct"] > 0 and doc["loss_last"] < doc["loss_first"] + 1.0
    assert "less energy per step" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["--steps", "0"], "steps must be a positive integer"),
    (["--compare"], "compare needs a table"),
    (["--backend", "tpu"], "unknown backend"),
    (["--read-only"], "read_only applies to backend nvml"),
])  # fmt: skip
def test_cli_train_bad_input(args, fragment, capsys):
    assert main(["train", "--model", "gpt3-small", "--seq-len", "16", "--micro-batch-size", "1", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def _check_whole_steps(report, steps):
    assert [r.step for r in report.steps] == list(range(steps))
    assert all(r.time_s > 0 and r.energy_j > 0 for r in report.steps)
    assert math.isfinite(report.loss_first) and math.isfinite(report.loss_last)


@pytest.mark.parametrize("micro_batch", [1, 3])
def test_train_runs_whole_steps_on_the_simulated_gpu(micro_batch):
    from freqopt.apply.train import train

    report = train(Workload("tiny", TINY, micro_batch), SimulatedGPU(H100, seed=0), table=None, steps=2)
    _check_whole_steps(report, 2)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_train_runs_whole_steps_through_nvml_on_the_cpu(fake_gpu, micro_batch):
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices
    from freqopt.apply.train import train

    gpu = fake_gpu.gpus[0]
    gpu.realtime, gpu.counter_period_s = True, 0.001  # the counter moves within a tiny model's steps
    backend = NVMLBackend(open_devices()[0], torch_device="cpu")
    report = train(Workload("tiny", TINY, micro_batch), backend, table=None, steps=3, device="cpu")
    _check_whole_steps(report, 3)
    assert (gpu.locked_sm_mhz, gpu.power_limit_mw) == (None, 650_000)


@pytest.mark.parametrize("cuda_version, fragment", [(None, "is a CPU build; install a CUDA build of torch"),
                                                    ("12.4", "sees no CUDA device")])  # fmt: skip
def test_cli_train_on_nvml_without_cuda_torch_is_one_clear_line(fake_gpu, monkeypatch, capsys, cuda_version, fragment):
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["train", "--model", "gpt3-small", "--backend", "nvml", "--seq-len", "16", "--micro-batch-size", "1"])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "device 'cpu'" in err and len(err.strip().splitlines()) == 1
    assert fake_gpu.calls == []  # refused before the GPU was opened


TRAIN_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from fake_pynvml import FakeNVML
    fake = FakeNVML.load({gpu_file!r}, persist={gpu_file!r})
    sys.modules["pynvml"] = fake.module()
    from freqopt.cli import main
    sys.exit(main(["train", "--model", "gpt3-small", "--seq-len", "16", "--micro-batch-size", "1", "--steps", "100000",
                   "--backend", "nvml", "--device", "cpu", "--table", {table!r}]))
""")


def _start_training(tmp_path) -> tuple[subprocess.Popen, Path]:
    gpu_file = tmp_path / "gpu.json"
    FakeNVML(gpus=[FakeGPU(uuid="GPU-train", power_limit_mw=600_000)], root=True).save(gpu_file)
    table = tmp_path / "table.json"
    assert main(["search", "--model", "gpt3-small", "--max-slowdown", "5%", "--granularity", "iteration",
                 "--trials", "3", "--seq-len", "16", "--micro-batch-size", "1", "--out", str(tmp_path / "s")]) == 0  # fmt: skip
    doc = json.loads(next((tmp_path / "s").glob("*-iteration.json")).read_text())
    doc["entries"][0].update(sm_clock_mhz=1005, mem_clock_mhz=2619)  # a setting sure to differ from the default
    table.write_text(json.dumps(doc))
    script = TRAIN_CHILD.format(tests=str(Path(__file__).parent), gpu_file=str(gpu_file), table=str(table))
    env = {**os.environ, "FREQOPT_STATE_DIR": str(tmp_path / "state")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:  # wait until training runs with the table's clock locked
            gpu = json.loads(gpu_file.read_text())["gpus"][0]
            if gpu["locked_sm_mhz"] == 1005:
                return child, gpu_file
            assert child.poll() is None, child.stderr.read()
            time.sleep(0.2)
        raise AssertionError("training never locked the clock")
    except BaseException:
        child.kill()  # a failed wait must not leave a training child running for its 100,000 steps
        child.wait()
        raise


@pytest.mark.slow
def test_sigterm_to_freqopt_train_restores_the_gpu(tmp_path):
    child, gpu_file = _start_training(tmp_path)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) != 0
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["locked_sm_mhz"], gpu["power_limit_mw"]) == (None, 600_000)
    assert not list((tmp_path / "state").glob("*.json"))


@pytest.mark.slow
def test_freqopt_reset_recovers_after_sigkill_of_freqopt_train(tmp_path):
    child, gpu_file = _start_training(tmp_path)
    child.kill()
    child.wait(timeout=60)
    assert json.loads(gpu_file.read_text())["gpus"][0]["locked_sm_mhz"] == 1005  # left changed
    reset = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from fake_pynvml import FakeNVML
        sys.modules["pynvml"] = FakeNVML.load({str(gpu_file)!r}, persist={str(gpu_file)!r}).module()
        from freqopt.cli import main
        sys.exit(main(["reset"]))
    """)
    env = {**os.environ, "FREQOPT_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run([sys.executable, "-c", reset], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "GPU-train: restored" in done.stdout
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["locked_sm_mhz"], gpu["power_limit_mw"]) == (None, 600_000)


@pytest.mark.slow
def test_cli_train_runs_data_parallel_under_deepspeed(tmp_path):
    """With a layout of two ranks, freqopt train starts itself under DeepSpeed's launcher (gloo on this CPU)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "dp2.json"
    cmd = [sys.executable, "-m", "freqopt.cli", "train", "--model", "gpt3-small", "--layout", "dp=2", "--seq-len", "32",
           "--micro-batch-size", "1", "--steps", "2", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert len(doc["steps"]) == 2 and doc["default"]["energy_j_per_step"] > 0
    # DeepSpeed compiled no op (its shared-memory all-reduce took minutes, silent: issue 51, item 1); rank 0 said so
    assert not (tmp_path / "torch_extensions").exists()
    assert "starting DeepSpeed's process group (gloo)" in done.stderr and "step 2/2 (default clocks)" in done.stderr
    assert "(dp=2,tp=1) training" in done.stdout
    # DeepSpeed's launcher lines and its CPU-fallback warning are not freqopt's output (issue 38, item 4).
    for line in ("[INFO]", "[WARNING]", "Setting accelerator to CPU", "Unable to find hostfile"):
        assert line not in done.stdout + done.stderr, (line, done.stderr[-2000:])


def test_train_refuses_ranks_that_cannot_fit_the_machines_memory(monkeypatch, capsys):
    """Checked before any rank starts: the ranks' estimated memory together (freqopt.workload.memory, FP32 on the CPU)
    against the machine's; here a machine of 3 GB, which one rank of this configuration fits and two do not."""
    from freqopt.apply import train as train_module
    from freqopt.errors import InvalidSettingError

    monkeypatch.setattr(train_module, "host_memory_bytes", lambda: (3_000_000_000, 2_000_000_000))
    sizes = {"seq_len": 256, "micro_batch_size": 1}
    one = train_module.plan_training("gpt3-small", **sizes)  # about 2 GB: fits
    per_rank = train_module.training_memory(one.workload)
    assert 1.5e9 < per_rank.total_bytes < 3e9 and per_rank.dtype == "float32"
    message = (r"training gpt3-small \(micro_batch_size 1, seq_len 256, dp=2,tp=1\) on the CPU needs about 2 ranks x "
               r"[\d.]+ GB \(weights .*\) of host memory, more than this machine's 3 GB; use a smaller "
               r"micro_batch_size or seq_len, or fewer data-parallel ranks")  # fmt: skip
    with pytest.raises(InvalidSettingError, match=message):
        train_module.plan_training("gpt3-small", layout="dp=2", **sizes)
    assert main(["train", "--model", "gpt3-small", "--layout", "dp=2", "--seq-len", "256", "--micro-batch-size",
                 "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "of host memory, more than this machine's 3 GB" in err


def test_rank_watcher_reports_a_rank_killed_by_a_signal(tmp_path):
    """freqopt.cli.rank, between DeepSpeed's launcher and a rank: it notes which rank a signal ended, and ends as
    the rank did, so the launcher reads the same return code."""
    from freqopt.cli.rank import STATUS_DIR_ENV, killed_ranks

    watch = textwrap.dedent("""
        import sys
        from freqopt.cli.rank import main
        sys.exit(main(command=[sys.executable, "-c", sys.argv[1]]))
    """)
    env = {**os.environ, STATUS_DIR_ENV: str(tmp_path), "RANK": "1"}
    killed = subprocess.run([sys.executable, "-c", watch, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                            env=env, timeout=120)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    assert killed_ranks(tmp_path) == {1: signal.SIGKILL}
    (tmp_path / "rank1.json").unlink()
    failed = subprocess.run([sys.executable, "-c", watch, "import sys; sys.exit(3)"], env=env, timeout=120)
    assert failed.returncode == 3 and killed_ranks(tmp_path) == {}  # an error exit is the rank's own to report
    (tmp_path / "rank0.json").write_text('{"rank": 0, "sig')  # half-written: ignored
    assert killed_ranks(tmp_path) == {}


def test_cli_train_reports_a_rank_killed_for_memory_in_one_line(monkeypatch, capsys):
    """DeepSpeed's launcher mocked: rank 1 ended by SIGKILL (what the out-of-memory killer sends) and the launcher
    exiting as DeepSpeed's does (sys.exit(-9): 247). freqopt says which rank, why, and the memory estimate against
    the machine's, in one line after its progress line, and exits 137 (128 + 9)."""
    from freqopt.apply import train as train_module
    from freqopt.cli.rank import STATUS_DIR_ENV

    def launcher(cmd, env):
        assert cmd[cmd.index("--module") + 1] == "freqopt.cli.rank" and "--num_gpus" in cmd
        Path(env[STATUS_DIR_ENV], "rank1.json").write_text(json.dumps({"rank": 1, "signal": 9}))
        return 247

    monkeypatch.setattr(subprocess, "call", launcher)
    monkeypatch.setattr(train_module, "host_memory_bytes", lambda: (23_400_000_000, 1_200_000_000))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["train", "--model", "gpt3-small", "--layout", "dp=2", "--seq-len", "64", "--micro-batch-size", "1"])
    *progress, err = capsys.readouterr().err.strip().splitlines()
    assert code == 137 and progress == ["starting 2 ranks under DeepSpeed's launcher (rank 0 reports)"]  # then this:
    assert err.startswith("freqopt: error: rank 1 of 2 was killed (SIGKILL, as the kernel's out-of-memory killer ends "
                          "a process), likely for memory: each of the 2 ranks needs about ")  # fmt: skip
    assert "GB in all, against this machine's 23.4 GB (1.2 GB available now); use a smaller --micro-batch-size" in err
    assert err.endswith("or fewer ranks (--layout)")


def test_ranks_meet_at_a_free_port_unless_master_port_is_set(monkeypatch):
    """DeepSpeed's launcher defaults to port 29500, which another job on the machine may hold: freqopt hands it a
    port free now, or the user's MASTER_PORT."""
    import socket
    import subprocess
    from types import SimpleNamespace

    from freqopt.cli import train

    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: launched.append(cmd) or 0)
    plan = SimpleNamespace(workload=SimpleNamespace(layout=SimpleNamespace(world_size=2)), device="cpu")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with socket.socket() as held:  # 29500 taken, as by another job (or already taken by one)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen()
        except OSError:
            pass
        train._relaunch_under_deepspeed(plan)
    port = int(launched[0][launched[0].index("--master_port") + 1])
    assert port != 29500
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free
    monkeypatch.setenv("MASTER_PORT", "31234")
    train._relaunch_under_deepspeed(plan)
    assert launched[1][launched[1].index("--master_port") + 1] == "31234"
