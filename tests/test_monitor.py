"""Measurement windows (freqopt.measure.monitor) on the stand-in NVML (tests/fake_pynvml.py) and a fake powercap tree:
exact window energies, nested and overlapping windows, windows shorter than the energy counter's period (power x
time), GPUs without an energy counter (power samples), synchronization of PyTorch's CUDA work, refusals, RAPL's
wrap-around and unreadable counters, that nothing is ever set on a GPU, and ``freqopt measure -- CMD`` (exit status,
JSON, Ctrl-C, a table that reads the same at any terminal width)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

from freqopt.cli import main
from freqopt.errors import InvalidSettingError
from freqopt.gpu.nvml import NVMLError
from freqopt.measure import monitor as monitor_module
from freqopt.measure.monitor import (COUNTER, COVERS, POWER_SAMPLES, POWER_X_TIME, EnergyMonitor, RAPLWarning,
                                     ShortWindowWarning, WindowMeasurement, measure_command)  # fmt: skip

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import SETTERS, FakeGPU, FakeNVML  # noqa: E402

TESTS = Path(__file__).parent
ROOT = TESTS.parent
# The NVML calls a read-only monitor may make: discovery, names, the energy counter.
READS = {"nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID",
         "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetTotalEnergyConsumption",
         "nvmlDeviceGetPowerUsage"}  # fmt: skip


class FakePowercap:
    """A /sys/class/powercap tree as Linux lays it out: a control-type folder, package zones ``intel-rapl:N`` with
    ``core`` and ``dram`` subzones (also linked at the top level, as the class folder lists them), a ``psys`` zone
    and an MMIO duplicate of package 0 (neither may be counted)."""

    MAX_UJ = 262_143_328_850  # max_energy_range_uj of a real Intel package zone

    def __init__(self, root: Path, *, packages=(0,), dram=True, dies: int = 1):
        self.root = root
        (root / "intel-rapl").mkdir(parents=True)
        self.zones: dict[str, Path] = {}
        n = 0
        for package in packages:
            for die in range(dies):
                name = f"package-{package}" + (f"-die-{die}" if dies > 1 else "")
                zone = self._zone(root / f"intel-rapl:{n}", name)
                self.zones[name] = zone
                self.zones[f"core-{name}"] = self._zone(zone / f"intel-rapl:{n}:0", "core")
                if dram:
                    self.zones[f"dram-{name}"] = self._zone(zone / f"intel-rapl:{n}:1", "dram")
                    (root / f"intel-rapl:{n}:1").symlink_to(zone / f"intel-rapl:{n}:1")
                (root / f"intel-rapl:{n}:0").symlink_to(zone / f"intel-rapl:{n}:0")
                n += 1
        self.zones["psys"] = self._zone(root / f"intel-rapl:{n}", "psys")
        self.zones["mmio"] = self._zone(root / "intel-rapl-mmio:0", "package-0")

    def _zone(self, path: Path, name: str, energy_uj: int = 1_000_000) -> Path:
        path.mkdir()
        (path / "name").write_text(name + "\n")
        (path / "max_energy_range_uj").write_text(f"{self.MAX_UJ}\n")
        (path / "energy_uj").write_text(f"{energy_uj}\n")
        return path

    def get(self, zone: str) -> int:
        return int((self.zones[zone] / "energy_uj").read_text())

    def set(self, zone: str, energy_uj: int) -> None:
        (self.zones[zone] / "energy_uj").write_text(f"{energy_uj}\n")

    def add(self, zone: str, energy_uj: int) -> None:
        self.set(zone, self.get(zone) + energy_uj)

    def set_max(self, zone: str, max_uj: int) -> None:
        (self.zones[zone] / "max_energy_range_uj").write_text(f"{max_uj}\n")


@pytest.fixture
def nvml(monkeypatch):
    """Two stand-in GPUs (not root: a read-only monitor needs no permission), all visible."""
    fake = FakeNVML(gpus=[FakeGPU(uuid="GPU-aaaa"), FakeGPU(uuid="GPU-bbbb", power_w=300.0)])
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


@pytest.fixture
def rapl(tmp_path):
    return FakePowercap(tmp_path / "powercap")


class FakeClock:
    """The monitor's time.monotonic, moved only by ``advance`` (the stand-in GPUs keep their own fake time)."""

    def __init__(self):
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for the monitor's readings: windows last exactly what the test says."""
    fake = FakeClock()
    monkeypatch.setattr(monitor_module, "time", fake)
    return fake


