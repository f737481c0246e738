import json
import os
import subprocess
import sys

import pytest

from freqopt.cli import main, parse_slowdown
from freqopt.errors import InvalidSettingError
from freqopt.tables import load_table, write_table

# A kernel-level table of gpt3-xl on h100-sxm (experiments/transfer), read by the commands that take one.
TRANSFER_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments", "transfer",
                              "source-kernel-table.json")


@pytest.mark.parametrize("text,value", [("1%", 0.01), ("0.01", 0.01), ("2.5 %", 0.025), ("99%", 0.99)])
def test_parse_slowdown(text, value):
    assert parse_slowdown(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "-5%", "100%", "1", "1.5", "", "5%%", "nan"])
def test_parse_slowdown_refuses(text):
    with pytest.raises(InvalidSettingError, match="max_slowdown"):
        parse_slowdown(text)


@pytest.mark.parametrize("value", ["0", "0%", "0.0 %", 0, 0.0])
def test_a_zero_budget_is_refused_unless_allowed(value):
    """No slower setting fits a zero budget at any confidence: refused in one line naming the argument; a
    pipeline's plan (allow_zero) takes it."""
    with pytest.raises(InvalidSettingError, match=r"^max_slowdown .* must be above 0: .*give a budget like 1%") as e:
        parse_slowdown(value)
    assert e.value.argument == "max_slowdown" and len(str(e.value).splitlines()) == 1
    assert parse_slowdown(value, allow_zero=True) == 0.0


def test_search_refuses_a_zero_budget():
    """freqopt.search (the API) and SearchConfig refuse max_slowdown 0 (the command line's refusal, before PyTorch
    is imported: tests/test_refusals.py)."""
    import freqopt
    from freqopt.search.config import SearchConfig

    with pytest.raises(InvalidSettingError, match=r"^max_slowdown '0%' must be above 0") as e:
        freqopt.search("gpt3-small", max_slowdown="0%")
    assert e.value.argument == "max_slowdown"
    with pytest.raises(InvalidSettingError, match=r"^max_slowdown must be above 0") as e:
        SearchConfig(max_slowdown=0.0)
    assert e.value.argument == "max_slowdown"


