"""The NVML layer against a stand-in pynvml (tests/fake_pynvml.py): discovery, GPU type, permissions, read-only
mode, the energy counter, and restoring what was found on every exit path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from freqopt.errors import GPUPermissionError, InvalidSettingError, UnknownNameError
from freqopt.gpu.nvml import (GPUStateGuard, NVMLError, NVMLNotSupportedError, open_devices, reset_from_state_files,
                          state_dir)  # fmt: skip

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import FakeGPU, FakeNVML  # noqa: E402

H100_NAME = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    nvml = FakeNVML(gpus=[FakeGPU(uuid="GPU-aaaa"), FakeGPU(uuid="GPU-bbbb", power_limit_mw=650_000)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    monkeypatch.setenv("FREQOPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return nvml


def test_discovery_honours_cuda_visible_devices(fake, monkeypatch):
    assert [d.uuid for d in open_devices()] == ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    devices = open_devices()
    assert [(d.index, d.uuid) for d in devices] == [(0, "GPU-bbbb")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert [d.uuid for d in open_devices()] == ["GPU-aaaa"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-zzzz")
    with pytest.raises(NVMLError, match="GPU-zzzz of CUDA_VISIBLE_DEVICES"):
        open_devices()


def test_no_driver_says_to_use_the_simulator(fake):
    fake.driver = False
    with pytest.raises(NVMLError, match="no NVIDIA driver found.*backend sim"):
        open_devices()


def test_spec_matches_search_spaces_and_reads_clocks_from_the_device(fake):
    fake.gpus[0].sm_clocks_mhz = tuple(range(1980, 1000, -15))  # a GPU that reports fewer clocks
    fake.gpus[0].power_limit_constraints_mw = (250_000, 700_000)
    spec = open_devices()[0].spec()
    assert spec.name == "h100-sxm"
    assert spec.sm_clocks_mhz[0] > 1000 and spec.sm_clocks_mhz[-1] == 1980
    assert spec.power_limit_min_w == 250 and spec.power_limit_default_w == 700
    fake.gpus[0].name = "NVIDIA B300"
    with pytest.raises(UnknownNameError, match="'NVIDIA B300'.*nvml_names"):
        open_devices()[0].spec()


def test_energy_counter_is_read_in_joules_and_moves_only_at_its_period(fake):
    device = open_devices()[0]
    gpu = fake.gpus[0]
    start = device.energy_j()
    assert start == pytest.approx(1000.0)  # 1e6 mJ
    gpu.advance(0.05)  # half a period: the counter has not moved yet
    assert device.energy_j() == start
    gpu.advance(0.05)
    assert device.energy_j() == pytest.approx(start + 400 * 0.1)


def test_power_is_read_in_watts_and_a_missing_counter_or_reading_is_not_supported(fake):
    device = open_devices()[1]
    fake.gpus[1].power_w = 312.5
    assert device.power_w() == pytest.approx(312.5)  # 312,500 mW
    fake.gpus[1].energy_counter = fake.gpus[1].power_reading = False
    with pytest.raises(NVMLNotSupportedError, match="nvmlDeviceGetTotalEnergyConsumption"):
        device.energy_j()
    with pytest.raises(NVMLNotSupportedError, match="nvmlDeviceGetPowerUsage"):
        device.power_w()


def test_set_without_permission_says_how_to_proceed(fake):
    device = open_devices()[0]
    with pytest.raises(GPUPermissionError, match="CAP_SYS_ADMIN.*read-only"):
        device.lock_sm_clock(1500)
    assert fake.gpus[0].locked_sm_mhz is None


def test_read_only_never_calls_a_set_or_reset_function(fake):
    fake.root = True  # even where it would be allowed
    device = open_devices(read_only=True)[0]
    device.energy_j(), device.sm_clock_mhz(), device.power_limit_w(), device.spec()
    for change in (lambda: device.lock_sm_clock(1500), device.reset_sm_clock, lambda: device.lock_mem_clock(2619),
                   device.reset_mem_clock, lambda: device.set_power_limit_w(500)):  # fmt: skip
        with pytest.raises(GPUPermissionError, match="read-only"):
            change()
    with pytest.raises(GPUPermissionError, match="read-only"):
        with GPUStateGuard(device) as guard:
            guard.before_change()
    assert fake.set_calls() == []
    assert not state_dir().exists() or not any(state_dir().glob("*.json"))


def test_guard_restores_the_values_found_not_the_maximum(fake):
    fake.root = True
    fake.gpus[1].mem_clock_lock = "runtime"  # a GPU that locks its memory clock at run time (an H100 does not)
    device = open_devices()[1]  # found at 650 W, below the 700 W default
    with GPUStateGuard(device) as guard:
        guard.before_change()
        state_file = state_dir() / "gpu-GPU-bbbb.json"
        assert json.loads(state_file.read_text())["power_limit_w"] == 650
        device.set_power_limit_w(400)
        device.lock_sm_clock(1200)
        device.lock_mem_clock(2619)
        assert fake.gpus[1].power_limit_mw == 400_000 and fake.gpus[1].locked_sm_mhz == 1200
    gpu = fake.gpus[1]
    assert (gpu.power_limit_mw, gpu.locked_sm_mhz, gpu.locked_mem_mhz) == (650_000, None, None)
    assert not state_file.exists()


def test_guard_restores_on_exception(fake):
    fake.root = True
    device = open_devices()[0]
    with pytest.raises(RuntimeError, match="boom"):
        with GPUStateGuard(device) as guard:
            guard.before_change()
            device.set_power_limit_w(300)
            raise RuntimeError("boom")
    assert fake.gpus[0].power_limit_mw == 700_000


def test_nothing_is_touched_when_nothing_was_changed(fake):
    fake.root = True
    with GPUStateGuard(open_devices()[0]):
        pass
    assert fake.set_calls() == []


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from fake_pynvml import FakeNVML
    fake = FakeNVML.load({gpu_file!r}, persist={gpu_file!r})
    sys.modules["pynvml"] = fake.module()
    from freqopt.gpu.nvml import GPUStateGuard, open_devices
    device = open_devices()[0]
    with GPUStateGuard(device) as guard:
        guard.before_change()
        device.set_power_limit_w(300)
        device.lock_sm_clock(1005)
        print("changed", flush=True)
        time.sleep(60)
""")


