"""AMD GPUs through AMD SMI against a stand-in amdsmi (tests/fake_amdsmi.py): the NVML layer's and the real-GPU
backend's tests (tests/test_nvml.py) on an AMD GPU: discovery, GPU type, permissions, read-only mode, the energy
counter, restoring what was found on every exit path, measurements, and a search end to end.

No GPU file in search_spaces/ names an AMD GPU yet, so each test writes one: h100-sxm's file under an AMD name
(its clocks, power range and physics kept: only the device layer is tested here, not the simulated GPU)."""

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
from freqopt.gpu.amdsmi import AMDSMIError, AMDSMINotSupportedError, open_amd_devices
from freqopt.gpu.nvml import GPUStateGuard, NVMLError, reset_from_state_files, state_dir
from freqopt.gpu.specs import search_spaces_dir

sys.path.insert(0, str(Path(__file__).parent))
from fake_amdsmi import FakeAMDGPU, FakeAMDSMI  # noqa: E402

NAME = "AMD Instinct MI300X"
# H100's clocks, so that the file's clock grid and power-model bounds hold; AMD SMI's units.
H100_LIKE = dict(gfx_levels_mhz=(345, 1200, 1980), mem_levels_mhz=(2619,), power_cap_range_uw=(200_000_000, 700_000_000),
                 power_cap_default_uw=700_000_000, power_cap_uw=700_000_000, power_w=400.0)  # fmt: skip