def assert_only_reads(fake: FakeNVML) -> None:
    names = {c[0] for c in fake.calls}
    assert fake.set_calls() == [] and not names & set(SETTERS)
    assert names <= READS, names - READS


# -- windows ---------------------------------------------------------------------------------------------------------
def test_a_window_is_the_counters_difference_exactly(nvml, rapl, clock):
    monitor = EnergyMonitor(powercap_root=rapl.root)
    assert monitor.gpu_indices == (0, 1) and monitor.rapl_unavailable is None
    assert monitor.gpu_energy_sources == {0: COUNTER, 1: COUNTER}
    assert monitor.counter_period_s == {0: 0.1, 1: 0.1}  # the H100's, from search_spaces/h100-sxm.toml
    monitor.begin_window("step")
    clock.advance(1.0)
    nvml.gpus[0].energy_mj += 123_456  # mJ
    nvml.gpus[1].advance(1.0)  # 300 W for 1 s: 300 J, in ten counter updates
    rapl.add("package-0", 5_000_000)  # µJ
    rapl.add("dram-package-0", 1_500_000)
    rapl.add("core-package-0", 9_000_000)  # inside the package: not counted again
    rapl.add("psys", 7_000_000)  # the platform: not a package
    rapl.add("mmio", 8_000_000)  # package 0 again, through MMIO: not counted twice
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole second: no short-window warning
        m = monitor.end_window("step")
    assert isinstance(m, WindowMeasurement) and m.name == "step"
    assert m.gpu_energy_j == {0: pytest.approx(123.456, abs=1e-9), 1: pytest.approx(300.0, abs=1e-9)}
    assert m.gpu_energy_source == {0: COUNTER, 1: COUNTER}
    assert m.cpu_energy_j == {0: pytest.approx(5.0, abs=1e-12)}
    assert m.dram_energy_j == {0: pytest.approx(1.5, abs=1e-12)}
    assert (m.gpu_total_energy_j, m.cpu_total_energy_j, m.dram_total_energy_j) == pytest.approx((423.456, 5.0, 1.5))
    assert m.total_energy_j == pytest.approx(123.456 + 300 + 5 + 1.5, abs=1e-9)
    assert m.time_s == pytest.approx(1.0)
    summary = m.summary()
    assert summary["gpu_energy_j"] == {"0": m.gpu_energy_j[0], "1": m.gpu_energy_j[1]}
    assert summary["gpu_energy_source"] == {"0": COUNTER, "1": COUNTER} and summary["covers"] == COVERS
    assert (summary["gpu_total_energy_j"], summary["cpu_total_energy_j"]) == pytest.approx((423.456, 5.0))
    assert "every process" in COVERS["gpu"] and "idle" in COVERS["gpu"] and "every process" in COVERS["cpu"]
    assert_only_reads(nvml)