def _start_child(tmp_path) -> tuple[subprocess.Popen, Path]:
    gpu_file = tmp_path / "gpu.json"
    FakeNVML(gpus=[FakeGPU(uuid="GPU-cccc", power_limit_mw=600_000)], root=True).save(gpu_file)
    script = CHILD.format(tests=str(Path(__file__).parent), gpu_file=str(gpu_file))
    env = {**os.environ, "FREQOPT_STATE_DIR": str(tmp_path / "state")}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "changed"
    changed = json.loads(gpu_file.read_text())["gpus"][0]
    assert (changed["power_limit_mw"], changed["locked_sm_mhz"]) == (300_000, 1005)
    return child, gpu_file


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_restores_before_the_process_dies(tmp_path, signum):
    child, gpu_file = _start_child(tmp_path)
    child.send_signal(signum)
    child.wait(timeout=30)
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["power_limit_mw"], gpu["locked_sm_mhz"]) == (600_000, None)
    assert not list((tmp_path / "state").glob("*.json"))


def test_reset_recovers_after_sigkill(tmp_path, monkeypatch):
    child, gpu_file = _start_child(tmp_path)
    child.kill()  # SIGKILL: no handler runs
    child.wait(timeout=30)
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["power_limit_mw"], gpu["locked_sm_mhz"]) == (300_000, 1005)  # left changed
    assert len(list((tmp_path / "state").glob("*.json"))) == 1
    fake = FakeNVML.load(gpu_file, persist=str(gpu_file))
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.setenv("FREQOPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    done = reset_from_state_files()
    assert done == [("GPU-cccc", "restored: power limit 600 W, clocks unlocked")]
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["power_limit_mw"], gpu["locked_sm_mhz"]) == (600_000, None)
    assert reset_from_state_files() == []  # nothing left to do