def write_amd_gpu_file(folder: Path) -> Path:
    """search_spaces/ with one GPU file, ``mi300x-test``: h100-sxm's under the AMD name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").mkdir(exist_ok=True)
    for host in (search_spaces_dir() / "hosts").glob("*.toml"):
        (folder / "hosts" / host.name).write_text(host.read_text())
    text = (search_spaces_dir() / "h100-sxm.toml").read_text()
    text = text.replace('nvml_names = ["NVIDIA H100 80GB HBM3"]', f'nvml_names = []\namdsmi_names = ["{NAME}"]')
    assert f'amdsmi_names = ["{NAME}"]' in text
    (folder / "mi300x-test.toml").write_text(text)
    return folder


@pytest.fixture
def fake(monkeypatch, tmp_path):
    smi = FakeAMDSMI(gpus=[FakeAMDGPU(uuid="amd-aaaa", **H100_LIKE),
                           FakeAMDGPU(uuid="amd-bbbb", **{**H100_LIKE, "power_cap_uw": 650_000_000})])  # fmt: skip
    monkeypatch.setitem(sys.modules, "amdsmi", smi.module())
    monkeypatch.setenv("FREQOPT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FREQOPT_SEARCH_SPACES", str(write_amd_gpu_file(tmp_path / "search_spaces")))
    for key in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    from freqopt.gpu.specs import get_gpu

    get_gpu.cache_clear()  # other tests read the real folder
    yield smi
    get_gpu.cache_clear()  # other tests read the real folder


def test_discovery_honours_hip_visible_devices(fake, monkeypatch):
    assert [d.uuid for d in open_amd_devices()] == ["amd-aaaa", "amd-bbbb"]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert [(d.index, d.uuid) for d in open_amd_devices()] == [(0, "amd-bbbb")]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "amd-aaaa")
    assert [d.uuid for d in open_amd_devices()] == ["amd-aaaa"]
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "amd-zzzz")
    with pytest.raises(AMDSMIError, match="amd-zzzz .*names no GPU"):
        open_amd_devices()


def test_no_driver_says_to_use_the_simulator(fake):
    fake.driver = False
    with pytest.raises(AMDSMIError, match="no AMD GPU driver found.*backend sim"):
        open_amd_devices()
    assert issubclass(AMDSMIError, NVMLError)  # handled wherever a GPU library's failure is


def test_missing_bindings_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi raises ImportError
    with pytest.raises(AMDSMIError, match="install ROCm's amdsmi.*backend sim"):
        open_amd_devices()


def test_spec_matches_search_spaces_and_reads_clocks_and_caps_from_the_device(fake):
    fake.gpus[0].gfx_levels_mhz = (600, 1500)  # a GPU whose range is narrower than its file's grid
    fake.gpus[0].power_cap_range_uw = (250_000_000, 700_000_000)
    spec = open_amd_devices()[0].spec()
    assert spec.name == "mi300x-test" and spec.amdsmi_names == (NAME,)
    assert spec.sm_clocks_mhz[0] == 600 and spec.sm_clocks_mhz[-1] == 1500  # the range's ends ...
    assert 1200 in spec.sm_clocks_mhz and all(600 <= f <= 1500 for f in spec.sm_clocks_mhz)  # ... the file's grid
    assert spec.mem_clocks_mhz == (2619,)
    assert (spec.power_limit_min_w, spec.power_limit_max_w, spec.power_limit_default_w) == (250, 700, 700)
    fake.gpus[0].name = "AMD Instinct MI325X"
    with pytest.raises(UnknownNameError, match="'AMD Instinct MI325X'.*amdsmi_names"):
        open_amd_devices()[0].spec()


@pytest.mark.parametrize("market_name, file, cus, gfx_mhz, mem_mhz", [
    ("AMD Instinct MI300X", "mi300x", 304, (500, 1300, 2100), (900, 1300)),
    ("AMD Instinct MI250X/MI250", "mi250x", 110, (500, 1700), (400, 1600)),
])
def test_the_shipped_amd_files_are_found_by_their_market_names(fake, monkeypatch, market_name, file, cus, gfx_mhz,
                                                               mem_mhz):
    """With the shipped search_spaces/, an MI300X or an MI250X die as AMD SMI names it opens with its own file, the
    device's clock range and memory levels replacing the file's."""
    from freqopt.gpu.specs import get_gpu

    monkeypatch.delenv("FREQOPT_SEARCH_SPACES")
    get_gpu.cache_clear()
    g = fake.gpus[0]
    g.name, g.gfx_levels_mhz, g.mem_levels_mhz = market_name, gfx_mhz, mem_mhz
    g.power_cap_range_uw, g.power_cap_default_uw = (100_000_000, 750_000_000), 750_000_000
    spec = open_amd_devices()[0].spec()
    assert spec.name == file and spec.n_sms == cus and not spec.nvml_names
    assert (spec.sm_clocks_mhz[0], spec.sm_clocks_mhz[-1]) == (gfx_mhz[0], gfx_mhz[-1])
    assert spec.mem_clocks_mhz == mem_mhz and spec.power_limit_max_w == 750
    assert get_gpu(file).provenance["power"].startswith("carried from ")


def test_energy_counter_is_read_in_joules_and_moves_only_at_its_period(fake):
    device = open_amd_devices()[0]
    g = fake.gpus[0]
    start = device.energy_j()
    assert start == pytest.approx(g.accumulator * g.resolution_uj / 1e6)
    g.advance(g.counter_period_s * 0.5)
    assert device.energy_j() == start  # no update yet
    g.advance(1.0)
    assert device.energy_j() - start == pytest.approx(400.0, rel=0.01)  # 400 W for 1 s
    assert device.power_w() == 400.0


def test_a_die_without_an_energy_counter_is_not_supported(fake):
    fake.gpus[1].energy_counter = False  # the odd die of an MI250X: its package's power is on the even one
    device = open_amd_devices()[1]
    with pytest.raises(AMDSMINotSupportedError):
        device.energy_j()
    with pytest.raises(AMDSMINotSupportedError, match="no power reading"):
        device.power_w()


def test_set_without_permission_says_how_to_proceed(fake):
    device = open_amd_devices()[0]
    with pytest.raises(GPUPermissionError, match="no permission.*CAP_SYS_ADMIN"):
        device.set_power_limit_w(300)


def test_a_value_outside_the_range_is_an_invalid_setting(fake):
    fake.root = True
    device = open_amd_devices()[0]
    with pytest.raises(InvalidSettingError, match="refused the value"):
        device.set_power_limit_w(150)  # below the 200 W minimum
    with pytest.raises(InvalidSettingError):
        device.lock_sm_clock(2500)
    assert fake.gpus[0].power_cap_uw == 700_000_000 and fake.gpus[0].gfx_range_mhz is None


def test_read_only_never_calls_a_set_function(fake):
    fake.root = True
    device = open_amd_devices(read_only=True)[0]
    for change in (lambda: device.set_power_limit_w(300), lambda: device.lock_sm_clock(1200),
                   device.reset_sm_clock, lambda: device.lock_mem_clock(2619)):  # fmt: skip
        with pytest.raises(GPUPermissionError, match="read-only"):
            change()
    with pytest.raises(GPUPermissionError, match="read-only"):
        with GPUStateGuard(device) as guard:
            guard.before_change()
    assert fake.set_calls() == []


def test_guard_restores_the_values_found_not_the_maximum(fake):
    fake.root = True
    device = open_amd_devices()[1]  # found at 650 W, below the 700 W default
    with GPUStateGuard(device) as guard:
        guard.before_change()
        state_file = state_dir() / "gpu-amd-bbbb.json"
        assert json.loads(state_file.read_text())["power_limit_w"] == 650
        device.set_power_limit_w(400)
        device.lock_sm_clock(1200)
        g = fake.gpus[1]
        assert (g.power_cap_uw, g.locked_sm_mhz, g.perf_level) == (400_000_000, 1200, 3)
    g = fake.gpus[1]
    assert (g.power_cap_uw, g.gfx_range_mhz, g.perf_level) == (650_000_000, None, 0)  # the range and auto again
    assert not state_file.exists()


def test_guard_restores_on_exception(fake):
    fake.root = True
    device = open_amd_devices()[0]
    with pytest.raises(RuntimeError, match="boom"):
        with GPUStateGuard(device) as guard:
            guard.before_change()
            device.set_power_limit_w(300)
            device.lock_sm_clock(1000)
            raise RuntimeError("boom")
    assert (fake.gpus[0].power_cap_uw, fake.gpus[0].gfx_range_mhz) == (700_000_000, None)


def test_one_memory_clock_cannot_be_locked(fake):
    fake.root = True
    with pytest.raises(AMDSMINotSupportedError, match="one memory clock"):
        open_amd_devices()[0].lock_mem_clock(2619)
    assert fake.set_calls() == []


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from fake_amdsmi import FakeAMDSMI
    fake = FakeAMDSMI.load({gpu_file!r}, persist={gpu_file!r})
    sys.modules["amdsmi"] = fake.module()
    from freqopt.gpu.amdsmi import open_amd_devices
    from freqopt.gpu.nvml import GPUStateGuard
    device = open_amd_devices()[0]
    with GPUStateGuard(device) as guard:
        guard.before_change()
        device.set_power_limit_w(300)
        device.lock_sm_clock(1005)
        print("changed", flush=True)
        time.sleep(60)
""")


