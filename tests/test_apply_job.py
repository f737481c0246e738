"""freqopt apply (freqopt.apply.job): a job-level table's setting held on the stand-in NVML (tests/fake_pynvml.py)
while a command runs, and restored when it exits, when freqopt apply gets SIGTERM, and by freqopt reset after a
SIGKILL; tables whose schedule switches clocks refused; the equivalent nvidia-smi lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fake_pynvml import FakeGPU, FakeNVML
from freqopt.apply.job import apply_table, job_setting, nvidia_smi_lines
from freqopt.cli import main
from freqopt.errors import ClockTableError, GPUPermissionError, InvalidSettingError
from freqopt.gpu.backends.base import ClockSetting
from freqopt.gpu.specs import get_gpu
from freqopt.tables import SCHEMA_NAME, SCHEMA_VERSION, ClockTable, load_table

TESTS = Path(__file__).parent


def table_file(path: Path, granularity: str, settings: list[tuple], gpu: str = "h100-sxm") -> Path:
    """A clock table of ``gpu`` with one entry per (sm_clock_mhz, mem_clock_mhz, power_limit_w) of ``settings``."""
    spec = get_gpu(gpu)
    units = ["iteration"] if len(settings) == 1 else [f"unit{i}" for i in range(len(settings))]
    figures = {"time_s": 0.03, "energy_j": 10.0}
    doc = {"schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
           "gpu": {"name": spec.name, "sm_clocks_mhz": list(spec.sm_clocks_mhz),
                   "mem_clocks_mhz": list(spec.mem_clocks_mhz), "power_limit_default_w": spec.power_limit_default_w},
           "workload": {"model": "gpt3-small", "n_layers": 12, "d_model": 768, "n_heads": 12, "seq_len": 16,
                        "micro_batch_size": 1, "layout": {"dp": 1, "tp": 1}},
           "granularity": granularity, "max_slowdown": 0.05,
           "entries": [{"unit": u, "sm_clock_mhz": sm, "mem_clock_mhz": mem, "power_limit_w": pl}
                       for u, (sm, mem, pl) in zip(units, settings)],
           "baseline": figures, "predicted": figures, "validated": figures, "provenance": {}}  # fmt: skip
    path.write_text(json.dumps(doc))
    return path


# A command that writes what the stand-in GPU holds while it runs (the stand-in's state file, rewritten after every
# set call) and its pid to OBSERVED, then exits with CODE, or (CODE "wait") waits for a signal: SIGTERM makes it
# write TERMINATED and exit with status 7.
COMMAND = textwrap.dedent("""
    import json, os, signal, sys, time
    gpu_file, observed, code = sys.argv[1:4]
    def on_term(signum, frame):
        open(observed + ".terminated", "w").write("SIGTERM")
        sys.exit(7)
    signal.signal(signal.SIGTERM, on_term)
    gpus = json.load(open(gpu_file))["gpus"]
    held = [{k: g[k] for k in ("power_limit_mw", "locked_sm_mhz", "locked_mem_mhz")} for g in gpus]
    partial = observed + ".partial"
    open(partial, "w").write(json.dumps({"pid": os.getpid(), "gpus": held}))
    os.replace(partial, observed)
    if code == "wait":
        time.sleep(120)
    sys.exit(int(code))
""")


@pytest.fixture
def command(tmp_path):
    script = tmp_path / "command.py"
    script.write_text(COMMAND)

    def make(gpu_file: Path, code: str) -> list[str]:
        return [sys.executable, str(script), str(gpu_file), str(tmp_path / "observed.json"), code]

    return make


def held(tmp_path) -> list[dict]:
    return json.loads((tmp_path / "observed.json").read_text())["gpus"]


def gpu_state(gpu_file: Path, i: int = 0) -> tuple:
    g = json.loads(gpu_file.read_text())["gpus"][i]
    return g["power_limit_mw"], g["locked_sm_mhz"], g["locked_mem_mhz"]


@pytest.fixture
def persisted(fake_gpu, tmp_path):
    """The fixture's stand-in NVML (one H100 at 650 W, root) saved to gpu.json after every set call."""
    fake_gpu.persist = str(tmp_path / "gpu.json")
    fake_gpu.save()
    return fake_gpu, tmp_path / "gpu.json"


