"""freqopt.measure.stage_profile (``freqopt stage-profile``, issue 51, item 4): the stage profile ``freqopt plan``
reads, measured on the simulated GPU and on the stand-in NVML (tests/fake_pynvml.py), resumed, and refused where it
must be."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from freqopt.errors import InvalidSettingError

CLOCKS = (1980, 1500, 1200, 900)


def tiny_pipeline():
    """A two-layer GPT on two pipeline stages (fast to trace, and to replay on a CPU for the stand-in NVML)."""
    from freqopt.workload.layout import Layout
    from freqopt.workload.models import Workload
    from freqopt.workload.models.gpt3 import GPTConfig

    config = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=16)
    return Workload("tiny", config, 2, Layout(pp=2))


def test_the_cli_profile_loads_and_the_printed_plan_command_plans_it(tmp_path, capsys):
    """stage-profile on the simulated GPU writes a CSV that load_stage_profile reads (every stage, forward and
    backward, at every clock asked for), and the plan command it prints last runs as printed and plans it."""
    from freqopt.cli import main
    from freqopt.pipeline.planner import plan_pipeline
    from freqopt.pipeline.profile import load_stage_profile

    out = tmp_path / "stages.csv"
    assert main(["stage-profile", "--model", "gpt3-small", "--layout", "pp=2", "--seq-len", "256",
                 "--micro-batch-size", "1", "--sm-clocks", "1980,1410,1005", "--out", str(out)]) == 0  # fmt: skip
    captured = capsys.readouterr()
    profile = load_stage_profile(out)
    assert profile.stages == 2 and set(profile.options) == {(s, k) for s in (0, 1) for k in ("forward", "backward")}
    for options in profile.options.values():
        assert options.sm_clock_mhz.tolist() == [1005, 1410, 1980]
        assert (options.time_s > 0).all() and options.energy_j[0] < options.energy_j[-1]  # lower clock, less energy
    last = captured.err.strip().splitlines()[-1]
    command = shlex.split(last[last.index("freqopt plan"):])
    assert command[:2] == ["freqopt", "plan"] and "--blocking-power-w" in command and "--gpu" in command
    assert main(command[1:]) == 0
    printed = capsys.readouterr().out
    assert "the plan's clocks (MHz)" in printed and "stage 1:" in printed
    watts = float(command[command.index("--blocking-power-w") + 1])
    plan = plan_pipeline(out, 4, blocking_power_w=watts, gpu="h100-sxm", max_slowdown="1%")
    assert f"{plan.energy_j:,.1f}" in printed and plan.energy_j < plan.default_energy_j


def test_resume_measures_only_the_missing_rows_and_equals_an_uninterrupted_run(tmp_path):
    from freqopt.measure.stage_profile import measure_stage_profile

    whole = measure_stage_profile(tiny_pipeline(), out=tmp_path / "whole.csv", sm_clocks_mhz=CLOCKS)
    assert (whole.n_measured, whole.n_reused) == (16, 0) and whole.stages == 2

    out = tmp_path / "resumed.csv"
    first = []

    def stop_at(n):
        def on_progress(done, total, what):
            if what:
                first.append(what)
            if done == n:
                raise KeyboardInterrupt
        return on_progress

    with pytest.raises(KeyboardInterrupt):  # inside the first clock: no stage profile yet, so no file
        measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=CLOCKS, on_progress=stop_at(2))
    assert not out.exists()
    first.clear()
    with pytest.raises(KeyboardInterrupt):  # a clock and a half: the file holds all six rows, and loads
        measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=CLOCKS, on_progress=stop_at(6))
    assert len(first) == 6
    from freqopt.pipeline.profile import load_stage_profile

    partial = load_stage_profile(out)
    assert sum(len(o.sm_clock_mhz) for o in partial.options.values()) == 6

    again = []
    resumed = measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=CLOCKS,
                                    on_progress=lambda done, total, what: what and again.append(what))  # fmt: skip
    assert (resumed.n_measured, resumed.n_reused) == (10, 6)
    assert not set(again) & set(first) and len(again) == 10  # nothing measured twice
    assert out.read_text() == whole.path.read_text()  # the same rows, to the last digit
    # A run over the whole file measures nothing, and a run with another clock adds only its rows.
    assert measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=CLOCKS).n_measured == 0
    more = measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=[600])
    assert (more.n_measured, more.n_reused) == (4, 0)
    assert more.profile.options[(1, "backward")].sm_clock_mhz.tolist() == [600, *sorted(CLOCKS)]


def test_a_foreign_or_corrupt_file_is_refused_and_left_alone(tmp_path):
    from freqopt.measure.stage_profile import measure_stage_profile

    perseus = tmp_path / "perseus.csv"  # a stage profile, but not one this command wrote
    perseus.write_text("stage,instruction,frequency,time,energy\n0,forward,1410,0.05,24.1\n")
    with pytest.raises(InvalidSettingError, match="is not a stage profile this command wrote") as e:
        measure_stage_profile(tiny_pipeline(), out=perseus, sm_clocks_mhz=[1980])
    assert e.value.argument == "out"
    assert perseus.read_text() == "stage,instruction,frequency,time,energy\n0,forward,1410,0.05,24.1\n"

    out = tmp_path / "stages.csv"
    measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=[1980, 1500])
    text = out.read_text()
    with pytest.raises(InvalidSettingError, match="another run .*seed 0 there, 1 here"):
        measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=[1980], seed=1)
    with pytest.raises(InvalidSettingError, match="another run .*gpu 'h100-sxm' there, 'a40' here"):
        measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=[1740], gpu="a40")
    assert out.read_text() == text

    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("1,backward,1500,"))
    corrupt = tmp_path / "corrupt.csv"
    corrupt.write_text("\n".join(lines[:row] + ["1,backward,1500,-0.001,0.5"] + lines[row + 1:]) + "\n")
    (tmp_path / "corrupt.csv.meta.json").write_text((tmp_path / "stages.csv.meta.json").read_text())
    with pytest.raises(InvalidSettingError, match="is not a valid stage profile .*time '-0.001' is not positive"):
        measure_stage_profile(tiny_pipeline(), out=corrupt, sm_clocks_mhz=[1980, 1500])
    garbled = tmp_path / "garbled.csv"
    garbled.write_text(text)
    meta = (tmp_path / "stages.csv.meta.json").read_text()
    (tmp_path / "garbled.csv.meta.json").write_text(meta[:40])  # the run's JSON cut short
    with pytest.raises(InvalidSettingError, match="is not a stage profile this command wrote"):
        measure_stage_profile(tiny_pipeline(), out=garbled, sm_clocks_mhz=[1980])
    assert garbled.read_text() == text


def test_the_profile_is_a_plain_csv_that_pandas_reads_as_perseus_does(tmp_path):
    """pandas.read_csv(path), as Perseus's planner (lowtime/scripts/perseus.py) loads its instruction profile, reads
    the file as written, and Perseus's per-stage query finds every row; the run's identity is in the sidecar."""
    import json

    pandas = pytest.importorskip("pandas")
    from freqopt.measure.stage_profile import measure_stage_profile, read_run_header, sidecar_path

    out = tmp_path / "stages.csv"
    run = measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=CLOCKS)
    frame = pandas.read_csv(out)
    assert list(frame.columns) == ["stage", "instruction", "frequency", "time", "energy"] and len(frame) == 16
    for stage in range(2):
        for kind in ("forward", "backward"):
            rows = frame.query(f"stage == {stage} and instruction == '{kind}'")  # Perseus's query
            options = run.profile.options[(stage, kind)]
            by_clock = {int(row["frequency"]): (row["time"], row["energy"]) for _, row in rows.iterrows()}
            assert sorted(by_clock) == sorted(CLOCKS)
            assert by_clock == dict(zip(options.sm_clock_mhz.tolist(), zip(options.time_s, options.energy_j)))
    meta = json.loads(sidecar_path(out).read_text())
    assert sidecar_path(out) == tmp_path / "stages.csv.meta.json"
    assert meta["run"] == read_run_header(out) and meta["run"]["seed"] == 0 and meta["run"]["gpu"] == "h100-sxm"
    assert meta["blocking_power_w"] == run.blocking_power_w


def test_a_profile_an_older_version_wrote_resumes_and_gains_a_sidecar(tmp_path):
    """A file with the run's JSON on its first comment line (as older versions wrote it) is still this command's:
    it resumes, and is rewritten as a plain CSV with the sidecar."""
    import json

    from freqopt.measure.stage_profile import measure_stage_profile, sidecar_path

    out = tmp_path / "stages.csv"
    measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=[1980])
    meta = sidecar_path(out)
    header = json.loads(meta.read_text())["run"]
    out.write_text("# freqopt stage-profile run: " + json.dumps(header) + "\n# a note\n" + out.read_text())
    meta.unlink()
    again = measure_stage_profile(tiny_pipeline(), out=out, sm_clocks_mhz=[1980, 1500])
    assert (again.n_measured, again.n_reused) == (4, 4)
    assert out.read_text().startswith("stage,instruction,frequency,time,energy\n")
    assert json.loads(meta.read_text())["run"] == header


def test_the_blocking_power_is_the_gpu_files_waiting_power():
    """Where the GPU file holds Perseus's measured P2P-blocking power (A100 SXM, A40), that is what plan is told."""
    from freqopt.gpu.specs import get_gpu
    from freqopt.measure.stage_profile import blocking_power
    from freqopt.pipeline.profile import MEASURED_BLOCKING_POWER_W

    for name, watts in MEASURED_BLOCKING_POWER_W.items():
        found, source = blocking_power(get_gpu(name))
        assert found == pytest.approx(watts, abs=1e-9) and "[waiting_power] measurement" in source
    found, source = blocking_power(get_gpu("h100-sxm"))  # no measurement in its file: the power model's baseline
    assert 50 < found < 300 and "power-model baseline" in source
    for name in ("b200", "l4", "rtx4090", "l40s"):  # a figure carried from another GPU: not called a measurement
        found, source = blocking_power(get_gpu(name))
        assert found == get_gpu(name).waiting_power.top_clocks_w and "[waiting_power] measurement" not in source, name
        assert "not a measurement of this GPU (carried from" in source, name


