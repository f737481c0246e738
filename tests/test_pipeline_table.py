"""The pipeline clock table (issue 24, item 4): granularity "instruction", written and read back, each stage's
settings in its 1F1B order, re-planned for another micro-batch count from the table's fronts, and one-line
refusals of pipeline tables that do not add up."""

from __future__ import annotations

import copy
import csv
import json

import pytest

from freqopt.errors import ClockTableError, InvalidSettingError, TableWorkloadError
from freqopt.gpu.backends.base import ClockSetting
from freqopt.pipeline.dag import stage_order
from freqopt.pipeline.planner import PipelinePlanner
from freqopt.pipeline.realize import realize_requests
from freqopt.tables import ClockTable, load_table, table_stem, workload_doc, write_table, write_table_csv
from freqopt.workload.layout import Layout
from freqopt.workload.models import get_workload
from freqopt.apply.pipeline_runtime import pipeline_schedules, stage_schedule, table_stage_profile

from pipeline_tables import BLOCKING_POWER_W, make_table, synthetic_profile


@pytest.fixture(scope="module")
def planned():
    return make_table(stages=3, micro_batches=5, max_slowdown=0.03)


def test_written_and_read_back_with_a_row_per_instruction(planned, tmp_path):
    table, plan, _ = planned
    path = write_table(table, tmp_path / "t.json")
    write_table_csv(table, tmp_path / "t.csv")
    loaded = load_table(path)
    assert loaded == table and loaded.is_pipeline and loaded.granularity == "instruction"
    assert loaded.workload["layout"] == {"dp": 1, "tp": 1, "pp": 3}
    pipeline = loaded.pipeline
    assert (pipeline["stages"], pipeline["micro_batches"], pipeline["schedule"]) == (3, 5, "1f1b")
    assert [e["unit"] for e in loaded.entries] == [f"stage{s}.{k}" for s in range(3) for k in ("forward", "backward")]
    assert all("sm_clock_mhz" not in e for e in loaded.entries)  # the settings are per instruction, in the plan
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert len(rows) == plan.dag.n == 2 * 3 * 5
    by_instruction = {(i.stage, i.kind, i.micro_batch): int(c) for i, c in zip(plan.dag.instructions, plan.sm_clock_mhz)}
    assert {(int(r["stage"]), r["pass"], int(r["micro_batch"])): int(r["sm_clock_mhz"]) for r in rows} == by_instruction
    assert len(set(by_instruction.values())) > 1  # the plan uses several clocks: the checks below mean something
    assert "pp=3" in repr(loaded) and "granularity='instruction'" in repr(loaded)


def test_each_stage_gets_its_plan_in_its_1f1b_order(planned):
    table, plan, _ = planned
    clock = {(i.stage, i.kind, i.micro_batch): int(c) for i, c in zip(plan.dag.instructions, plan.sm_clock_mhz)}
    for stage in range(3):
        expected = [ClockSetting(clock[(i.stage, i.kind, i.micro_batch)]) for i in stage_order(3, 5, stage)]
        assert stage_schedule(table, stage) == expected == stage_schedule(table, stage, 5)
        assert all(s.mem_clock_mhz is None and s.power_limit_w is None for s in expected)
    with pytest.raises(InvalidSettingError, match=r"stage must be an integer in \[0, 3\), not 3"):
        stage_schedule(table, 3)


@pytest.mark.slow
def test_another_micro_batch_count_is_planned_again_from_the_fronts(planned):
    """6 micro-batches instead of 5: PipelinePlanner on the table's fronts at its budget and blocking power, the
    same plan a planner on the original profile makes, asked for ahead by the table's switch latency
    (realize_requests); nothing is measured (the profile is the table's)."""
    table, _, profile = planned
    rebuilt = table_stage_profile(table)
    assert rebuilt.stages == 3
    for key, options in profile.options.items():
        assert list(rebuilt.options[key].sm_clock_mhz) == list(options.sm_clock_mhz)
        assert list(rebuilt.options[key].energy_j) == pytest.approx(list(options.energy_j), rel=1e-15)
    direct = PipelinePlanner(profile, 6, blocking_power_w=BLOCKING_POWER_W).plan(max_slowdown=0.03)
    # asked for one switch latency ahead of the plan, as the search's validated requests are
    times = [float(profile.options[(i.stage, i.kind)].time_s[list(profile.options[(i.stage, i.kind)].sm_clock_mhz)
                                                              .index(c)]) for i, c in zip(direct.dag.instructions,
                                                                                          direct.sm_clock_mhz)]  # fmt: skip
    asked = realize_requests(direct.dag, direct.sm_clock_mhz, times, table.pipeline["switch_s"])
    assert list(asked) != list(direct.sm_clock_mhz)  # the latency matters here: the check below means something
    clock = {(i.stage, i.kind, i.micro_batch): int(c) for i, c in zip(direct.dag.instructions, asked)}
    schedules = pipeline_schedules(table, 6)
    assert [len(s) for s in schedules] == [12, 12, 12]
    for stage in range(3):
        assert [s.sm_clock_mhz for s in schedules[stage]] == [clock[(i.stage, i.kind, i.micro_batch)]
                                                               for i in stage_order(3, 6, stage)]  # fmt: skip
    assert direct.time_s <= 1.03 * direct.default_time_s * (1 + 1e-9) and direct.saved > 0
    with pytest.raises(InvalidSettingError, match="micro_batches must be a positive integer"):
        pipeline_schedules(table, 0)