def test_a_window_shorter_than_the_counters_period_is_power_times_time_with_a_warning(nvml, clock):
    """NVML's counter moves at its update period (the stand-in's and the H100's: 100 ms): over half a period the
    counter reads 0 J, then a whole period's 30 J; power x time gives 15 J for each half, and a warning says so."""
    monitor = EnergyMonitor(gpu_indices=[1], cpu=False)
    for name in ("short", "next"):
        monitor.begin_window(name)
        nvml.gpus[1].advance(0.05)
        clock.advance(0.05)
        with pytest.warns(ShortWindowWarning) as caught:
            m = monitor.end_window(name)
        assert m.gpu_energy_j == {1: pytest.approx(300 * 0.05)} and m.gpu_energy_source == {1: POWER_X_TIME}
    assert nvml.gpus[1].energy_mj == 1_000_000 + 30_000  # the counter did read 0 J, then 30 J
    message = str(caught[0].message)
    assert message == ("window 'next' lasted 50.0 ms, under the energy counter's update period: GPU 1 (100 ms) "
                       "estimated as power x time (nvmlDeviceGetPowerUsage at the window's end); measure many steps "
                       "in one window for the counter's own figure")  # fmt: skip
    monitor.begin_window("long")  # a whole period and more: the counter's own figure, no warning
    nvml.gpus[1].advance(0.2)
    clock.advance(0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = monitor.end_window("long")
    assert m.gpu_energy_j == {1: pytest.approx(60.0)} and m.gpu_energy_source == {1: COUNTER}


def test_a_short_window_without_a_power_reading_keeps_the_counter_and_says_it_may_read_zero(nvml, clock):
    nvml.gpus[0].power_reading = False
    monitor = EnergyMonitor(cpu=False, energy_counter_period_s=0.5)  # the period given: both GPUs' 500 ms
    assert monitor.counter_period_s == {0: 0.5, 1: 0.5}
    monitor.begin_window("w")
    clock.advance(0.2)
    for gpu in nvml.gpus:
        gpu.advance(0.05)
    with pytest.warns(ShortWindowWarning, match=r"GPU 1 \(500 ms\) estimated as power x time.*; GPU 0 \(500 ms\) "
                                                r"kept the counter's difference, which may read 0 J"):  # fmt: skip
        m = monitor.end_window("w")
    assert m.gpu_energy_j == {0: 0.0, 1: pytest.approx(300 * 0.2)}
    assert m.gpu_energy_source == {0: COUNTER, 1: POWER_X_TIME}


def test_a_gpu_without_an_energy_counter_is_measured_from_power_samples_by_the_trapezoid_rule(nvml, clock):
    """Every begin and end samples every such GPU's power, so nested windows give the trapezoid exactly: 100 W at
    t = 0, 500 W at t = 1 s and t = 2 s."""
    gpu = nvml.gpus[1]
    gpu.energy_counter, gpu.power_w = False, 100.0
    monitor = EnergyMonitor(cpu=False, power_sample_period_s=3600)  # no background sample within the test
    assert monitor.gpu_energy_sources == {0: COUNTER, 1: POWER_SAMPLES} and set(monitor.counter_period_s) == {0}
    monitor.begin_window("a")
    clock.advance(1.0)
    gpu.power_w = 500.0
    monitor.begin_window("b")
    clock.advance(1.0)
    nvml.gpus[0].advance(2.0)  # the GPU with a counter: 400 W for 2 s
    a = monitor.end_window("a")
    b = monitor.end_window("b")
    trapezoid_j = (100 + 500) / 2 * 1.0 + 500 * 1.0
    assert a.gpu_energy_j == {0: pytest.approx(800.0, abs=0.01), 1: pytest.approx(trapezoid_j)}  # int mJ: 799.999
    assert b.gpu_energy_j[1] == pytest.approx(500.0)
    assert a.gpu_energy_source == {0: COUNTER, 1: POWER_SAMPLES}
    monitor.begin_window("short")  # shorter than any counter period: a sampled GPU needs no estimate
    clock.advance(0.01)
    with pytest.warns(ShortWindowWarning, match=r"GPU 0 \(100 ms\) estimated") as caught:
        short = monitor.end_window("short")
    assert "GPU 1" not in str(caught[0].message)
    assert short.gpu_energy_j[1] == pytest.approx(5.0) and short.gpu_energy_source[1] == POWER_SAMPLES
    assert_only_reads(nvml)


def test_power_is_sampled_in_the_background_while_a_window_is_open(nvml):
    gpu = nvml.gpus[0]
    gpu.energy_counter = False
    monitor = EnergyMonitor([0], cpu=False, power_sample_period_s=0.01)
    names = lambda: [t.name for t in threading.enumerate()]  # noqa: E731
    assert "freqopt-power-sample" not in names()
    with monitor.window("w") as w:
        before = len(nvml.calls)
        time.sleep(0.3)
        sampled = sum(c[0] == "nvmlDeviceGetPowerUsage" for c in nvml.calls[before:])
        assert "freqopt-power-sample" in names()
    assert sampled >= 3  # 30 periods slept; a loaded machine may run the thread late, never not at all
    assert "freqopt-power-sample" not in names()  # stopped with the last window
    assert w.result.gpu_energy_j[0] == pytest.approx(400.0 * w.result.time_s, rel=1e-9)  # constant 400 W


def test_a_gpu_with_neither_counter_nor_power_reading_is_named(nvml):
    nvml.gpus[1].energy_counter = nvml.gpus[1].power_reading = False
    with pytest.raises(NVMLError, match=r"gpu_indices: GPU 1 \(NVIDIA H100 80GB HBM3\) has neither an energy "
                                        r"counter .* nor a power reading .*; leave it out") as e:  # fmt: skip
        EnergyMonitor(cpu=False)
    assert e.value.argument == "gpu_indices"
    assert EnergyMonitor([0], cpu=False).gpu_indices == (0,)


class FakeCUDA:
    """torch.cuda's calls the monitor makes, recorded."""

    def __init__(self, *, available=True, initialized=True, count=2):
        self.available, self.initialized, self.count, self.synchronized = available, initialized, count, []

    def install(self, monkeypatch):
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.available)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.synchronized.append(device))
        return self