@pytest.fixture
def fast_nvml(fake_gpu, monkeypatch):
    """The stand-in NVML's GPU with an energy counter that advances in real time every 10 ms, and the NVML backend
    measuring over short windows (the kernels replay on the CPU)."""
    import freqopt.gpu.backends.nvml as nvml_backend
    from freqopt.gpu.backends.base import MeasurementProtocol

    for g in fake_gpu.gpus:
        g.realtime, g.counter_period_s = True, 0.01
    monkeypatch.setattr(nvml_backend, "COUNTER_DETECTION_S", 0.05)
    monkeypatch.setattr(nvml_backend, "MeasurementProtocol",
                        lambda: MeasurementProtocol(warmup_s=0.02, min_window_s=0.05, min_counter_updates=3))
    return fake_gpu


def test_nvml_read_only_is_refused_before_nvml_is_opened(fast_nvml, tmp_path):
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices
    from freqopt.measure.stage_profile import measure_stage_profile

    out = tmp_path / "stages.csv"
    with pytest.raises(InvalidSettingError, match="read_only cannot measure a stage profile") as e:
        measure_stage_profile(tiny_pipeline(), out=out, backend="nvml", read_only=True)
    assert e.value.argument == "read_only" and fast_nvml.calls == []  # NVML not even opened
    with NVMLBackend(open_devices(read_only=True)[0], torch_device="cpu") as backend:  # a read-only GPU passed in
        with pytest.raises(InvalidSettingError, match="read_only cannot measure a stage profile"):
            measure_stage_profile(tiny_pipeline(), out=out, backend=backend)
    assert fast_nvml.set_calls() == [] and not out.exists()