def test_reset_leaves_a_live_process_alone(fake):
    fake.root = True
    device = open_devices()[0]
    fake.gpus[0].power_limit_mw = 300_000  # changed by another freqopt that is still running
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state_dir().mkdir(parents=True)
        (state_dir() / "gpu-GPU-aaaa.json").write_text(json.dumps(
            {"uuid": "GPU-aaaa", "power_limit_w": 700.0, "applications_clocks_mhz": None, "pid": alive.pid}))
        done = reset_from_state_files([device])
    finally:
        alive.kill()
    assert done == [("GPU-aaaa", f"left alone: process {alive.pid} that changed it is still running")]
    assert fake.gpus[0].power_limit_mw == 300_000 and fake.set_calls() == []


def backend(fake, root: bool, read_only: bool = False):
    from freqopt.gpu.backends.base import MeasurementProtocol
    from freqopt.gpu.backends.nvml import NVMLBackend

    fake.root = root
    for g in fake.gpus:
        g.realtime, g.counter_period_s = True, 0.01
    protocol = MeasurementProtocol(warmup_s=0.05, min_window_s=0.3, min_counter_updates=5)
    return NVMLBackend(open_devices(read_only=read_only)[0], torch_device="cpu", protocol=protocol)


def tiny_kernels():
    import torch

    from freqopt.workload.models import Workload
    from freqopt.workload.models.gpt3 import GPTConfig
    from freqopt.workload.trace import trace_iteration

    config = GPTConfig(n_layers=1, d_model=64, n_heads=4, vocab_size=256, seq_len=16)
    return list(trace_iteration(Workload("tiny", config, 2), "train", dtype=torch.float32).kernels)


def test_backend_measures_time_and_energy_from_the_counter(fake):
    from freqopt.gpu.backends.base import ClockSetting

    kernels = tiny_kernels()
    with backend(fake, root=True) as b:
        m = b.measure(kernels, ClockSetting(sm_clock_mhz=1500, mem_clock_mhz=2619))
        assert fake.gpus[0].locked_sm_mhz == 1500
        assert b.counter_period_s == pytest.approx(0.01, rel=0.5)  # detected during the warm-up
        assert m.energy_j / m.time_s == pytest.approx(400.0, rel=0.15)  # the fake board draws 400 W
        assert m.cost_gpu_s >= 0.35
    assert fake.gpus[0].locked_sm_mhz is None and fake.gpus[0].power_limit_mw == 700_000


def test_backend_without_permission_says_so_and_leaves_no_state_file(fake):
    """The permission probe (the power limit set to the value it has) is refused: nothing changed, so no state file
    is left behind for freqopt reset, which would need the same permission."""
    with pytest.raises(GPUPermissionError, match="no permission"):
        backend(fake, root=False)
    assert not list(state_dir().glob("*.json"))
    assert [c[0] for c in fake.set_calls()] == ["nvmlDeviceSetPowerManagementLimit"]


def test_backend_read_only_measures_current_settings_and_sets_nothing(fake):
    from freqopt.gpu.backends.base import DEFAULT_SETTING, ClockSetting

    kernels = tiny_kernels()
    with backend(fake, root=True, read_only=True) as b:
        m = b.measure(kernels, DEFAULT_SETTING)
        assert m.time_s > 0 and m.energy_j > 0
        with pytest.raises(GPUPermissionError, match="read-only: cannot measure at SM 1500 MHz"):
            b.measure(kernels, ClockSetting(sm_clock_mhz=1500))
    assert fake.set_calls() == []