def test_every_monitored_gpu_is_synchronized_at_begin_and_end_by_default(nvml, monkeypatch):
    cuda = FakeCUDA().install(monkeypatch)
    monitor = EnergyMonitor(cpu=False)
    assert monitor.sync is not None
    monitor.begin_window("w")
    assert cuda.synchronized == [0, 1]
    monitor.end_window("w")
    assert cuda.synchronized == [0, 1, 0, 1]
    cuda.synchronized.clear()
    with EnergyMonitor([1], cpu=False).window("one"):
        pass
    assert cuda.synchronized == [1, 1]
    cuda.synchronized.clear()
    with EnergyMonitor(cpu=False, sync=False).window("off"):  # turned off: queued work may land later
        pass
    assert cuda.synchronized == []
    cuda.initialized = False  # a process that never used CUDA has queued nothing: no context is made for it
    with EnergyMonitor(cpu=False).window("no cuda work"):
        pass
    assert cuda.synchronized == []


def test_without_cuda_nothing_is_synchronized_and_a_callable_sync_is_called(nvml, monkeypatch):
    FakeCUDA(available=False).install(monkeypatch)
    assert EnergyMonitor(cpu=False).sync is None and EnergyMonitor([], cpu=False).sync is None
    called = []
    monitor = EnergyMonitor(cpu=False, sync=lambda: called.append(len(monitor.open_windows)))
    with monitor.window("w"):
        pass
    assert called == [0, 1]  # before the begin's reading (nothing open yet) and before the end's
    with pytest.raises(InvalidSettingError, match="sync must be True, False or a callable, not 'yes'") as e:
        EnergyMonitor(cpu=False, sync="yes")
    assert e.value.argument == "sync"


def test_windows_nest_and_overlap_each_as_if_alone(nvml, rapl, clock):
    monitor = EnergyMonitor(gpu_indices="0", powercap_root=rapl.root)
    gpu = nvml.gpus[0]
    monitor.begin_window("outer")
    clock.advance(1.0)
    gpu.energy_mj += 1_000
    rapl.add("package-0", 1_000_000)
    monitor.begin_window("a")
    gpu.energy_mj += 2_000
    rapl.add("package-0", 2_000_000)
    clock.advance(1.0)
    monitor.begin_window("b")  # overlaps a: begins inside it, ends after it
    gpu.energy_mj += 4_000
    rapl.add("package-0", 4_000_000)
    clock.advance(1.0)
    assert monitor.open_windows == ("outer", "a", "b")
    a = monitor.end_window("a")
    clock.advance(1.0)
    gpu.energy_mj += 8_000
    rapl.add("package-0", 8_000_000)
    b = monitor.end_window("b")
    outer = monitor.end_window("outer")
    assert (a.gpu_energy_j[0], b.gpu_energy_j[0], outer.gpu_energy_j[0]) == pytest.approx((6.0, 12.0, 15.0))
    assert (a.cpu_energy_j[0], b.cpu_energy_j[0], outer.cpu_energy_j[0]) == pytest.approx((6.0, 12.0, 15.0))
    assert outer.time_s >= b.time_s >= 0 and outer.time_s >= a.time_s
    assert monitor.open_windows == ()


def test_the_context_manager_fills_its_result_at_exit_also_on_an_exception(nvml, clock):
    monitor = EnergyMonitor(gpu_indices=[0], cpu=False)
    with monitor.window("block") as w:
        assert w.result is None and monitor.open_windows == ("block",)
        clock.advance(1.0)
        nvml.gpus[0].energy_mj += 42_000
    assert w.result.name == "block" and w.result.gpu_energy_j == {0: pytest.approx(42.0)}
    with pytest.raises(RuntimeError, match="boom"):
        with monitor.window("failing") as failing:
            clock.advance(1.0)
            nvml.gpus[0].energy_mj += 1_000
            raise RuntimeError("boom")
    assert failing.result.gpu_energy_j == {0: pytest.approx(1.0)} and monitor.open_windows == ()