def _start_child(tmp_path) -> tuple[subprocess.Popen, Path]:
    gpu_file = tmp_path / "gpu.json"
    FakeAMDSMI(gpus=[FakeAMDGPU(uuid="amd-cccc", **{**H100_LIKE, "power_cap_uw": 600_000_000})], root=True).save(gpu_file)
    script = CHILD.format(tests=str(Path(__file__).parent), gpu_file=str(gpu_file))
    env = {**os.environ, "FREQOPT_STATE_DIR": str(tmp_path / "state"),
           "FREQOPT_SEARCH_SPACES": str(write_amd_gpu_file(tmp_path / "search_spaces"))}  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "changed"
    changed = json.loads(gpu_file.read_text())["gpus"][0]
    assert (changed["power_cap_uw"], changed["gfx_range_mhz"]) == (300_000_000, [1005, 1005])
    return child, gpu_file


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_restores_before_the_process_dies(tmp_path, signum):
    child, gpu_file = _start_child(tmp_path)
    child.send_signal(signum)
    child.wait(timeout=30)
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["power_cap_uw"], gpu["gfx_range_mhz"], gpu["perf_level"]) == (600_000_000, None, 0)
    assert not list((tmp_path / "state").glob("*.json"))


def test_reset_recovers_after_sigkill(tmp_path, monkeypatch):
    child, gpu_file = _start_child(tmp_path)
    child.kill()  # SIGKILL: no handler runs
    child.wait(timeout=30)
    assert json.loads(gpu_file.read_text())["gpus"][0]["power_cap_uw"] == 300_000_000  # left changed
    fake = FakeAMDSMI.load(gpu_file, persist=str(gpu_file))
    monkeypatch.setitem(sys.modules, "amdsmi", fake.module())
    monkeypatch.setenv("FREQOPT_SEARCH_SPACES", str(tmp_path / "search_spaces"))
    done = reset_from_state_files(open_amd_devices(), folder=tmp_path / "state")
    assert done == [("amd-cccc", "restored: power limit 600 W, clocks unlocked")]
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["power_cap_uw"], gpu["gfx_range_mhz"]) == (600_000_000, None)