def test_a_pipeline_tables_workload_stem_and_refusal_of_another_pipeline(planned):
    table, _, _ = planned
    pp3 = get_workload("gpt3-small", micro_batch_size=1, seq_len=16, layout=Layout(pp=3))
    table.check_workload(pp3)  # its own
    assert table_stem(pp3, "h100-sxm", 0.03) == "gpt3-small-h100-sxm-dp1tp1pp3-3pct"
    pp4 = get_workload("gpt3-small", micro_batch_size=1, seq_len=16, layout=Layout(pp=4))
    with pytest.raises(TableWorkloadError) as info:
        table.check_workload(pp4, source="t.json")
    message = str(info.value)
    assert message.startswith("table t.json was found for gpt3-small dp=1,tp=1,pp=3 micro-batch 1 seq 16, not "
                              "gpt3-small dp=1,tp=1,pp=4 micro-batch 1 seq 16")  # fmt: skip
    assert "search this workload (layout dp=1,tp=1,pp=4) at granularity 'instruction'" in message
    assert "transfer" not in message and "\n" not in message


def test_layouts_without_stages_are_recorded_as_before():
    assert workload_doc(get_workload("gpt3-small", layout=Layout(dp=2)))["layout"] == {"dp": 2, "tp": 1}
    assert workload_doc({"model": "m", "layout": {"dp": 2, "tp": 1, "pp": 1}})["layout"] == {"dp": 2, "tp": 1}
    assert workload_doc({"model": "m"})["layout"] == {"dp": 1, "tp": 1}
    assert table_stem(get_workload("gpt3-small", layout=Layout(dp=2)), "h100-sxm", 0.01) == "gpt3-small-h100-sxm-dp2tp1-1pct"


def _broken(doc: dict, how: str) -> dict:
    doc = copy.deepcopy(doc)
    plan = doc["pipeline"]["plan"]
    if how == "no pipeline object":
        del doc["pipeline"]
    elif how == "another granularity":
        doc["granularity"] = "iteration"
    elif how == "instruction on one GPU":
        doc["workload"]["layout"] = {"dp": 1, "tp": 1}
    elif how == "stages not pp":
        doc["workload"]["layout"]["pp"] = 2
    elif how == "short plan":
        plan[1]["backward"] = plan[1]["backward"][:-1]
    elif how == "a stage missing from the plan":
        del plan[2]
    elif how == "unmeasured clock":
        plan[0]["forward"][0] = 1500
    elif how == "unknown pass":
        doc["entries"][0]["pass"] = "sideways"
    elif how == "missing entry":
        del doc["entries"][-1]
    elif how == "memory clock":
        doc["entries"][0]["front"][0]["mem_clock_mhz"] = 2619
    elif how == "unsupported clock":
        doc["entries"][0]["front"][0]["sm_clock_mhz"] = 1007
        plan[0]["forward"] = [1007] * len(plan[0]["forward"])
    return doc