def test_window_names_are_checked(nvml):
    monitor = EnergyMonitor(gpu_indices=[0], cpu=False)
    with pytest.raises(InvalidSettingError, match=r"name 'x' is not an open window \(no window is open\)") as e:
        monitor.end_window("x")
    assert e.value.argument == "name"
    monitor.begin_window("x")
    with pytest.raises(InvalidSettingError, match="name 'x' is already an open window") as e:
        monitor.begin_window("x")
    assert e.value.argument == "name"
    with pytest.raises(InvalidSettingError, match=r"name 'y' is not an open window \(open: 'x'\)"):
        monitor.end_window("y")
    monitor.end_window("x")
    with pytest.raises(InvalidSettingError, match="name 'x' is not an open window"):  # ended already
        monitor.end_window("x")
    with pytest.raises(InvalidSettingError, match="name 'x' is already an open window"):
        with monitor.window("x"):
            monitor.begin_window("x")
    assert monitor.open_windows == ()  # the with block's window ended all the same


@pytest.mark.parametrize("value, message", [
    ("a,b", "gpu_indices 'a,b' is not a list of GPU indices"),
    ("0,0", "gpu_indices '0,0' names a GPU twice"),
    ([-1], r"gpu_indices \[-1\] must be GPU indices"),
    ([True], r"gpu_indices \[True\] must be GPU indices"),
    ([2], r"gpu_indices 2 is not a visible GPU: this process sees 2 \(indices 0 to 1"),
])  # fmt: skip
def test_bad_gpu_indices_are_refused(nvml, value, message):
    with pytest.raises(InvalidSettingError, match=message) as e:
        EnergyMonitor(value, cpu=False)
    assert e.value.argument == "gpu_indices"


def test_gpu_indices_follow_cuda_visible_devices(nvml, monkeypatch, clock):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monitor = EnergyMonitor(cpu=False)
    assert monitor.gpu_indices == (0,)
    monitor.begin_window("w")
    clock.advance(1.0)
    nvml.gpus[1].energy_mj += 5_000  # the GPU CUDA calls 0
    nvml.gpus[0].energy_mj += 9_000
    assert monitor.end_window("w").gpu_energy_j == {0: pytest.approx(5.0)}


def test_without_nvml_the_gpu_part_fails_clearly_unless_no_gpu_is_asked_for(nvml):
    nvml.driver = False
    for asked in (None, [0], "0"):
        with pytest.raises(NVMLError, match=r"gpu_indices: GPU energy needs NVML, which fails here \(NVML Shared "
                                            r"Library Not Found\); ask for no GPU") as e:  # fmt: skip
            EnergyMonitor(asked, cpu=False)
        assert e.value.argument == "gpu_indices"
    nvml.calls.clear()
    for none in ([], "none", ""):
        monitor = EnergyMonitor(none, cpu=False)
        with monitor.window("cpu only") as w:
            pass
        assert w.result.gpu_energy_j == {} and w.result.total_energy_j == 0.0 and w.result.time_s >= 0
    assert nvml.calls == []  # NVML was never touched


# -- RAPL ----------------------------------------------------------------------------------------------------------
def test_rapl_wrap_around_is_undone(nvml, rapl):
    rapl.set_max("package-0", 1_000_000)
    rapl.set("package-0", 900_000)
    monitor = EnergyMonitor([], powercap_root=rapl.root, rapl_poll_s=None)
    monitor.begin_window("w")
    rapl.set("package-0", 100_000)  # 100,000 µJ to the top, wrapped to 0, 100,000 more
    assert monitor.end_window("w").cpu_energy_j == {0: pytest.approx(0.2)}