def test_nvml_locks_each_clock_and_restores_what_it_found(fast_nvml, tmp_path):
    from freqopt.measure.stage_profile import measure_stage_profile

    gpu = fast_nvml.gpus[0]
    assert gpu.power_limit_mw == 650_000 and gpu.locked_sm_mhz is None  # as found: below the 700 W default
    run = measure_stage_profile(tiny_pipeline(), out=tmp_path / "stages.csv", backend="nvml",
                                sm_clocks_mhz=[1980, 1410])
    locks = [c[2] for c in fast_nvml.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
    assert set(locks) == {1980, 1410}
    assert gpu.locked_sm_mhz is None and gpu.power_limit_mw == 650_000  # restored
    assert run.backend == "nvml" and run.gpu == "h100-sxm" and run.n_measured == 8
    for options in run.profile.options.values():
        assert options.sm_clock_mhz.tolist() == [1410, 1980]
        np.testing.assert_allclose(options.energy_j / options.time_s, gpu.power_w, rtol=0.3)  # the board's 400 W

    # Stopped after its first row (Ctrl-C, or an error): the clocks are restored all the same, and nothing written.
    def interrupt(done, total, what):
        if what:
            raise KeyboardInterrupt

    fast_nvml.calls.clear()
    with pytest.raises(KeyboardInterrupt):
        measure_stage_profile(tiny_pipeline(), out=tmp_path / "other.csv", backend="nvml", sm_clocks_mhz=[1200],
                              on_progress=interrupt)  # fmt: skip
    assert any(c[0] == "nvmlDeviceSetGpuLockedClocks" for c in fast_nvml.set_calls())
    assert gpu.locked_sm_mhz is None and gpu.power_limit_mw == 650_000 and not (tmp_path / "other.csv").exists()


@pytest.mark.parametrize("args, message", [
    (["--layout", "pp=1"], "--layout dp=1,tp=1 has no pipeline stages"),
    (["--layout", "pp=2", "--sm-clocks", "1234"], "--sm-clocks 1234 MHz: not supported SM clock(s) of h100-sxm"),
    (["--layout", "pp=2", "--sm-clocks", "fast"], "--sm-clocks must be SM clocks in MHz separated by commas"),
    (["--layout", "pp=2", "--sm-clock-step", "0"], "--sm-clock-step must be a positive integer"),
    (["--layout", "pp=2", "--repeats", "0"], "--repeats must be a positive integer"),
    (["--layout", "pp=2", "--backend", "nvml", "--read-only"], "--read-only cannot measure a stage profile"),
    (["--layout", "pp=2", "--read-only"], "--read-only applies to backend nvml"),
    (["--layout", "pp=2", "--schedule", "2f2b"], "--schedule '2f2b' is unknown"),
    (["--layout", "pp=2", "--partition-method", "even"], "--partition-method 'even' is not one of DeepSpeed's"),
    (["--layout", "pp=2", "--gpu", "h100"], "unknown GPU"),
    (["--layout", "pp=2", "--micro-batches", "0"], "--micro-batches must be a positive integer"),
    (["--layout", "pp=2", "--out", "FOREIGN"], "is not a stage profile this command wrote"),
    (["--layout", "pp=2", "--model", f"hf:{Path(__file__).parent / 'data' / 'hf' / 'llama'}"],
     "a Hugging Face model has no layer list to split yet"),
    (["--layout", "pp=2", "--model", "hf:/no/such/config"], "no Hugging Face config at '/no/such/config'"),
])  # fmt: skip
def test_a_bad_argument_is_refused_before_loading_pytorch(args, message, tmp_path):
    """One line, exit status 2, nothing written, and before the seconds that importing PyTorch takes (checked by
    what was imported, not by timing)."""
    foreign = tmp_path / "foreign.csv"
    foreign.write_text("a,b\n1,2\n")
    args = [str(foreign) if a == "FOREIGN" else a for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "stages.csv")]
    code = ("import sys; from freqopt.cli import main; rc = main(sys.argv[1:]); "
            "print('loaded:', sorted(m for m in ('torch', 'optuna') if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "stage-profile", "--model", "gpt3-small", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "loaded: []" in proc.stdout
    assert not (tmp_path / "stages.csv").exists() and foreign.read_text() == "a,b\n1,2\n"