@pytest.mark.parametrize("how, fragment", [
    ("no pipeline object", 'is an instruction-level table without its "pipeline" object'),
    ("another granularity", "is a table of granularity 'iteration' for a pipeline layout (pp=3); a pipeline takes an "
                            "instruction-level table"),
    ("instruction on one GPU", "its workload has no pipeline stages (layout pp=1)"),
    ("stages not pp", "its pipeline has 3 stages, but its workload's layout has pp=2"),
    ("short plan", "stage 1's plan has 4 backward clocks, not one per micro-batch (5)"),
    ("a stage missing from the plan", "its plan covers stages [0, 1], not each of 0..2 once"),
    ("unmeasured clock", "stage 0's plan runs its forward pass at SM 1500 MHz, which its front does not list"),
    ("unknown pass", "is a corrupt clock table (entries/0/pass: 'sideways' is not one of ['forward', 'backward'])"),
    ("missing entry", "no entry for stage2.backward"),
    ("memory clock", "sets a memory clock or power limit; a pipeline table's instructions change the SM clock only"),
    ("unsupported clock", "stage 0's plan sets SM 1007 MHz for a forward pass, which h100-sxm does not support"),
])  # fmt: skip
def test_a_pipeline_table_that_does_not_add_up_is_refused_in_one_line(planned, tmp_path, how, fragment):
    table, _, _ = planned
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_broken(table.data, how)))
    with pytest.raises(ClockTableError) as info:
        load_table(path)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_pipeline_table_refuses_what_does_not_match():
    with pytest.raises(InvalidSettingError, match="plan has 3 stages, the profile 3 and the workload's layout pp=2"):
        make_table(stages=2, profile=synthetic_profile(3))
    with pytest.raises(InvalidSettingError, match="defaults lacks stage0.backward"):
        from freqopt.gpu.backends.base import Measurement
        from freqopt.gpu.specs import get_gpu
        from freqopt.pipeline.table import pipeline_table

        profile = synthetic_profile(2)
        plan = PipelinePlanner(profile, 2, blocking_power_w=0.0).plan()
        workload = get_workload("gpt3-small", layout=Layout(pp=2))
        pipeline_table(workload, get_gpu("h100-sxm"), profile, plan, max_slowdown=0.01, blocking_power_w=0.0,
                       switch_s=0.026, defaults={(0, "forward"): (1.0, 1.0, 1)}, validated=Measurement(1.0, 1.0))  # fmt: skip


def test_other_appliers_refuse_a_pipeline_table(planned):
    table, _, _ = planned
    with pytest.raises(ClockTableError, match="is a pipeline's table .*; freqopt transfer does not take one"):
        table.refuse_pipeline("freqopt transfer")
    ClockTable({"granularity": "iteration"}).refuse_pipeline("anything")  # another table passes


@pytest.mark.slow
def test_validated_requests_are_what_each_stage_asks_for_at_its_own_micro_batch_count(tmp_path):
    """A table with requests (the schedule a search validated, switches asked for ahead of the plan) gives the
    runtime those clocks, in each stage's 1F1B order, and the CSV shows them beside the plan; another micro-batch
    count re-plans from the fronts and asks for the planned clocks."""
    _, plan, _ = make_table(stages=2, micro_batches=4)
    spec_clocks = sorted({int(c) for c in plan.sm_clock_mhz})
    requests = [spec_clocks[(i + 1) % len(spec_clocks)] for i in range(plan.dag.n)]  # differ from the plan
    table, plan, _ = make_table(stages=2, micro_batches=4, requests=requests)
    loaded = load_table(write_table(table, tmp_path / "r.json"))
    asked = {(i.stage, i.kind, i.micro_batch): c for i, c in zip(plan.dag.instructions, requests)}
    for s in range(2):
        got = [c.sm_clock_mhz for c in stage_schedule(loaded, s)]
        assert got == [asked[(i.stage, i.kind, i.micro_batch)] for i in stage_order(2, 4, s)]
    write_table_csv(loaded, tmp_path / "r.csv")
    rows = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert {(int(r["stage"]), r["pass"], int(r["micro_batch"])): int(r["requested_sm_clock_mhz"]) for r in rows} == asked
    replanned = stage_schedule(loaded, 0, 6)
    assert len(replanned) == 12 and {c.sm_clock_mhz for c in replanned} <= set(table_stage_profile(loaded).options[
        (0, "forward")].sm_clock_mhz) | set(table_stage_profile(loaded).options[(0, "backward")].sm_clock_mhz)
    with pytest.raises(InvalidSettingError, match="requests has 3 clocks"):
        make_table(stages=2, micro_batches=4, requests=requests[:3])
    broken = json.loads((tmp_path / "r.json").read_text())
    broken["pipeline"]["requests"][1]["backward"] = broken["pipeline"]["requests"][1]["backward"][:2]
    (tmp_path / "b.json").write_text(json.dumps(broken))
    with pytest.raises(ClockTableError, match="requests have 2 backward clocks"):
        load_table(tmp_path / "b.json")