def test_rapl_is_polled_while_a_window_is_open_so_no_wrap_is_missed(nvml, rapl):
    rapl.set_max("package-0", 1_000_000)
    rapl.set("package-0", 0)
    monitor = EnergyMonitor([], powercap_root=rapl.root, rapl_poll_s=0.01)
    assert not [t for t in threading.enumerate() if t.name == "freqopt-rapl-poll"]
    monitor.begin_window("long")
    rapl.set("package-0", 900_000)
    deadline = time.monotonic() + 10
    while monitor._rapl.packages[0].last_uj != 900_000 and time.monotonic() < deadline:  # the poll's read
        time.sleep(0.01)
    rapl.set("package-0", 100_000)  # wrapped once since the poll: 1.1 J in all (begin and end alone: 0.1 J)
    assert monitor.end_window("long").cpu_energy_j == {0: pytest.approx(1.1)}
    assert not [t for t in threading.enumerate() if t.name == "freqopt-rapl-poll"]  # stopped with the last window


def test_rapl_sums_the_dies_of_a_package_and_keeps_packages_apart(nvml, tmp_path):
    tree = FakePowercap(tmp_path / "pc", packages=(0, 1), dies=2, dram=False)
    monitor = EnergyMonitor([], powercap_root=tree.root)
    monitor.begin_window("w")
    for zone, uj in [("package-0-die-0", 1_000_000), ("package-0-die-1", 2_000_000), ("package-1-die-0", 4_000_000),
                     ("package-1-die-1", 8_000_000)]:  # fmt: skip
        tree.add(zone, uj)
    m = monitor.end_window("w")
    assert m.cpu_energy_j == {0: pytest.approx(3.0), 1: pytest.approx(12.0)}
    assert m.dram_energy_j is None  # no DRAM domain (as on AMD): not measured, not zero
    assert m.total_energy_j == pytest.approx(15.0)


def _deny(monkeypatch, path: Path) -> None:
    """Reading ``path`` raises PermissionError, as a root-only energy_uj does for a user (the tests may run as root,
    whom chmod does not stop)."""
    original = Path.read_text

    def read_text(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)


@pytest.mark.parametrize("how", ["patched", "chmod"])
def test_an_unreadable_counter_gives_none_and_one_warning_that_says_what_to_do(nvml, rapl, monkeypatch, clock, how):
    counter = rapl.zones["package-0"] / "energy_uj"
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root reads a file whatever its mode")
        counter.chmod(0o400)
    else:
        _deny(monkeypatch, counter)
    with pytest.warns(RAPLWarning) as caught:
        monitor = EnergyMonitor([0], powercap_root=rapl.root)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{counter} is readable by root only" in message
    assert f"sudo chmod o+r {rapl.root}/intel-rapl:*/energy_uj" in message and "run as root" in message
    with monitor.window("w") as w:
        clock.advance(1.0)
        nvml.gpus[0].energy_mj += 2_000
    assert (w.result.cpu_energy_j, w.result.dram_energy_j) == (None, None)
    assert w.result.gpu_energy_j == {0: pytest.approx(2.0)} and w.result.total_energy_j == pytest.approx(2.0)
    assert monitor.rapl_unavailable == message.removeprefix("CPU and DRAM energy are not measured: ")
    with pytest.raises(InvalidSettingError, match="cpu=True, but CPU energy cannot be measured: .* root only") as e:
        EnergyMonitor([0], cpu=True, powercap_root=rapl.root)
    assert e.value.argument == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cpu=False: not read, nothing to warn about
        assert EnergyMonitor([0], cpu=False, powercap_root=rapl.root).rapl_unavailable == "not asked for (cpu=False)"


def test_no_powercap_folder_or_no_package_zone(nvml, tmp_path):
    with pytest.warns(RAPLWarning, match="does not exist: this host exposes no RAPL counters"):
        monitor = EnergyMonitor([], powercap_root=tmp_path / "absent")
    with monitor.window("w") as w:
        pass
    assert w.result.cpu_energy_j is None
    (tmp_path / "empty" / "intel-rapl").mkdir(parents=True)
    with pytest.warns(RAPLWarning, match="holds no RAPL package zone.*modprobe intel_rapl_msr"):
        EnergyMonitor([], powercap_root=tmp_path / "empty")


def test_bad_monitor_settings(nvml):
    with pytest.raises(InvalidSettingError, match="cpu must be True, False or 'auto', not 'yes'"):
        EnergyMonitor([], cpu="yes")
    with pytest.raises(InvalidSettingError, match="rapl_poll_s must be positive"):
        EnergyMonitor([], rapl_poll_s=0)
    for argument in ("power_sample_period_s", "energy_counter_period_s"):
        with pytest.raises(InvalidSettingError, match=f"{argument} must be positive \\(seconds\\)") as e:
            EnergyMonitor([], cpu=False, **{argument: -1.0})
        assert e.value.argument == argument