BAD = [
    (["--model", "gpt4", "--max-slowdown", "1%"], "unknown model"),
    (["--model", "gpt3-small", "--max-slowdown", "abc"], "not a slowdown"),
    (["--model", "gpt3-small", "--max-slowdown", "-5%"], "negative"),
    (["--model", "gpt3-small", "--max-slowdown", "0%"], "--max-slowdown '0%' must be above 0"),
    (["--model", "gpt3-small", "--max-slowdown", "100%"], "outside"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--gpu", "rtx9090"], "unknown GPU"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--granularity", "layer"], "unknown granularity"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--n-heads", "7"], "does not divide"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--backend", "tpu"], "unknown backend"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--trials", "0"], "--trials must be a positive integer"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--jobs", "0"], "--jobs must be a positive integer"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--granularity", "iteration,layer"], "unknown granularity 'layer'"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--granularity", "all,kernel"], "--granularity 'all' stands alone"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--storage", "foo://bar"], "cannot open Optuna storage"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--storage", "sqlite:////no/such/dir/x.db"],
     "cannot open Optuna storage"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "tp=5"], "does not divide the 12 attention heads"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "dp=two"], "positive integer"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "pp=2"],
     "--micro-batches is required for a pipeline"),
    (["--model", "gpt3-small"], "Missing option"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--bogus"], "No such option"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--switch-latency-ms", "-5"], "'--switch-latency-ms'"),
    (["--model", "gpt3-small", "--max-slowdown", "1%", "--switch-latency-ms", "abc"], "'--switch-latency-ms'"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_is_one_line_nonzero_and_writes_nothing(args, message, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["search", *args, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1 and err.startswith("freqopt: error:") and message in err
    assert not out.exists()  # not even the folder: every argument and the storage are checked before it is made


def test_out_is_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("keep")
    assert main(["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--out", str(blocker)]) == 2
    assert "is a file" in capsys.readouterr().err and blocker.read_text() == "keep"


def test_unwritable_out_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, which no one can create files in")
@pytest.mark.parametrize("command", [
    ["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--json", "/proc/freqopt-x.json"],
    ["statement", "--table", "TABLE", "--out", "/proc/freqopt-s.md"],
])  # fmt: skip
def test_an_unwritable_output_file_fails_before_any_work(command, tmp_path, capsys):
    # Permission bits say yes to root; only creating a file there tells. Nothing is searched, printed or written.
    table = write_table(_statement_table(), tmp_path / "t.json")
    args = [str(table) if a == "TABLE" else a for a in command]
    assert main([*args, *(["--out", str(tmp_path / "o")] if command[0] == "search" else [])]) == 2
    captured = capsys.readouterr()
    assert "cannot write" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == "" and not (tmp_path / "o").exists()


def test_the_results_table_fits_110_columns(small_trace):
    """100 columns before the chosen clocks' column (issue 51, item 2), which took the settings' count's place."""
    import io

    from rich.console import Console

    import freqopt
    from freqopt.cli.search import _search_table

    import dataclasses

    from freqopt.gpu.backends.base import Measurement

    result = freqopt.search(small_trace, max_slowdown="1%", granularity="iteration", n_trials=3)
    # The widest row: a kernel level with its free-switching figures (a rendering test: the row is made up).
    iteration = result.results["iteration"]
    from freqopt.gpu.backends.base import ClockSetting
    from freqopt.search.units import TuningUnit

    (unit, _), = iteration.units
    half = len(unit.kernel_indices) // 2
    units = ((TuningUnit("a", unit.kernel_indices[:half]), ClockSetting(1155, 2619)),
             (TuningUnit("b", unit.kernel_indices[half:]), ClockSetting(1980, 2619)))  # two settings: a summary
    kernel = dataclasses.replace(iteration, granularity="kernel", n_measurements=12345, units=units,
                                 ideal=Measurement(1.1 * result.baseline.time_s, 0.5 * result.baseline.energy_j))
    result = dataclasses.replace(result, results={"iteration": iteration, "kernel": kernel})
    buffer = io.StringIO()
    Console(file=buffer, width=110).print(_search_table(result))
    lines = buffer.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 110 and not any("…" in line for line in lines)
    assert any(line.startswith("│ kernel ") and "50.00 / 10.00" in line and "12345" in line for line in lines)
    assert result.clock_summary("iteration") in "".join(lines)  # one setting: one line
    assert result.clock_summary("kernel").startswith("SM 1155-1980 MHz, 2 settings over 2 kernel classes")
    # The slowdown's mean and upper bound share a cell, at a 10 % budget too.
    bounded = dataclasses.replace(iteration, validated=dataclasses.replace(
        iteration.validated, time_s=1.0987 * result.baseline.time_s, time_upper_s=1.1 * result.baseline.time_s))
    buffer = io.StringIO()
    Console(file=buffer, width=110).print(_search_table(dataclasses.replace(result, results={"iteration": bounded})))
    lines = buffer.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 110 and not any("…" in line for line in lines)
    assert any(line.startswith("│ iteration ") and "9.87, 10.00" in line for line in lines)


def _statement_table():
    from freqopt.tables import SCHEMA_NAME, SCHEMA_VERSION, ClockTable

    return ClockTable({
        "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
        "gpu": {"name": "h100-sxm", "sm_clocks_mhz": [1980], "mem_clocks_mhz": [2619]},
        "workload": {"model": "gpt3-small"}, "granularity": "iteration", "max_slowdown": 0.01,
        "entries": [{"unit": "iteration", "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_limit_w": None}],
        "baseline": {"time_s": 1.0, "energy_j": 10.0}, "predicted": {"time_s": 1.0, "energy_j": 9.0},
        "validated": {"time_s": 1.0, "energy_j": 9.0}, "provenance": {},
    })  # fmt: skip


def test_models_and_gpus_list(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gpt3-175b" in out and "174,604.8 M" in out  # vocabulary padded to 50304
    assert main(["gpus"]) == 0
    assert "h100-sxm (default)" in capsys.readouterr().out


@pytest.mark.slow
def test_search_writes_tables_and_json(tmp_path):
    """The installed console script, end to end, on a small configuration."""
    out_json = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "freqopt.cli", "search", "--model", "gpt3-small", "--seq-len", "256",
           "--micro-batch-size", "1", "--max-slowdown", "2%", "--granularity", "pass", "--trials", "6",
           "--switch-latency-ms", "1", "--out", str(tmp_path), "--json", str(out_json)]  # fmt: skip
    # 1 ms switches: at the H100's 26 ms this short step realizes one clock, and the pass level is not searched.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "default" in proc.stdout and "pass" in proc.stdout
    # Where the tables went, and how to apply one (stderr: the table alone goes to stdout).
    assert f"pass table: {tmp_path / 'gpt3-small-h100-sxm-2pct-pass.json'} (and .csv)" in proc.stdout
    assert "to training with: freqopt train --model gpt3-small --micro-batch-size 1 --seq-len 256 --table" in proc.stderr
    assert "A new study created" not in proc.stderr  # Optuna's log lines only with --verbose
    data = json.loads(out_json.read_text())
    assert set(data) == {"baseline", "results", "n_new_measurements", "host_wait_pct", "max_switches_per_s",
                         "confidence"}
    assert data["confidence"] == 0.95
    assert set(data["baseline"]) == {"time_s", "energy_j"}
    assert data["n_new_measurements"] == sum(r["n_measurements"] for r in data["results"].values())  # baseline's in
    r = data["results"]["pass"]
    assert set(r) == {"energy_saved_pct", "slowdown_pct", "slowdown_bound_pct", "ideal_energy_saved_pct",
                      "ideal_slowdown_pct", "predicted_energy_saved_pct", "n_settings", "n_measurements",
                      "search_cost_gpu_s", "table", "note", "waiting_saved_pct", "saving_pct_waiting_range",
                      "switches_per_s"}  # fmt: skip
    assert r["ideal_slowdown_pct"] <= 2.0  # the pass level's free-switching figure, within the budget too
    assert r["note"] is None and r["n_measurements"] > 0  # searched, so no note says why not
    # Held to the budget on its upper confidence bound, which is never below the mean (a schedule that saves
    # nothing is the defaults, with no bound).
    assert r["energy_saved_pct"] == 0 or r["slowdown_pct"] <= r["slowdown_bound_pct"] <= 2.0
    table = load_table(r["table"])
    assert table.granularity == "pass" and (tmp_path / "freqopt.journal").exists()


@pytest.mark.slow
def test_verbose_lets_optunas_lines_through(tmp_path, capsys, optuna_messages):
    assert main(["search", "--model", "gpt3-small", "--seq-len", "128", "--micro-batch-size", "1", "--max-slowdown",
                 "2%", "--granularity", "iteration", "--trials", "3", "--out", str(tmp_path), "--verbose"]) == 0
    assert any(m.startswith("A new study created in Journal with name: gpt3-small") for m in optuna_messages)


def test_powercap_v100_matches_the_papers_direction(tmp_path, capsys):
    out = tmp_path / "p.json"
    # Micro-batch 32, as McDonald et al.'s BERT: at 8 a step's kernels are short enough that the host (every GPU's
    # step has one: freqopt.gpu.host) sets much of its pace, and a cap slows it less.
    assert main(["powercap", "--model", "bert-base", "--gpu", "v100-pcie", "--seq-len", "128", "--micro-batch-size",
                 "32", "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    rows = [line.strip("│ ").split()[0] for line in printed.splitlines() if line.startswith("│")]
    assert rows == ["250", "100", "150", "200"] and "250 (default)" in printed  # the default limit's row once
    doc = json.loads(out.read_text())
    assert doc["baseline_power_limit_w"] == 250
    assert [c["power_limit_w"] for c in doc["caps"]] == [100, 150, 200, 250]
    assert (doc["caps"][-1]["time_rel"], doc["caps"][-1]["energy_rel"]) == (1.0, 1.0)  # the baseline, not re-measured
    assert set(doc["caps"][0]) == {"power_limit_w", "time_rel", "energy_rel", "avg_power_w", "power_limit_met"}
    assert all(c["power_limit_met"] for c in doc["caps"])
    by_cap = {c["power_limit_w"]: c for c in doc["caps"]}
    assert by_cap[150]["time_rel"] > 1.02 and by_cap[150]["energy_rel"] < 0.95  # capping trades time for energy
    for c in doc["caps"]:  # the limit holds, up to the readings' noise (0.5 % in energy, 0.2 % in time: 3 sigma)
        assert c["avg_power_w"] <= c["power_limit_w"] * 1.016


def test_powercap_host_gap_flattens_the_time_curve(capsys):
    args = ["powercap", "--model", "distilbert", "--gpu", "v100-pcie", "--seq-len", "128", "--caps", "100"]
    rel = []
    for gap in ("0", "50"):
        assert main([*args, "--host-gap-ms", gap]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.strip("│ ").startswith("100 "))
        rel.append(float(row.split("│")[2]))
    assert 1.0 < rel[1] < rel[0]  # idle host time is not slowed by the cap


@pytest.mark.parametrize("args,message", [
    (["--model", "bert-base", "--caps", "50,abc"], "not a list of watts"),
    (["--model", "bert-base", "--gpu", "v100-pcie", "--caps", "50"], "accepts power limits 100-250 W"),
    (["--model", "bert-base", "--mode", "eval"], "not a mode"),
    (["--model", "bert-xxl"], "unknown model"),
    (["--model", "bert-base", "--host-gap-ms", "-5"], "must not be negative"),
])  # fmt: skip
def test_powercap_bad_input(args, message, capsys):
    assert main(["powercap", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.slow
def test_models_per_gpu_parameters_under_a_layout(capsys):
    assert main(["models", "--layout", "tp=4"]) == 0
    out = capsys.readouterr().out
    assert "parameters per GPU (dp=1,tp=4)" in out and "tp must divide 12 heads" not in out
    assert "gpt3-175b" in out


def test_powercap_runs_a_parallel_layout(tmp_path):
    out = tmp_path / "p.json"
    assert main(["powercap", "--model", "gpt3-small", "--layout", "dp=2,tp=2", "--seq-len", "256",
                 "--micro-batch-size", "1", "--caps", "400,700", "--json", str(out)]) == 0  # fmt: skip
    assert [c["power_limit_w"] for c in json.loads(out.read_text())["caps"]] == [400, 700]


def test_a_bad_storage_leaves_no_out_folder_in_transfer_either(tmp_path, capsys):
    table = write_table(_statement_table(), tmp_path / "t.json")
    out = tmp_path / "deep" / "out"
    assert main(["transfer", "--table", str(table), "--model", "gpt3-small", "--seq-len", "128", "--micro-batch-size",
                 "1", "--storage", "bogus://x", "--out", str(out)]) == 2  # fmt: skip
    assert "cannot open Optuna storage 'bogus://x'" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists()


# What a user types, and how the error must begin: the flag, never the library's argument name.
FLAG_ERRORS = [
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--trials", "0"], "--trials must be"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--jobs", "0"], "--jobs must be"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--jobs", "2", "--backend", "nvml"], "--jobs > 1"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "200%"], "--max-slowdown '200%' is outside"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--micro-batch-size", "0"], "--micro-batch-size must"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--seq-len", "0"], "--seq-len must be"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--n-heads", "7"], "--n-heads 7 does not divide"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--vocab-multiple", "0"], "--vocab-multiple must"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--layout", "dp=0"], "--layout 'dp=0': dp must"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--out", "FILE"], "--out FILE is a file"),
    (["worker", "--storage", "sqlite:///DIR/w.db", "--study", "s", "--wait-s", "-1"], "--wait-s must not be negative"),
    (["benchmark", "--model", "gpt3-small", "--repeats", "0"], "--repeats must be"),
    (["benchmark", "--model", "gpt3-small", "--granularity", "phase"], "--granularity 'phase'"),
    (["powercap", "--model", "gpt3-small", "--caps", "0"], "--caps '0' is not a list of watts"),
    (["powercap", "--model", "gpt3-small", "--mode", "eval"], "--mode 'eval' is not a mode"),
    (["powercap", "--model", "gpt3-small", "--host-gap-ms", "-1"], "--host-gap-ms must not be negative"),
    (["train", "--model", "gpt3-small", "--steps", "0"], "--steps must be"),
    (["train", "--model", "gpt3-small", "--compare"], "--compare needs a table"),
    (["profile", "--model", "gpt3-small", "--steps", "0"], "--steps must be"),
    (["profile", "--model", "gpt3-small", "--device", "cpu"], "--device applies to backend nvml"),
    (["models", "gpt3-small", "--seq-len", "0"], "--seq-len must be"),
    (["statement", "--table", "TABLE", "--iterations", "0"], "--iterations must be"),
    (["statement", "--table", "TABLE", "--gpus", "0"], "--gpus must be"),
    (["statement", "--table", "TABLE", "--pue", "0.5"], "--pue 0.5 is below 1"),
    (["statement", "--table", "TABLE", "--grid-gco2-per-kwh", "-1"], "--grid-gco2-per-kwh must not be negative"),
]  # fmt: skip


@pytest.mark.parametrize("args,start", FLAG_ERRORS)
def test_errors_name_the_flag_the_user_typed(args, start, tmp_path, capsys):
    from freqopt.cli import FLAGS

    blocker = tmp_path / "FILE"
    blocker.write_text("")
    table = write_table(_statement_table(), tmp_path / "t.json")
    swap = {"FILE": str(blocker), "TABLE": str(table), "sqlite:///DIR/w.db": f"sqlite:///{tmp_path / 'w.db'}"}
    assert main([swap.get(a, a) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("freqopt: error: " + start.replace("FILE", str(blocker))), err
    assert len(err.splitlines()) == 1
    assert not any(name in err for name in FLAGS if "_" in name)  # n_trials, wait_s, ...: the library's names


def test_the_flags_table_names_options_the_commands_have():
    from freqopt.cli import FLAGS, cli

    options = {opt for command in cli.commands.values() for param in command.params for opt in param.opts}
    assert set(FLAGS.values()) <= options
    with pytest.raises(ValueError, match="must begin with that name"):
        InvalidSettingError("must be positive", argument="n_trials")  # the CLI could not put its flag in place


def test_help_lists_every_command_with_its_whole_line(capsys, monkeypatch):
    from freqopt.cli import cli

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["--help"]) == 0
    rows = capsys.readouterr().out.split("Commands:\n")[1].splitlines()
    assert len(rows) == len(cli.commands)
    for row, (name, command) in zip(rows, sorted(cli.commands.items())):
        assert row.split() == [name, *command.short_help.split()] and len(row) <= 80
        assert row.endswith(".") and "..." not in row
    assert any(row.split()[1:] == "Write an energy statement (McDonald et al. 2022).".split() for row in rows)


def _hint(err: str) -> list[str]:
    """The arguments of the `freqopt train ...` line a search prints last."""
    line = next(line for line in err.splitlines() if "to training with: freqopt train " in line)
    return line.split("to training with: freqopt ")[1].split()


@pytest.mark.slow
def test_a_resumed_search_says_so_and_its_hint_works_from_another_folder(tmp_path, monkeypatch, capsys):
    """A relative hf:PATH and --out: the closing hint names both absolutely, and `freqopt train` takes it as
    printed in another folder. Run again, the search says how many measurements it read back (the first run's),
    and a comma list of granularities searches those, coarse to fine."""
    import shutil
    from pathlib import Path

    here = tmp_path / "here"
    (here / "cfg").mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "data" / "hf" / "llama" / "config.json", here / "cfg" / "config.json")
    monkeypatch.chdir(here)
    args = ["search", "--model", "hf:cfg", "--seq-len", "64", "--micro-batch-size", "1", "--max-slowdown", "2%",
            "--granularity", "pass,iteration", "--trials", "3", "--out", "out"]  # fmt: skip
    assert main([*args, "--json", "first.json"]) == 0
    err = capsys.readouterr().err
    assert not any(line.startswith("resumed") for line in err.splitlines())  # a fresh search says nothing of it
    first = json.loads((here / "first.json").read_text())
    assert list(first["results"]) == ["iteration", "pass"]
    hint = _hint(err)
    assert hint[hint.index("--model") + 1] == f"hf:{here / 'cfg'}"
    assert hint[hint.index("--table") + 1] == str(here / "out" / "hf-cfg-h100-sxm-2pct-iteration.json")

    assert main([*args, "--json", "second.json"]) == 0
    err = capsys.readouterr().err
    storage = f"journal:{here / 'out' / 'freqopt.journal'}"
    assert f"resumed: {first['n_new_measurements']} measurements read back from {storage}, 0 new" in err
    assert json.loads((here / "second.json").read_text())["n_new_measurements"] == 0

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([*hint, "--steps", "1"]) == 0
    assert "table" in capsys.readouterr().out


def test_hints_make_relative_storages_absolute(tmp_path, monkeypatch):
    from freqopt.cli import absolute_storage

    monkeypatch.chdir(tmp_path)
    assert absolute_storage("sqlite:///s.db") == f"sqlite:///{tmp_path / 's.db'}"
    assert absolute_storage("sqlite:///s.db?timeout=5") == f"sqlite:///{tmp_path / 's.db'}?timeout=5"
    assert absolute_storage("journal:j.log") == f"journal:{tmp_path / 'j.log'}"
    for kept in ("sqlite:////abs/s.db", "sqlite://", "journal:/abs/j.log", "postgresql+psycopg2://u@h/db", None):
        assert absolute_storage(kept) == kept


def test_clocks_print_and_are_written_as_integers(tmp_path, capsys):
    """On a GPU whose SM clocks are counted in 7.5 MHz steps (V100), a search's table (JSON and CSV) and what the
    command prints carry integer clocks, never 884.9999999999999."""
    assert main(["search", "--model", "gpt3-small", "--gpu", "v100-sxm2", "--seq-len", "128", "--micro-batch-size",
                 "1", "--max-slowdown", "10%", "--granularity", "iteration", "--trials", "4", "--out",
                 str(tmp_path)]) == 0  # fmt: skip
    printed = capsys.readouterr()
    data = json.loads((tmp_path / "gpt3-small-v100-sxm2-10pct-iteration.json").read_text())
    entry = data["entries"][0]
    clocks = [entry["sm_clock_mhz"], entry["default"]["sm_clock_mhz"], *(o["sm_clock_mhz"] for o in entry["front"]),
              *data["gpu"]["sm_clocks_mhz"]]  # fmt: skip
    assert entry["sm_clock_mhz"] is not None and all(type(c) is int for c in clocks if c is not None)
    assert 1372 in data["gpu"]["sm_clocks_mhz"] and 1365 in data["gpu"]["sm_clocks_mhz"]  # 1380 - 7.5, - 15
    row = (tmp_path / "gpt3-small-v100-sxm2-10pct-iteration.csv").read_text().splitlines()[1].split(",")
    assert row[4] == str(entry["sm_clock_mhz"]) and row[4].isdigit()
    assert ".9999" not in printed.out + printed.err
    assert main(["gpus"]) == 0
    assert "135-1530 (187)" in capsys.readouterr().out  # v100-sxm2's SM clocks, as integers


def test_search_reports_the_switch_latency_it_was_given(tmp_path, capsys):
    """--switch-latency-ms replaces the GPU file's latency, and the results table says which one was used."""
    assert main(["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--granularity", "iteration", "--trials",
                 "2", "--seq-len", "128", "--micro-batch-size", "1", "--switch-latency-ms", "250", "--out",
                 str(tmp_path / "o")]) == 0  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert "clock switches taking 250 ms" in out


@pytest.mark.parametrize("command", [["train", "--model", "gpt3-small"],
                                     ["transfer", "--table", "t.json", "--model", "gpt3-small"]])
def test_train_and_transfer_refuse_a_negative_switch_latency(command, capsys):
    assert main([*command, "--switch-latency-ms", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'--switch-latency-ms'" in err


@pytest.mark.parametrize("args, message", [
    (["search", "--model", "nope", "--max-slowdown", "1%"], "unknown model 'nope'"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "abc"], "--max-slowdown"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--gpu", "nope"], "unknown GPU"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--granularity", "foo"], "unknown granularity"),
    (["search", "--model", "gpt3-small", "--max-slowdown", "1%", "--trials", "0"], "--trials must be"),
    (["train", "--model", "nope"], "unknown model 'nope'"),
    (["train", "--model", "gpt3-small", "--gpu", "nope"], "unknown GPU 'nope'"),
    (["profile", "--model", "nope"], "unknown model 'nope'"),
    (["profile", "--model", "gpt3-small", "--gpu", "nope"], "unknown GPU 'nope'"),
    (["transfer", "--model", "nope", "--table", "x.json"], "unknown model 'nope'"),
    # Issue 38, item 4: train's, profile's and transfer's other arguments that need no model built.
    (["train", "--model", "gpt3-small", "--steps", "0"], "--steps must be a positive integer, not 0"),
    (["train", "--model", "gpt3-small", "--seq-len", "0"], "--seq-len must be a positive integer"),
    (["train", "--model", "gpt3-small", "--layout", "dp=x"], "--layout 'dp=x': dp must be a positive integer"),
    (["train", "--model", "gpt3-small", "--backend", "nope"], "unknown backend 'nope'"),
    (["train", "--model", "gpt3-small", "--compare"], "--compare needs a table"),
    (["train", "--model", "gpt3-small", "--table", "no-such-table.json"], "cannot read clock table no-such-table.json"),
    (["train", "--model", "gpt3-small", "--table", TRANSFER_TABLE, "--read-only"], "--read-only cannot apply a table"),
    (["train", "--model", "gpt3-small", "--layout", "dp=2", "--micro-batches", "4"],
     "--micro-batches applies to a pipeline layout"),
    (["profile", "--model", "gpt3-small", "--steps", "0"], "--steps must be a positive integer, not 0"),
    (["profile", "--model", "gpt3-small", "--micro-batch-size", "0"], "--micro-batch-size must be a positive integer"),
    (["profile", "--model", "gpt3-small", "--layout", "pp=2"], "the profile does not handle pipelines"),
    (["profile", "--model", "gpt3-small", "--backend", "nope"], "unknown backend 'nope'"),
    (["profile", "--model", "gpt3-small", "--device", "cpu"], "--device applies to backend nvml"),
    (["profile", "--model", "gpt3-small", "--sm-clock", "5"], "h100-sxm does not support SM 5 MHz"),
    (["profile", "--model", "gpt3-small", "--backend", "nvml", "--power-limit", "300"],
     "--power-limit applies to the simulated GPU"),
    (["transfer", "--model", "gpt3-small", "--table", "no-such-table.json"], "cannot read clock table"),
    (["transfer", "--model", "gpt3-small", "--table", TRANSFER_TABLE, "--max-slowdown", "abc"],
     "--max-slowdown 'abc' is not a slowdown"),
    (["transfer", "--model", "gpt3-small", "--table", TRANSFER_TABLE, "--max-slowdown", "-5%"],
     "--max-slowdown '-5%' is negative"),
    (["transfer", "--model", "gpt3-small", "--table", TRANSFER_TABLE, "--trials", "0"], "--trials must be"),
    (["transfer", "--model", "gpt3-small", "--table", TRANSFER_TABLE, "--gpu", "a100-sxm4-80gb"],
     "was searched on h100-sxm, not a100-sxm4-80gb"),
    (["transfer", "--model", "gpt3-small", "--table", TRANSFER_TABLE, "--backend", "nope"], "unknown backend"),
    (["transfer", "--model", "gpt3-small", "--table", TRANSFER_TABLE, "--layout", "dp=0"], "--layout 'dp=0'"),
])  # fmt: skip
def test_a_search_refuses_a_bad_argument_before_loading_pytorch_or_optuna(args, message):
    """Issue 38, item 4: a bad argument of the main job (and a mistyped model or GPU name of train, profile and
    transfer) is refused in one line before the seconds that importing PyTorch and Optuna take (checked by what was
    imported, not by timing, which is flaky on a shared machine)."""
    code = ("import sys; from freqopt.cli import main; rc = main(sys.argv[1:]); "
            "print('loaded:', sorted(m for m in ('torch', 'optuna') if m in sys.modules)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "loaded: []" in proc.stdout


def test_powercap_says_where_a_limit_below_the_lowest_clocks_power_is_not_met(tmp_path, capsys):
    """Issue 56, item 2: a limit that even the lowest SM clock cannot hold runs there, above it, and is reported."""
    import re

    from freqopt.gpu.specs import search_spaces_dir

    text = (search_spaces_dir() / "h100-sxm.toml").read_text()
    own = tmp_path / "h100-low-limit.toml"  # the H100 with NVML's lowest limit lowered, so a 20 W cap can be asked
    own.write_text(re.sub(r"power_limit_min_w = \d+", "power_limit_min_w = 10", text, count=1))
    out = tmp_path / "p.json"
    assert main(["powercap", "--model", "gpt3-small", "--micro-batch-size", "1", "--seq-len", "512", "--gpu", str(own),
                 "--caps", "20,700", "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "20 (not met)" in printed and "not met: at 20 W" in printed
    by_cap = {c["power_limit_w"]: c for c in json.loads(out.read_text())["caps"]}
    assert by_cap[20]["power_limit_met"] is False and by_cap[20]["avg_power_w"] > 20
    assert by_cap[700]["power_limit_met"] is True