# -- which tables hold one setting --------------------------------------------------------------------------------
def test_a_power_cap_an_iteration_and_a_one_setting_pass_table_each_hold_one_setting(tmp_path):
    cap = load_table(table_file(tmp_path / "cap.json", "power-cap", [(None, None, 650.0)]))
    iteration = load_table(table_file(tmp_path / "it.json", "iteration", [(1920, 2619, None)]))
    passes = load_table(table_file(tmp_path / "pass.json", "pass", [(1500, 2619, None)] * 3))
    assert job_setting(cap) == ClockSetting(None, None, 650.0)
    assert job_setting(iteration) == ClockSetting(1920, 2619, None)
    assert job_setting(passes) == ClockSetting(1500, 2619, None)


def test_a_table_whose_schedule_switches_clocks_is_refused_in_one_line(fake_gpu, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = table_file(tmp_path / "kernel.json", "kernel", [(1500, 2619, None), (1980, 2619, None), (1500, 2619, None)])
    with pytest.raises(ClockTableError, match="switches between 2 settings") as e:
        job_setting(load_table(path))
    assert "freqopt.DVFSRuntime" in str(e.value) and "freqopt train --table" in str(e.value)
    for args in (["apply", str(path), "--", sys.executable, "-c", "open('ran', 'w')"], ["apply", str(path), "--print"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "freqopt apply holds one setting for the whole job" in err
    assert fake_gpu.calls == [] and not Path("ran").exists()  # refused before NVML was opened


# -- the nvidia-smi lines -----------------------------------------------------------------------------------------
def test_nvidia_smi_lines_give_the_setting_and_its_undo(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cap = load_table(table_file(tmp_path / "cap.json", "power-cap", [(None, None, 650.0)]))
    assert nvidia_smi_lines(cap, [0]) == ["nvidia-smi -i 0 -pl 650",
                                          "nvidia-smi -i 0 -rgc  # SM clock unlocked: the table keeps the GPU's own"]
    # The H100 locks its memory clock per job only: at its highest clock no line, at another a deferred lock.
    top = load_table(table_file(tmp_path / "it.json", "iteration", [(1920, 2619, None)]))
    assert nvidia_smi_lines(top, "0,1")[:2] == ["nvidia-smi -i 0 -pl 700  # the default limit, which the table keeps",
                                                "nvidia-smi -i 0 -lgc 1920,1920"]  # fmt: skip
    assert len(nvidia_smi_lines(top, "0,1")) == 4 and nvidia_smi_lines(top, "0,1")[2].startswith("nvidia-smi -i 1 ")
    low = load_table(table_file(tmp_path / "low.json", "iteration", [(1410, 1593, None)]))
    assert nvidia_smi_lines(low, [0])[2].startswith("nvidia-smi -i 0 --lock-memory-clocks-deferred=1593  # ")
    # A GPU that locks its memory clock at run time takes -lmc; every visible GPU is the lines without -i.
    rtx = get_gpu("rtx4090")
    mem = rtx.mem_clocks_mhz[-2]
    sm = max(f for f in rtx.sm_clocks_mhz if rtx.supports(f, mem))
    lmc = load_table(table_file(tmp_path / "rtx.json", "iteration", [(sm, mem, 300.0)], gpu="rtx4090"))
    assert nvidia_smi_lines(lmc) == ["nvidia-smi -pl 300", f"nvidia-smi -lgc {sm},{sm}", f"nvidia-smi -lmc {mem},{mem}"]
    assert nvidia_smi_lines(lmc, undo=True) == [
        "nvidia-smi -rgc", "nvidia-smi -rmc",
        f"nvidia-smi -pl {rtx.power_limit_default_w:g}  # rtx4090's default limit; put back the one it had, if another"]
    # Under CUDA_VISIBLE_DEVICES a GPU is named as the variable names it (nvidia-smi -i takes indices and UUIDs).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abcd")
    assert [line.split()[2] for line in nvidia_smi_lines(cap, [1])] == ["GPU-abcd", "GPU-abcd"]
    with pytest.raises(InvalidSettingError, match="^gpu_indices 2 is not a visible GPU"):
        nvidia_smi_lines(cap, [2])


def test_cli_print_changes_nothing(fake_gpu, tmp_path, capsys):
    path = table_file(tmp_path / "cap.json", "power-cap", [(None, None, 650.0)])
    assert main(["apply", str(path), "--gpus", "0", "--print"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "nvidia-smi -i 0 -pl 650" and "# to undo:" in out and out[-1].startswith("nvidia-smi -i 0 -pl 700")
    assert fake_gpu.calls == []


# -- held while the command runs, restored after ------------------------------------------------------------------
def test_the_setting_is_held_while_the_command_runs_and_restored_on_exit(persisted, command, tmp_path, capsys):
    fake, gpu_file = persisted
    path = table_file(tmp_path / "it.json", "iteration", [(1920, 2619, None)])
    code = main(["apply", str(path), "--gpus", "0", "--", *command(gpu_file, "3")])
    assert code == 3  # the command's exit status
    assert held(tmp_path) == [{"power_limit_mw": 700_000, "locked_sm_mhz": 1920, "locked_mem_mhz": None}]
    assert (fake.gpus[0].power_limit_mw, fake.gpus[0].locked_sm_mhz) == (650_000, None)  # as found
    assert not list((tmp_path / "state").glob("*.json"))
    err = capsys.readouterr().err
    assert "GPU 0 (NVIDIA H100 80GB HBM3): SM 1920 MHz, mem 2619 MHz held while the command runs" in err
    assert "GPU 0 restored" in err


def test_a_power_cap_is_held_and_restored(persisted, command, tmp_path):
    fake, gpu_file = persisted
    path = table_file(tmp_path / "cap.json", "power-cap", [(None, None, 300.0)])
    assert apply_table(path, command(gpu_file, "0")) == 0
    assert held(tmp_path)[0]["power_limit_mw"] == 300_000 and held(tmp_path)[0]["locked_sm_mhz"] is None
    assert fake.gpus[0].power_limit_mw == 650_000
    assert ("nvmlDeviceSetPowerManagementLimit", 0, 300_000) in fake.set_calls()


def test_a_memory_clock_is_locked_where_the_gpu_locks_it_at_run_time(fake_gpu, command, tmp_path):
    fake_gpu.gpus = [FakeGPU(uuid="GPU-mem", mem_clocks_mhz=(1593, 2619), mem_clock_lock="runtime")]
    fake_gpu.persist = str(tmp_path / "gpu.json")
    fake_gpu.save()
    path = table_file(tmp_path / "low.json", "iteration", [(1410, 1593, None)])
    assert apply_table(path, command(tmp_path / "gpu.json", "0")) == 0
    assert held(tmp_path)[0] == {"power_limit_mw": 700_000, "locked_sm_mhz": 1410, "locked_mem_mhz": 1593}
    assert (fake_gpu.gpus[0].locked_sm_mhz, fake_gpu.gpus[0].locked_mem_mhz) == (None, None)


def test_only_the_gpus_asked_for_are_set(fake_gpu, command, tmp_path):
    fake_gpu.gpus = [FakeGPU(uuid="GPU-a"), FakeGPU(uuid="GPU-b")]
    fake_gpu.persist = str(tmp_path / "gpu.json")
    fake_gpu.save()
    path = table_file(tmp_path / "it.json", "iteration", [(1500, 2619, 400.0)])
    assert apply_table(path, command(tmp_path / "gpu.json", "0"), gpu_indices="1") == 0
    assert [g["locked_sm_mhz"] for g in held(tmp_path)] == [None, 1500]
    assert [g["power_limit_mw"] for g in held(tmp_path)] == [700_000, 400_000]
    assert {c[1] for c in fake_gpu.set_calls()} == {1}  # GPU 0 never touched
    assert fake_gpu.gpus[1].locked_sm_mhz is None and fake_gpu.gpus[1].power_limit_mw == 700_000
    with pytest.raises(InvalidSettingError, match="^gpu_indices 2 is not a visible GPU"):
        apply_table(path, command(tmp_path / "gpu.json", "0"), gpu_indices=[2])
    with pytest.raises(InvalidSettingError, match="^gpu_indices is empty"):
        apply_table(path, command(tmp_path / "gpu.json", "0"), gpu_indices="none")


# -- refused before the command runs, the GPU left as found -------------------------------------------------------
def test_refusals_leave_the_gpu_as_found_and_run_no_command(fake_gpu, command, tmp_path):
    gpu_file = tmp_path / "gpu.json"
    fake_gpu.gpus = [FakeGPU(uuid="GPU-x", mem_clocks_mhz=(1593, 2619), power_limit_mw=650_000)]  # Hopper: per job
    # A memory clock the H100 cannot take while a job runs: its command names the deferred lock.
    low = table_file(tmp_path / "low.json", "iteration", [(1410, 1593, None)])
    with pytest.raises(ClockTableError, match="locks its memory clock only per job") as e:
        apply_table(low, command(gpu_file, "0"))
    assert "nvidia-smi -i GPU-x --lock-memory-clocks-deferred=1593" in str(e.value)
    # Another GPU type's table.
    other = table_file(tmp_path / "a100.json", "power-cap", [(None, None, 300.0)], gpu="a100-sxm4-40gb")
    with pytest.raises(ClockTableError, match="searched on a100-sxm4-40gb, not h100-sxm"):
        apply_table(other, command(gpu_file, "0"))
    # No permission: said plainly.
    fake_gpu.root = False
    with pytest.raises(GPUPermissionError, match="no permission"):
        apply_table(table_file(tmp_path / "cap.json", "power-cap", [(None, None, 300.0)]), command(gpu_file, "0"))
    with pytest.raises(InvalidSettingError, match="^command 'no-such-program-xyz' is not an executable"):
        apply_table(low, ["no-such-program-xyz"])
    g = fake_gpu.gpus[0]
    assert (g.power_limit_mw, g.locked_sm_mhz, g.locked_mem_mhz) == (650_000, None, None)
    assert not (tmp_path / "observed.json").exists()
    assert not list((tmp_path / "state").glob("*.json"))


# -- SIGTERM and SIGKILL to freqopt apply, in a process of its own -----------------------------------------------
APPLY = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from fake_pynvml import FakeNVML
    sys.modules["pynvml"] = FakeNVML.load({gpu_file!r}, persist={gpu_file!r}).module()
    from freqopt.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _freqopt(tmp_path, gpu_file: Path, args: list[str], **kwargs):
    script = APPLY.format(tests=str(TESTS), gpu_file=str(gpu_file))
    env = {**os.environ, "FREQOPT_STATE_DIR": str(tmp_path / "state")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return [sys.executable, "-c", script, *args], env


def _start_apply(tmp_path, command) -> tuple[subprocess.Popen, Path]:
    """freqopt apply of an iteration table (SM 1005 MHz, 400 W) around a command that waits, started once the
    command runs with the setting held."""
    gpu_file = tmp_path / "gpu.json"
    FakeNVML(gpus=[FakeGPU(uuid="GPU-apply", power_limit_mw=600_000)], root=True).save(gpu_file)
    path = table_file(tmp_path / "it.json", "iteration", [(1005, 2619, 400.0)])
    argv, env = _freqopt(tmp_path, gpu_file, ["apply", str(path), "--", *command(gpu_file, "wait")])
    child = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while not (tmp_path / "observed.json").exists():
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.1)
    except BaseException:
        child.kill()
        child.wait()
        raise
    assert held(tmp_path) == [{"power_limit_mw": 400_000, "locked_sm_mhz": 1005, "locked_mem_mhz": None}]
    assert gpu_state(gpu_file) == (400_000, 1005, None)
    return child, gpu_file


def test_sigterm_to_freqopt_apply_reaches_the_command_then_restores(tmp_path, command):
    child, gpu_file = _start_apply(tmp_path, command)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 7  # the command's own exit status, after its SIGTERM handler ran
    assert (tmp_path / "observed.json.terminated").read_text() == "SIGTERM"
    assert gpu_state(gpu_file) == (600_000, None, None)
    assert not list((tmp_path / "state").glob("*.json"))
    assert "GPU 0 restored" in child.stderr.read()


def test_freqopt_reset_restores_after_sigkill_of_freqopt_apply(tmp_path, command):
    child, gpu_file = _start_apply(tmp_path, command)
    command_pid = json.loads((tmp_path / "observed.json").read_text())["pid"]
    child.kill()  # SIGKILL: no handler runs
    child.wait(timeout=60)
    os.kill(command_pid, signal.SIGKILL)  # the command outlives freqopt; end it here
    assert gpu_state(gpu_file) == (400_000, 1005, None)  # left changed
    assert len(list((tmp_path / "state").glob("*.json"))) == 1
    argv, env = _freqopt(tmp_path, gpu_file, ["reset"])
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "GPU-apply: restored: power limit 600 W" in done.stdout, done.stderr
    assert gpu_state(gpu_file) == (600_000, None, None)
    assert not list((tmp_path / "state").glob("*.json"))


def test_the_table_may_be_passed_loaded(persisted, command, tmp_path):
    fake, gpu_file = persisted
    table = load_table(table_file(tmp_path / "it.json", "iteration", [(1800, 2619, None)]))
    assert isinstance(table, ClockTable)
    assert apply_table(table, command(gpu_file, "0")) == 0
    assert held(tmp_path)[0]["locked_sm_mhz"] == 1800 and fake.gpus[0].locked_sm_mhz is None