def test_backend_schedule_switches_per_phase_and_restores(fake):
    from freqopt.gpu.backends.base import ClockSetting

    kernels = tiny_kernels()
    with backend(fake, root=True) as b:
        settings = [ClockSetting(1200, 2619) if k.pass_name == "backward" else ClockSetting(1800, 2619) for k in kernels]
        b.measure_schedule(kernels, settings)
        locks = [c[2] for c in fake.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
        assert {1200, 1800} <= set(locks)
    assert fake.gpus[0].locked_sm_mhz is None


def test_backend_kernel_times_time_each_distinct_kernel_once_per_setting(fake, monkeypatch):
    """kernel_times_s applies the setting, replays each kernel signature once per setting (equal kernels share its
    time) and keeps the times for later calls."""
    from freqopt.gpu.backends.base import ClockSetting

    kernels = tiny_kernels()
    distinct = {k.signature for k in kernels}
    assert len(distinct) < len(kernels)  # the trace repeats kernel classes
    with backend(fake, root=True) as b:
        replayed = []
        replay = b._replay
        def counting_replay(ks, cache=None):
            replayed.append(ks[0].signature)
            return replay(ks, cache)

        monkeypatch.setattr(b, "_replay", counting_replay)
        setting = ClockSetting(sm_clock_mhz=1500, mem_clock_mhz=2619)
        times = b.kernel_times_s(kernels, setting)
        assert fake.gpus[0].locked_sm_mhz == 1500
        assert times.shape == (len(kernels),) and (times > 0).all()
        assert sorted(replayed) == sorted(distinct)
        by_signature: dict = {}
        assert all(by_signature.setdefault(k.signature, t) == t for k, t in zip(kernels, times))
        assert (b.kernel_times_s(kernels, setting) == times).all() and len(replayed) == len(distinct)  # kept
        b.kernel_times_s(kernels[:3], ClockSetting(sm_clock_mhz=1200, mem_clock_mhz=2619))
        assert fake.gpus[0].locked_sm_mhz == 1200
        assert len(replayed) == len(distinct) + len({k.signature for k in kernels[:3]})  # timed again at 1200 MHz
    assert fake.gpus[0].locked_sm_mhz is None


def test_backend_interface_applies_keeps_and_reads_the_counter(fake):
    """Backend.apply sets one setting and keeps it; energy_j is NVML's mJ counter / 1000; the context manager
    restores the GPU."""
    from freqopt.gpu.backends.base import ClockSetting

    with backend(fake, root=True) as b:
        assert b.name == "nvml" and not b.simulated
        b.apply(ClockSetting(sm_clock_mhz=1200, power_limit_w=500.0))
        assert fake.gpus[0].locked_sm_mhz == 1200 and fake.gpus[0].power_limit_mw == 500_000
        n_calls = len(fake.set_calls())
        b.apply(ClockSetting(sm_clock_mhz=1200, power_limit_w=500.0))  # already there: nothing is called
        assert len(fake.set_calls()) == n_calls
        fake.gpus[0].realtime = False  # the counter moves only when the test says
        assert b.energy_j() == int(fake.gpus[0].energy_mj) / 1000.0
        start = b.energy_j()
        fake.gpus[0].advance(1.0)
        assert b.energy_j() - start == pytest.approx(400.0, rel=0.05)  # the fake board draws 400 W
    assert fake.gpus[0].locked_sm_mhz is None and fake.gpus[0].power_limit_mw == 700_000


def test_cli_reset_reports_nothing_to_do(fake, capsys):
    from freqopt.cli import main

    assert main(["reset"]) == 0
    assert "nothing to restore" in capsys.readouterr().out


@pytest.fixture
def tiny_model(monkeypatch):
    """A two-layer GPT registered as a model name: the nvml backend now replays every kernel as itself, and
    gpt3-small's fused AdamW over 125 M parameters takes seconds a replay on a CPU."""
    from freqopt.workload.models import MODELS, GPTConfig

    monkeypatch.setitem(MODELS, "tiny-gpt", GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16))
    return "tiny-gpt"


def _search_as_root(fake, tmp_path, model: str, granularity: str) -> dict:
    """`freqopt search` on the stand-in NVML as root (counters updating every 20 ms in real time), a small budget
    and two trials; the --json document."""
    from freqopt.cli import main

    fake.root = True
    for g in fake.gpus:
        g.realtime, g.counter_period_s = True, 0.02
    out = tmp_path / "r.json"
    assert main(["search", "--backend", "nvml", "--model", model, "--max-slowdown", "5%", "--granularity",
                 granularity, "--trials", "2", "--seq-len", "16", "--micro-batch-size", "1", "--out",
                 str(tmp_path / "o"), "--json", str(out)]) == 0  # fmt: skip
    return json.loads(out.read_text())