# -- the backend ------------------------------------------------------------------------------------------------
def backend(fake, root: bool, read_only: bool = False):
    from freqopt.gpu.backends.amdsmi import AMDSMIBackend
    from freqopt.gpu.backends.base import MeasurementProtocol

    fake.root = root
    for g in fake.gpus:
        g.realtime, g.counter_period_s = True, 0.01
    protocol = MeasurementProtocol(warmup_s=0.05, min_window_s=0.3, min_counter_updates=5)
    return AMDSMIBackend(open_amd_devices(read_only=read_only)[0], torch_device="cpu", protocol=protocol)


def tiny_kernels():
    import torch

    from freqopt.workload.models import Workload
    from freqopt.workload.models.gpt3 import GPTConfig
    from freqopt.workload.trace import trace_iteration

    config = GPTConfig(n_layers=1, d_model=64, n_heads=4, vocab_size=256, seq_len=16)
    return list(trace_iteration(Workload("tiny", config, 2), "train", dtype=torch.float32).kernels)


@pytest.mark.slow
def test_backend_measures_time_and_energy_from_the_counter(fake):
    from freqopt.gpu.backends.base import ClockSetting

    with backend(fake, root=True) as b:
        assert b.name == "amdsmi" and not b.simulated and b.spec.name == "mi300x-test"
        m = b.measure(tiny_kernels(), ClockSetting(sm_clock_mhz=1500))
        assert fake.gpus[0].locked_sm_mhz == 1500
        assert b.counter_period_s == pytest.approx(0.01, rel=0.5)  # detected during the warm-up
        assert m.energy_j / m.time_s == pytest.approx(400.0, rel=0.15)  # the fake package draws 400 W
    assert fake.gpus[0].gfx_range_mhz is None and fake.gpus[0].power_cap_uw == 700_000_000


def test_backend_without_permission_says_so_and_leaves_no_state_file(fake):
    with pytest.raises(GPUPermissionError, match="no permission"):
        backend(fake, root=False)
    assert not list(state_dir().glob("*.json"))
    assert [c[0] for c in fake.set_calls()] == ["amdsmi_set_power_cap"]


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
        settings = [ClockSetting(1200) if k.pass_name == "backward" else ClockSetting(1800) for k in kernels]
        b.measure_schedule(kernels, settings)
        locks = {c[2] for c in fake.set_calls() if c[0] == "amdsmi_set_gpu_clk_range" and c[2] == c[3]}
        assert {1200, 1800} <= locks
    assert fake.gpus[0].gfx_range_mhz is None


def test_backend_interface_applies_keeps_and_reads_the_counter(fake):
    from freqopt.gpu.backends.base import ClockSetting

    with backend(fake, root=True) as b:
        b.apply(ClockSetting(sm_clock_mhz=1200, power_limit_w=500.0))
        assert fake.gpus[0].locked_sm_mhz == 1200 and fake.gpus[0].power_cap_uw == 500_000_000
        n_calls = len(fake.set_calls())
        b.apply(ClockSetting(sm_clock_mhz=1200, power_limit_w=500.0))  # already there: nothing is called
        assert len(fake.set_calls()) == n_calls
        with pytest.raises(InvalidSettingError):
            b.apply(ClockSetting(sm_clock_mhz=2100))  # above the GPU's range: refused before AMD SMI
        assert len(fake.set_calls()) == n_calls
        fake.gpus[0].realtime = False
        start = b.energy_j()
        fake.gpus[0].advance(1.0)
        assert b.energy_j() - start == pytest.approx(400.0, rel=0.05)
    assert fake.gpus[0].gfx_range_mhz is None and fake.gpus[0].power_cap_uw == 700_000_000


