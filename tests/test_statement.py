import json

import pytest

from freqopt.cli import main
from freqopt.errors import InvalidSettingError
from freqopt.apply.statement import DEFAULT_PUE, PueProfile, energy_statement, load_pue_profile
from freqopt.tables import SCHEMA_NAME, SCHEMA_VERSION, load_table


@pytest.fixture
def table_path(tmp_path):
    """A minimal valid clock table: 10 J and 1 s per iteration by default, 8 J and 1.01 s with the table."""
    data = {
        "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
        "gpu": {"name": "h100-sxm", "sm_clocks_mhz": [1980], "mem_clocks_mhz": [2619]},
        "workload": {"model": "gpt3-small", "micro_batch_size": 4, "seq_len": 2048},
        "granularity": "kernel", "max_slowdown": 0.01,
        "entries": [{"unit": "u", "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "power_limit_w": None}],
        "baseline": {"time_s": 1.0, "energy_j": 10.0},
        "predicted": {"time_s": 1.0, "energy_j": 8.0},
        "validated": {"time_s": 1.01, "energy_j": 8.0},
        "provenance": {"freqopt_version": "test", "backend": "sim"},
    }  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    return path


def test_energy_and_emissions_follow_from_the_table(table_path):
    table = load_table(table_path)
    text = energy_statement(table, iterations=360_000, gpus=2, pue=1.5, grid_gco2_per_kwh=500)
    # default: 10 J x 360,000 x 2 = 7.2 MJ = 2 kWh GPU, 3 kWh facility, 1.5 kg CO2e; tuned: 1.6 kWh.
    assert "| default clocks | 100.00 | 2.000 | 3.000 | 1.500 |" in text
    assert "| with the kernel-level table | 101.00 | 1.600 | 2.400 | 1.200 |" in text
    assert "saved 0.400 kWh of GPU energy (20.0 %)" in text


def test_default_pue_is_named(table_path):
    assert f"PUE: {DEFAULT_PUE:g} (industry average" in energy_statement(load_table(table_path), iterations=10)


def test_hourly_profile_finds_the_night(tmp_path, table_path):
    csv_path = tmp_path / "p.csv"
    csv_path.write_text("hour,pue\n" + "".join(f"{h},{1.1 if h < 6 else 1.4}\n" for h in range(24)))
    profile = load_pue_profile(csv_path)
    assert profile.period == "hour" and profile.values[0] == 1.1
    text = energy_statement(load_table(table_path), iterations=3600, profile=profile)  # a 1.01 h run
    saving = 100 * (1 - 1.1 / 1.4)
    assert f"({saving:.1f} %) at the facility" in text


def test_profile_mean_over_a_window_is_cyclic():
    profile = PueProfile("hour", tuple([1.0] * 23 + [2.0]))
    assert profile.mean_over(23, 2.0) == pytest.approx(1.5)
    assert profile.mean_over(0, 24.0) == pytest.approx(25 / 24)


@pytest.mark.parametrize("content,message", [
    ("hour,pue\n0,1.1\n", "one row per hour"),
    ("month,pue\n" + "".join(f"{m},0.9\n" for m in range(1, 13)), "below 1"),
    ("day,pue\n1,1.2\n", "expected a CSV"),
    ("hour,pue\n" + "".join(f"{h},x\n" for h in range(24)), "not a number"),
])  # fmt: skip
def test_bad_profiles(tmp_path, content, message):
    path = tmp_path / "p.csv"
    path.write_text(content)
    with pytest.raises(InvalidSettingError, match=message):
        load_pue_profile(path)


@pytest.mark.parametrize("args,message", [
    (["--pue", "0.9"], "below 1"),
    (["--iterations", "0"], "positive"),
    (["--gpus", "-1"], "positive"),
    (["--grid-gco2-per-kwh", "-3"], "negative"),
])  # fmt: skip
def test_statement_cli_errors(table_path, args, message, capsys):
    assert main(["statement", "--table", str(table_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_statement_cli_refuses_a_foreign_table(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    assert main(["statement", "--table", str(path)]) == 2
    assert "not a freqopt clock table" in capsys.readouterr().err


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["gpu"].update(name="zzz"), "GPU type 'zzz', which no file in search_spaces/ describes"),
    (lambda d: d["entries"][0].update(sm_clock_mhz=1234), "h100-sxm does not support"),
])  # fmt: skip
def test_statement_refuses_a_table_for_an_unknown_gpu_or_its_unsupported_clocks(table_path, change, fragment, capsys):
    data = json.loads(table_path.read_text())
    change(data)
    table_path.write_text(json.dumps(data))
    assert main(["statement", "--table", str(table_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


def test_statement_cli_writes_file(table_path, tmp_path, capsys):
    out = tmp_path / "statement.md"
    assert main(["statement", "--table", str(table_path), "--iterations", "10", "--out", str(out)]) == 0
    assert out.read_text() == capsys.readouterr().out and out.read_text().startswith("# Energy statement")


def test_a_pipeline_table_counts_its_stages_gpus_once():
    """A pipeline table's iteration energy is its S GPUs' together: the default run is one pipeline, and more GPUs
    mean replicas of it, so a GPU count that is not a multiple of S is refused."""
    from pipeline_tables import make_table

    table, _, _ = make_table(stages=2, micro_batches=4)
    one = energy_statement(table, iterations=1000)
    assert "on 2 x" in one
    joules = table.data["validated"]["energy_j"] * 1000
    assert f"{joules / 3.6e6:,.3f}" in one  # one pipeline: the iteration energy once, not twice
    four = energy_statement(table, iterations=1000, gpus=4)
    assert f"{2 * joules / 3.6e6:,.3f}" in four
    with pytest.raises(InvalidSettingError, match="multiple of the pipeline's 2 stages"):
        energy_statement(table, iterations=1000, gpus=3)