# -- a whole command -----------------------------------------------------------------------------------------------
def test_measure_command_refuses_a_missing_or_unknown_program(nvml):
    unknown = "command 'no-such-program-xyz' is not an executable program"
    for command, message in [([], "command is missing"), (["no-such-program-xyz"], unknown)]:
        with pytest.raises(InvalidSettingError, match=message) as e:
            measure_command(command, gpu_indices=[])
        assert e.value.argument == "command"
    assert nvml.calls == []  # refused before NVML was opened


@pytest.fixture
def narrow_terminal(monkeypatch):
    """The environment that wrapped the table at 80 columns: a dumb terminal 40 columns wide."""
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("TERM", "dumb")


def test_cli_measures_a_command_passes_its_exit_status_and_writes_json(nvml, rapl, monkeypatch, tmp_path, capsys,
                                                                       narrow_terminal):  # fmt: skip
    for gpu in nvml.gpus:
        gpu.realtime = True  # the counter advances with the wall clock, at 400 and 300 W
    monkeypatch.setattr(monitor_module, "POWERCAP_ROOT", str(rapl.root))
    counter = rapl.zones["package-0"] / "energy_uj"
    child = (f"import sys, time, pathlib; p = pathlib.Path({str(counter)!r}); "
             "p.write_text(str(int(p.read_text()) + 2_500_000)); time.sleep(0.5); print('child out'); sys.exit(3)")
    out = tmp_path / "m.json"
    assert main(["measure", "--json", str(out), "--", sys.executable, "-c", child]) == 3
    captured = capsys.readouterr()
    assert "child out" not in captured.err  # the child's stdout is its own (not captured by capsys: a subprocess)
    first = captured.err.splitlines()[0]  # the command on one line, however long its path
    assert first.startswith(f"freqopt: {sys.executable} -c import sys") and first.endswith("… (exit status 3)")
    rows = {line.split("│")[1].strip(): line.split("│")[2:] for line in captured.err.splitlines() if "│" in line}
    assert set(rows) >= {"time", "GPU 0 (NVIDIA H100 80GB HBM3)", "GPU 1 (NVIDIA H100 80GB HBM3)", "GPUs together",
                         "CPU package 0", "DRAM of package 0", "total energy"}, rows  # fmt: skip
    assert re.fullmatch(r"[\d.,]+ J", rows["GPU 0 (NVIDIA H100 80GB HBM3)"][0].strip())
    assert "every process on it (NVML energy counter)" in rows["GPU 0 (NVIDIA H100 80GB HBM3)"][1]
    assert "idle ones too" in rows["GPUs together"][1]
    assert "the whole socket" in rows["CPU package 0"][1] and "not the command alone" in rows["total energy"][1]
    doc = json.loads(out.read_text())
    assert (doc["returncode"], doc["exit_code"], doc["interrupted"], doc["name"]) == (3, 3, [], "command")
    assert doc["command"] == [sys.executable, "-c", child] and doc["rapl_unavailable"] is None
    assert doc["cpu_energy_j"] == {"0": pytest.approx(2.5)} and doc["dram_energy_j"] == {"0": 0.0}
    t = doc["time_s"]
    assert 0.5 <= t < 30
    for index, power_w in (("0", 400.0), ("1", 300.0)):  # within one counter period (0.1 s) of power x time
        assert abs(doc["gpu_energy_j"][index] - power_w * t) <= power_w * 0.1 + 1.0
    assert doc["total_energy_j"] == pytest.approx(sum(doc["gpu_energy_j"].values()) + 2.5)
    assert doc["gpu_total_energy_j"] == pytest.approx(sum(doc["gpu_energy_j"].values()))
    assert (doc["cpu_total_energy_j"], doc["dram_total_energy_j"]) == (pytest.approx(2.5), 0.0)
    assert doc["gpu_energy_source"] == {"0": COUNTER, "1": COUNTER} and doc["covers"] == COVERS
    assert_only_reads(nvml)