@pytest.mark.slow
def test_cli_search_runs_end_to_end_on_the_nvml_backend_and_restores(fake, tmp_path, tiny_model, short_measurements):
    result = _search_as_root(fake, tmp_path, tiny_model, "iteration")["results"]["iteration"]
    assert result["n_measurements"] > 0 and result["search_cost_gpu_s"] > 1.0
    locks = [c for c in fake.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
    assert locks  # the search changed clocks ...
    gpu = fake.gpus[0]
    assert (gpu.locked_sm_mhz, gpu.power_limit_mw) == (None, 700_000)  # ... and put them back
    assert not any(state_dir().glob("*.json"))


def test_cli_search_without_permission_is_one_clear_line(fake, tmp_path, capsys):
    from freqopt.cli import main

    code = main(["search", "--backend", "nvml", "--model", "gpt3-small", "--max-slowdown", "5%", "--granularity",
                 "iteration", "--trials", "2", "--seq-len", "16", "--micro-batch-size", "1", "--out",
                 str(tmp_path / "o")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "CAP_SYS_ADMIN" in err and len(err.strip().splitlines()) == 1
    assert fake.gpus[0].locked_sm_mhz is None
    assert not (tmp_path / "o").exists()  # refused before anything was written


@pytest.mark.slow
def test_cli_powercap_on_the_nvml_backend_puts_the_limit_back(fake, tmp_path, tiny_model):
    from freqopt.cli import main

    fake.root = True
    fake.gpus[0].power_limit_mw = 680_000  # found below the default
    for g in fake.gpus:
        g.realtime, g.counter_period_s = True, 0.02
    assert main(["powercap", "--backend", "nvml", "--model", tiny_model, "--caps", "400", "--seq-len", "16",
                 "--micro-batch-size", "1", "--json", str(tmp_path / "p.json")]) == 0  # fmt: skip
    assert ("nvmlDeviceSetPowerManagementLimit", 0, 400_000) in fake.set_calls()
    assert fake.gpus[0].power_limit_mw == 680_000  # the value found, not the default
    assert not any(state_dir().glob("*.json"))


# -- what the GPU refuses: the memory-clock lock at run time (issue 22) -----------------------------------------
RTX3080TI = dict(name="NVIDIA GeForce RTX 3080 Ti", mem_clocks_mhz=(5001, 9251, 9501),
                 sm_clocks_mhz=tuple(range(2100, 209, -15)), power_limit_constraints_mw=(100_000, 400_000),
                 power_limit_default_mw=350_000, power_limit_mw=350_000, applications_clocks_mhz=(2100, 9501))


def test_stand_in_refuses_a_run_time_memory_lock_where_the_gpu_file_says_it_cannot(fake):
    """As the real library: NVMLError_NotSupported on Hopper (per job: deferred locks only) and on Volta (no memory
    lock before Ampere); the GPU is left as it was. An Ampere GeForce locks at run time."""
    import pynvml

    fake.root = True
    fake.gpus[0].mem_clocks_mhz = (1593, 2619)  # what a real H100 lists (experiments/data/h100/supported_clocks.json)
    fake.gpus[1].name = "Tesla V100-SXM2-16GB"
    fake.gpus.append(FakeGPU(uuid="GPU-cccc", **RTX3080TI))
    h100, v100, rtx = open_devices()
    for device in (h100, v100):
        with pytest.raises(NVMLNotSupportedError, match="nvmlDeviceSetMemoryLockedClocks: this GPU or driver does not"):
            device.lock_mem_clock(1593)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # the stand-in raises real pynvml's class
        sys.modules["pynvml"].nvmlDeviceSetMemoryLockedClocks(0, 1593, 1593)
    assert fake.gpus[0].locked_mem_mhz is None and fake.gpus[1].locked_mem_mhz is None
    rtx.lock_mem_clock(5001)
    assert fake.gpus[2].locked_mem_mhz == 5001


def test_backend_turns_a_refused_memory_lock_into_one_memory_clock_per_job_with_one_warning(fake, caplog):
    from freqopt.gpu.backends.base import ClockSetting

    fake.gpus[0].mem_clocks_mhz = (1593, 2619)
    with caplog.at_level("INFO", logger="freqopt.gpu.backends.nvml"):
        b = backend(fake, root=True)
    with b:
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and len(warnings[0].getMessage().splitlines()) == 1
        assert "refused a run-time memory-clock lock" in warnings[0].getMessage()
        assert "2619 MHz only" in warnings[0].getMessage() and "--lock-memory-clocks-deferred" in warnings[0].getMessage()
        assert b.spec.mem_clocks_mhz == (2619,) and not b.spec.mem_clock_runtime and b.spec.mem_clock_lock == "per-job"
        assert "not support" in b.mem_clock_refusal
        b.apply(ClockSetting(sm_clock_mhz=1500, mem_clock_mhz=2619))  # the memory clock it runs at: fine
        assert fake.gpus[0].locked_sm_mhz == 1500
        with pytest.raises(InvalidSettingError, match=r"memory clocks \[2619\]"):
            b.apply(ClockSetting(sm_clock_mhz=1500, mem_clock_mhz=1593))  # per job: not this one
        assert sum(1 for c in fake.calls if c[0] == "nvmlDeviceSetMemoryLockedClocks") == 1  # asked once, at opening
    gpu = fake.gpus[0]
    assert (gpu.locked_sm_mhz, gpu.locked_mem_mhz, gpu.power_limit_mw) == (None, None, 700_000)  # as found
    assert not any(state_dir().glob("*.json"))


def test_backend_searches_the_memory_clock_per_phase_where_the_gpu_locks_it(fake, caplog):
    from freqopt.gpu.backends.base import ClockSetting

    fake.gpus = [FakeGPU(uuid="GPU-rtx", **RTX3080TI)]
    with caplog.at_level("INFO", logger="freqopt.gpu.backends.nvml"):
        with backend(fake, root=True) as b:
            assert b.spec.name == "rtx3080ti" and b.spec.mem_clock_runtime and b.mem_clock_refusal is None
            assert b.spec.mem_clocks_mhz == (5001, 9251, 9501)
            assert fake.gpus[0].locked_mem_mhz is None  # the probe let go of its lock
            b.apply(ClockSetting(sm_clock_mhz=1500, mem_clock_mhz=5001))
            assert fake.gpus[0].locked_mem_mhz == 5001
    assert not caplog.records  # nothing to say
    assert (fake.gpus[0].locked_mem_mhz, fake.gpus[0].locked_sm_mhz) == (None, None)


def test_backend_trusts_a_gpu_that_accepts_a_memory_lock_its_file_reads_per_job(fake, caplog):
    fake.gpus[0].mem_clocks_mhz = (1593, 2619)
    fake.gpus[0].mem_clock_lock = "runtime"  # a driver that locks an H100's memory clock at run time
    with caplog.at_level("INFO", logger="freqopt.gpu.backends.nvml"):
        with backend(fake, root=True) as b:
            assert b.spec.mem_clock_runtime and b.spec.mem_clocks_mhz == (1593, 2619)
    assert [r.levelname for r in caplog.records] == ["INFO"] and "reads per-job" in caplog.records[0].getMessage()


@pytest.mark.slow
def test_cli_search_on_a_gpu_with_a_per_job_memory_clock_completes_and_restores(fake, tmp_path, tiny_model, caplog,
                                                                              short_measurements):  # fmt: skip
    """The pass level's search on a GPU that refuses a run-time memory-clock lock runs to its end at the one memory
    clock and leaves the GPU as found. What is checked is the search's path, not its figures: each measurement's
    warm-up and window are shortened from 0.5 s to 0.1 s (five of the stand-in's 20 ms counter updates), which
    takes the test from about 100 s to a fraction of it."""
    fake.gpus[0].mem_clocks_mhz = (1593, 2619)
    doc = _search_as_root(fake, tmp_path, tiny_model, "pass")
    assert sum("refused a run-time memory-clock lock" in r.getMessage() for r in caplog.records) == 1
    assert doc["results"]["pass"]["n_measurements"] > 0
    gpu = fake.gpus[0]
    assert (gpu.locked_sm_mhz, gpu.locked_mem_mhz, gpu.power_limit_mw) == (None, None, 700_000)
