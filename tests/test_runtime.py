"""The DVFS runtime and `freqopt train`: phases followed through hooks, switches off the training thread, the
simulated timeline, and the GPU restored on every exit path (SIGTERM mid-run; `freqopt reset` after SIGKILL)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from freqopt.backends.base import ClockSetting
from freqopt.backends.simulated import SimulatedGPU
from freqopt.cli import main
from freqopt.gpus import get_gpu
from freqopt.models import Workload, build_model
from freqopt.models.gpt3 import GPTConfig
from freqopt.phases import quiet_backward_hooks
from freqopt.runtime import DVFSRuntime, plan_phases
from freqopt.tables import ClockTable
from freqopt.trace import trace_training_iteration

sys.path.insert(0, str(Path(__file__).parent))
from fake_pynvml import FakeGPU, FakeNVML  # noqa: E402

H100 = get_gpu("h100-sxm").with_switch_latency(0.006)  # the GH200's 6 ms: this file's 2-layer phases can switch
TINY = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=512, seq_len=16)


def pass_table(forward: int, backward: int) -> ClockTable:
    entries = [{"unit": p, "sm_clock_mhz": c, "mem_clock_mhz": 2619, "power_limit_w": None}
               for p, c in (("forward", forward), ("backward", backward))]  # fmt: skip
    return ClockTable({"granularity": "pass", "entries": entries, "gpu": {"name": "h100-sxm"}})


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
    workload = Workload("gpt3-xl-like", GPTConfig(n_layers=2, d_model=2048, n_heads=16, seq_len=2048), 4)
    trace = trace_training_iteration(workload)
    sim = SimulatedGPU(H100, noise=False)
    model = build_model(TINY, device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    table = pass_table(1500, 1200)
    with DVFSRuntime(model, optimizer, table=table, backend=sim, trace=trace, check_trace=False) as runtime:
        train_steps(model, optimizer)
        measured = runtime.step_measurement()
        plan = runtime.plan
    assert set(plan.settings) == {ClockSetting(1500, 2619), ClockSetting(1200, 2619)}
    assert sim.applied == plan.settings[-1]  # the controller applied the last phase's setting to the simulated GPU
    expected = sim.measure_schedule(trace.kernels, plan.per_kernel(list(plan.settings), len(trace)), switching=True)
    assert measured == expected
    default = sim.measure_schedule(trace.kernels, plan_phases(None, trace, sim).per_kernel(
        list(plan_phases(None, trace, sim).settings), len(trace)))  # fmt: skip
    assert measured.energy_j < default.energy_j and measured.time_s > default.time_s
    assert runtime.switches == 2 * 2  # into backward and back into forward, per step


def test_runtime_switches_through_the_controller_and_restores(fake_gpu):
    from freqopt.backends.nvml import NVMLBackend
    from freqopt.nvml import open_devices

    # Phases of milliseconds (a wide 2-layer model's trace) followed through a tiny model's hooks (same modules).
    trace = trace_training_iteration(Workload("wide", GPTConfig(n_layers=2, d_model=2048, n_heads=16, seq_len=2048), 4))
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
        while not runtime._controller.requests.empty():
            time.sleep(0.01)
        assert runtime._controller.error is None
    locks = [c[2] for c in fake_gpu.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
    assert set(locks) == {1500, 1200} and len(locks) >= 4  # forward and backward clocks, switched every step
    assert all(a != b for a, b in zip(locks, locks[1:]))  # a switch only where the setting changes
    gpu = fake_gpu.gpus[0]
    assert (gpu.locked_sm_mhz, gpu.power_limit_mw) == (None, 650_000)


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
    from freqopt.train import train

    report = train(Workload("tiny", TINY, micro_batch), SimulatedGPU(H100, seed=0), table=None, steps=2)
    _check_whole_steps(report, 2)


@pytest.mark.parametrize("micro_batch", [1, 3])
def test_train_runs_whole_steps_through_nvml_on_the_cpu(fake_gpu, micro_batch):
    from freqopt.backends.nvml import NVMLBackend
    from freqopt.nvml import open_devices
    from freqopt.train import train

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
                 "--trials", "3", "--seq-len", "64", "--micro-batch-size", "1", "--out", str(tmp_path / "s")]) == 0  # fmt: skip
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


def test_sigterm_to_freqopt_train_restores_the_gpu(tmp_path):
    child, gpu_file = _start_training(tmp_path)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) != 0
    gpu = json.loads(gpu_file.read_text())["gpus"][0]
    assert (gpu["locked_sm_mhz"], gpu["power_limit_mw"]) == (None, 600_000)
    assert not list((tmp_path / "state").glob("*.json"))


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


def test_cli_train_runs_data_parallel_under_deepspeed(tmp_path):
    """With a layout of two ranks, freqopt train starts itself under DeepSpeed's launcher (gloo on this CPU)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "dp2.json"
    cmd = [sys.executable, "-m", "freqopt.cli", "train", "--model", "gpt3-small", "--layout", "dp=2", "--seq-len", "32",
           "--micro-batch-size", "1", "--steps", "2", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert len(doc["steps"]) == 2 and doc["default"]["energy_j_per_step"] > 0
    assert "(dp=2,tp=1) training" in done.stdout