def test_cli_exit_status_of_a_killed_command_and_of_success(nvml, monkeypatch, tmp_path, capsys, narrow_terminal):
    monkeypatch.setattr(monitor_module, "POWERCAP_ROOT", str(tmp_path / "absent"))
    assert main(["measure", "--gpus", "none", "--", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]) == 137
    err = capsys.readouterr().err
    assert err.startswith("freqopt: warning: CPU and DRAM energy are not measured:")
    assert err.splitlines()[1] == f"freqopt: {sys.executable} -c import os; os.kill(os.getpid(), 9) (exit status 137)"
    assert "nothing measured" in err and " J " not in err  # no total of 0 J for energy nobody measured
    assert main(["measure", "--gpus", "0", "--", sys.executable, "-c", "pass"]) == 0
    err = capsys.readouterr().err
    assert f"freqopt: {sys.executable} -c pass (exit status 0)\n" in err
    assert "GPU 0 (" in err and "GPU 1 (" not in err and "GPUs together" not in err
    assert "not the command alone" in err and "nothing measured" not in err


@pytest.mark.parametrize("args, message", [
    (["measure"], "freqopt: error: command is missing"),
    (["measure", "--", "no-such-program-xyz"], "command 'no-such-program-xyz' is not an executable program"),
    (["measure", "--gpus", "x", "--", "true"], "freqopt: error: --gpus 'x' is not a list of GPU indices"),
    (["measure", "--gpus", "7", "--", "true"], "freqopt: error: --gpus 7 is not a visible GPU"),
    (["measure", "--json", "/no/such/folder/m.json", "--", "true"], "--json /no/such/folder/m.json: cannot write"),
])  # fmt: skip
def test_cli_bad_input_is_one_line_and_exit_2(nvml, args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert_only_reads(nvml)


def test_cli_refusal_loads_neither_torch_nor_optuna():
    code = ("import sys; from freqopt.cli import main; code = main(['measure', '--gpus', 'x', '--', 'true']); "
            "print(code, 'torch' in sys.modules, 'optuna' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr


PARENT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from fake_pynvml import FakeGPU, FakeNVML
    sys.modules["pynvml"] = FakeNVML(gpus=[FakeGPU(realtime=True)]).module()
    from freqopt.cli import main
    from freqopt.measure import monitor
    monitor.POWERCAP_ROOT = {powercap!r}
    sys.exit(main(["measure", "--json", {out!r}, "--", sys.executable, "-c", {child!r}]))
""")
CHILD = textwrap.dedent("""
    import pathlib, signal, sys, time
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM too: KeyboardInterrupt
    pathlib.Path({ready!r}).write_text("ready")
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("child interrupted", flush=True)
        sys.exit(7)
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_freqopt_reaches_the_command_and_the_run_is_still_reported(rapl, tmp_path, signum):
    ready, out = tmp_path / "ready", tmp_path / "m.json"
    child = CHILD.format(ready=str(ready))
    script = PARENT.format(tests=str(TESTS), powercap=str(rapl.root), out=str(out), child=child)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), parent.communicate(timeout=30)
        parent.send_signal(signum)  # to freqopt alone (no terminal): it passes the signal on
        stdout, stderr = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode == 7, stderr
    assert "child interrupted" in stdout
    assert f"the command was interrupted (signal {int(signum)}); measured until it ended" in stderr
    doc = json.loads(out.read_text())
    assert (doc["exit_code"], doc["interrupted"]) == (7, [int(signum)]) and doc["time_s"] > 0
    assert doc["cpu_energy_j"] == {"0": 0.0} and set(doc["gpu_energy_j"]) == {"0"}


# -- the docs' example ---------------------------------------------------------------------------------------------
def test_the_docs_example_runs(nvml, rapl, monkeypatch):
    """docs/measure.md's Python block, run as written on the stand-in NVML and the fake powercap tree."""
    monkeypatch.setattr(monitor_module, "POWERCAP_ROOT", str(rapl.root))
    page = (ROOT / "docs" / "measure.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- test: example -->\s*```python\n(.*?)```", page, re.DOTALL)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "docs/measure.md", "exec"), namespace)
    steps = namespace["steps"]
    assert [s.name for s in steps] == ["step"] * 3 and all(s.time_s > 0 for s in steps)
    assert namespace["epoch"].time_s >= sum(s.time_s for s in steps)
    assert_only_reads(nvml)