def test_get_backend_opens_the_amd_gpu_by_name(fake):
    from freqopt.gpu.backends import BACKENDS, get_backend

    assert "amdsmi" in BACKENDS
    fake.root = True
    with get_backend("amdsmi", None) as b:
        assert b.name == "amdsmi" and b.spec.name == "mi300x-test"
    fake.driver = False
    with pytest.raises(AMDSMIError, match="no AMD GPU driver"):
        get_backend("amdsmi", None)


@pytest.mark.slow
def test_cli_search_runs_end_to_end_on_the_amd_backend_and_restores(fake, tmp_path, monkeypatch, short_measurements):
    """The iteration level's search through AMD SMI runs to its end and leaves the GPU as found. What is checked is
    the search's path, not its figures: each measurement's warm-up and window are shortened from 0.5 s to 0.1 s."""
    from freqopt.cli import main
    from freqopt.workload.models import MODELS, GPTConfig

    monkeypatch.setitem(MODELS, "tiny-gpt", GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16))
    fake.root = True
    for g in fake.gpus:
        g.realtime, g.counter_period_s = True, 0.02
    out = tmp_path / "r.json"
    assert main(["search", "--backend", "amdsmi", "--model", "tiny-gpt", "--max-slowdown", "5%", "--granularity",
                 "iteration", "--trials", "2", "--seq-len", "16", "--micro-batch-size", "1", "--out",
                 str(tmp_path / "o"), "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())["results"]["iteration"]
    assert result["n_measurements"] > 0
    assert any(c[0] == "amdsmi_set_gpu_clk_range" for c in fake.set_calls())  # the search changed clocks ...
    g = fake.gpus[0]
    assert (g.gfx_range_mhz, g.power_cap_uw, g.perf_level) == (None, 700_000_000, 0)  # ... and put them back
    assert not any(state_dir().glob("*.json"))


def test_energy_monitor_reads_amd_gpus_through_amd_smi_read_only(fake):
    """EnergyMonitor(backend="amdsmi"): a window's energy is the AMD SMI accumulator's difference; a die that reports
    neither energy nor power (an MI250X's second: the first reports the package's) is refused in one line that says
    to leave it out; nothing is ever set."""
    from freqopt.measure.monitor import COUNTER, EnergyMonitor

    monitor = EnergyMonitor(backend="amdsmi", cpu=False, sync=False, energy_counter_period_s=1e-6)
    assert monitor.gpu_indices == (0, 1) and monitor.gpu_names[0] == NAME
    assert monitor.gpu_energy_sources == {0: COUNTER, 1: COUNTER}
    monitor.begin_window("step")
    fake.gpus[0].advance(1.0)  # 400 W for 1 s of the stand-in's time
    fake.gpus[1].advance(0.5)
    m = monitor.end_window("step")
    assert m.gpu_energy_j[0] == pytest.approx(400.0, rel=0.01)
    assert m.gpu_energy_j[1] == pytest.approx(200.0, rel=0.01)
    fake.gpus[1].energy_counter = False
    with pytest.raises(NVMLError, match=r"GPU 1 .* neither an energy counter \(amdsmi_get_energy_count\) nor a power "
                                        r"reading \(amdsmi_get_power_info\); leave it out"):  # fmt: skip
        EnergyMonitor(backend="amdsmi", cpu=False)
    assert EnergyMonitor([0], backend="amdsmi", cpu=False).gpu_indices == (0,)
    assert fake.set_calls() == []
    with pytest.raises(InvalidSettingError, match="backend must be one of 'nvml', 'amdsmi'"):
        EnergyMonitor(backend="rocm", cpu=False)


def test_freqopt_measure_with_the_amd_backend(fake, capsys):
    from freqopt.cli import main

    code = main(["measure", "--backend", "amdsmi", "--gpus", "0", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 0 and f"GPU 0 ({NAME})" in err and ("AMD SMI energy counter" in err or "power x time" in err)
