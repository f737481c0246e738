"""Bad input, fuzzed (hypothesis): CLI arguments and clock-table files. Each gives its one-line error and a
non-zero exit, never a traceback."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freqopt.cli import main, parse_slowdown
from freqopt.errors import ClockTableError, FreqoptError, InvalidSettingError
from freqopt.gpu.specs import get_gpu
from freqopt.workload.layout import parse_layout
from freqopt.tables import SCHEMA_NAME, load_table

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXT = st.text(alphabet=string.printable + "%µ−", max_size=12)


def one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("freqopt: error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


@FUZZ
@given(TEXT)
def test_any_slowdown_text_parses_or_is_refused_clearly(text):
    try:
        value = parse_slowdown(text)
    except InvalidSettingError as e:
        assert "max_slowdown" in str(e) and "\n" not in str(e)
    else:
        assert 0.0 <= value < 1.0


@FUZZ
@given(TEXT)
def test_any_layout_text_parses_or_is_refused_clearly(text):
    try:
        layout = parse_layout(text)
    except InvalidSettingError as e:
        assert "layout" in str(e) and "\n" not in str(e)
    else:
        assert layout.dp >= 1 and layout.tp >= 1


@FUZZ
@given(option=st.sampled_from(["--max-slowdown", "--layout", "--gpu", "--micro-batch-size", "--seq-len", "--n-heads",
                               "--backend", "--model"]),
       value=TEXT.filter(lambda v: not v.startswith("-")))  # fmt: skip
def test_search_with_a_fuzzed_option_fails_cleanly_before_any_work(tmp_path_factory, capsys, option, value):
    """Every other argument is valid except the granularity, which is checked after the fuzzed ones: a fuzzed
    value that is valid reaches the granularity's error, an invalid one fails on its own; nothing runs."""
    out = tmp_path_factory.mktemp("out")
    args = {"--model": "gpt3-small", "--max-slowdown": "1%", option: value, "--granularity": "no-such"}
    argv = ["search", "--out", str(out / "o")]
    for key, val in args.items():
        argv += [key, val]
    one_line_error(capsys, main(argv))
    assert not (out / "o").exists()


VALID_TABLE = {
    "schema": SCHEMA_NAME, "schema_version": 1,
    "gpu": {"name": "h100-sxm", "sm_clocks_mhz": [1980], "mem_clocks_mhz": [2619]},
    "workload": {"model": "gpt3-small"}, "granularity": "iteration", "max_slowdown": 0.01,
    "entries": [{"unit": "iteration", "sm_clock_mhz": 1500, "mem_clock_mhz": 2619, "power_limit_w": None}],
    "baseline": {"time_s": 1.0, "energy_j": 1.0}, "predicted": {"time_s": 1.0, "energy_j": 1.0},
    "validated": {"time_s": 1.0, "energy_j": 1.0}, "provenance": {},
}  # fmt: skip


def test_the_valid_table_loads():
    assert load_table_from(VALID_TABLE).granularity == "iteration"


def load_table_from(doc):
    """Write ``doc`` (JSON text, or an object to serialize) to a temporary file and load it for h100-sxm."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.json"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return load_table(path, spec=get_gpu("h100-sxm"))


@FUZZ
@given(st.integers(min_value=0, max_value=len(json.dumps(VALID_TABLE)) - 1))
def test_a_truncated_table_is_refused(cut):
    with pytest.raises(ClockTableError):
        load_table_from(json.dumps(VALID_TABLE)[:cut])


@pytest.mark.slow
@FUZZ
@given(version=st.one_of(st.integers(), st.text(max_size=4), st.none()).filter(lambda v: v != 1))
def test_another_schema_version_is_refused(version):
    with pytest.raises(ClockTableError, match="schema version|corrupt"):
        load_table_from({**VALID_TABLE, "schema_version": version})


@FUZZ
@given(gpu=st.sampled_from(["a100-sxm4-80gb", "v100-pcie", "rtx3080ti", "h200-sxm"]))
def test_another_gpu_type_is_refused(gpu):
    with pytest.raises(ClockTableError, match=f"searched on {gpu}, not h100-sxm"):
        load_table_from({**VALID_TABLE, "gpu": {**VALID_TABLE["gpu"], "name": gpu}})


@pytest.mark.slow
@FUZZ
@given(sm=st.integers(min_value=-10, max_value=5000).filter(lambda f: f not in get_gpu("h100-sxm").sm_clocks_mhz),
       mem=st.sampled_from([2619, 1593, 877]))  # fmt: skip
def test_clocks_the_gpu_lacks_are_refused(sm, mem):
    entry = {**VALID_TABLE["entries"][0], "sm_clock_mhz": sm, "mem_clock_mhz": mem}
    with pytest.raises(ClockTableError, match="does not support|corrupt"):
        load_table_from({**VALID_TABLE, "entries": [entry]})


@pytest.mark.slow
@FUZZ
@given(key=st.sampled_from(sorted(VALID_TABLE)), junk=st.one_of(st.none(), st.integers(), st.text(max_size=5),
                                                                st.lists(st.integers(), max_size=2)))  # fmt: skip
def test_a_corrupted_field_is_refused_or_harmless(key, junk):
    doc = {**VALID_TABLE, key: junk}
    try:
        load_table_from(doc)
    except ClockTableError as e:
        assert "\n" not in str(e)
    except FreqoptError as e:  # pragma: no cover - any other freqopt error is still a clean one
        assert "\n" not in str(e)


@FUZZ
@given(junk=st.binary(max_size=64))
def test_cli_statement_with_a_garbage_table_is_one_line(tmp_path_factory, capsys, junk):
    path = tmp_path_factory.mktemp("t") / "t.json"
    path.write_bytes(junk)
    one_line_error(capsys, main(["statement", "--table", str(path)]))
