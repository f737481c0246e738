"""Clock tables as files: writing them (JSON, its CSV view, a search's tables under their names), refusing to write
over another search's table, and loading one with every check (the JSON Schema, the pipeline section's
consistency, the GPU's clocks)."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

from freqopt.errors import ClockTableError, OutputError
from freqopt.files import atomic_write_text
from freqopt.gpu.specs import GPUSpec
from freqopt.tables.format import (CLOCK_TABLE_SCHEMA, INSTRUCTION, PASSES, SCHEMA_NAME, SCHEMA_VERSION, ClockTable,
                                   describe_workload, layout_doc, workload_doc)
from freqopt.tables.result import result_table, table_stem

__all__ = ["table_identity", "check_table_target", "write_result_tables", "write_table", "write_table_csv",
           "load_table", "pipeline_table_error", "check_pipeline_section"]


def table_identity(data: dict[str, Any]) -> dict[str, Any]:
    """What makes two tables the outcome of the same search: GPU type, workload, granularity, budget, backend,
    seed, and for a transferred table its source's workload, granularity and budget. A table document (or one
    with only these keys: "gpu": {"name"}, "workload", "granularity", "max_slowdown", "provenance": {"backend",
    "seed", "transferred_from"})."""
    provenance = data.get("provenance") or {}
    source = provenance.get("transferred_from")
    return {
        "gpu": data["gpu"]["name"], "workload": workload_doc(data["workload"]), "granularity": data["granularity"],
        "max_slowdown": data["max_slowdown"], "backend": provenance.get("backend"), "seed": provenance.get("seed"),
        "transferred_from": None if source is None else {
            "workload": workload_doc(source["workload"]), "granularity": source["granularity"],
            "max_slowdown": source["max_slowdown"]},
    }  # fmt: skip


def _differences(there: dict[str, Any], here: dict[str, Any]) -> str:
    def show(key: str, value) -> str:
        if key == "workload":
            return describe_workload(value, sizes=True)
        if key == "transferred_from":
            return "a search" if value is None else f"transferred from {describe_workload(value['workload'])}"
        return f"{key.replace('_', ' ')} {value}"

    return "; ".join(f"{show(k, there[k])}, not {show(k, here[k])}" for k in here if there.get(k) != here[k])


def check_table_target(path: str | Path, identity: dict[str, Any], *, argument: str = "out") -> None:
    """Refuse to write a table over file ``path`` when that holds anything but a table of the same search
    (table_identity ``identity``): another search's table, or a file that is no clock table. A table of the same
    search (a re-run, a resumed search) may be replaced; a missing file may be written.

    Raises:
        OutputError: one line naming the file, what differs, and what to do.
    """
    path = Path(path)
    if not path.exists():
        return
    try:
        there = table_identity(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise OutputError(f"{path} exists and is not a freqopt clock table; choose another {argument} folder or move "
                          "the file away") from None  # fmt: skip
    if there != identity:
        raise OutputError(f"{path} holds the table of another search ({_differences(there, identity)}); choose "
                          f"another {argument} folder or move that table away")  # fmt: skip


def write_result_tables(result, out: str | Path) -> dict[str, Path]:
    """Write each searched granularity's clock table into folder ``out`` as STEM-GRANULARITY.json and .csv
    (table_stem), atomically; none is written if any would replace another search's table (check_table_target).

    Returns:
        granularity -> the JSON file's path.

    Raises:
        OutputError: ``out`` cannot be written, or holds another search's table under one of these names.
    """
    out = Path(out)
    tables = {g: result_table(result, g) for g in result.results}
    stem = table_stem(result.trace.workload, result.gpu, result.max_slowdown, result.seed)
    paths = {g: out / f"{stem}-{g}.json" for g in tables}
    for g, table in tables.items():
        check_table_target(paths[g], table_identity(table.data))
    for g, table in tables.items():
        write_table(table, paths[g])
        write_table_csv(table, paths[g].with_suffix(".csv"))
    return paths


def write_table(table: ClockTable, path: str | Path) -> Path:
    """Write the table as JSON, atomically. Returns the path."""
    text = json.dumps(table.data, indent=1)
    # Keep number lists (clock lists) on one line each, so the file reads entry by entry.
    text = re.sub(r"\[\s*([-0-9.,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    # And each object of numbers only (a front's option) on one line.
    pair = r'"\w+": (?:[-0-9.eE+]+|null|true|false)'
    text = re.sub(rf"\{{\n\s*({pair}(?:,\n\s*{pair})*)\n\s*\}}",
                  lambda m: "{" + re.sub(r",\n\s*", ", ", m.group(1)) + "}", text)
    atomic_write_text(path, text + "\n")
    return Path(path)


def write_table_csv(table: ClockTable, path: str | Path) -> Path:
    """Write the CSV view (one row per tuning unit; a pipeline table's: one row per instruction, columns stage,
    pass, micro_batch, sm_clock_mhz, and requested_sm_clock_mhz where the table has requests), atomically. Returns
    the path."""
    buf = io.StringIO()
    if table.is_pipeline:
        writer = csv.writer(buf)
        pipeline = table.data["pipeline"]
        requests = {r["stage"]: r for r in pipeline.get("requests", ())}
        writer.writerow(["stage", "pass", "micro_batch", "sm_clock_mhz"] + (["requested_sm_clock_mhz"] if requests else []))
        for stage in pipeline["plan"]:
            for kind in PASSES:
                asked = requests[stage["stage"]][kind] if requests else None
                writer.writerows([stage["stage"], kind, m, clock] + ([asked[m]] if asked else [])
                                 for m, clock in enumerate(stage[kind]))  # fmt: skip
        atomic_write_text(path, buf.getvalue())
        return Path(path)
    columns = ["unit", "kind", "n_kernels", "arithmetic_intensity", "sm_clock_mhz", "mem_clock_mhz", "power_limit_w"]
    if table.is_phase_schedule:
        columns.append("request_phase")
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for entry in table.entries:
        writer.writerow(entry)
    atomic_write_text(path, buf.getvalue())
    return Path(path)


def _integer_clocks(data: dict[str, Any]) -> None:
    """Make every clock of a validated table document an int, in place. JSON Schema's "integer" admits 885.0
    (a number with a zero fractional part), which another tool may write; freqopt's settings and files carry
    885."""
    for entry in data["entries"]:
        for item in (entry, entry.get("default") or {}, *entry.get("front", ())):
            for key in ("sm_clock_mhz", "mem_clock_mhz"):
                if item.get(key) is not None:
                    item[key] = int(item[key])
    for key in ("sm_clocks_mhz", "mem_clocks_mhz"):
        data["gpu"][key] = [int(v) for v in data["gpu"][key]]
    for stage in [*(data.get("pipeline") or {}).get("plan", ()), *(data.get("pipeline") or {}).get("requests", ())]:
        for kind in PASSES:
            stage[kind] = [int(v) for v in stage[kind]]


def pipeline_table_error(data: dict[str, Any], path) -> str | None:
    """What is wrong with a pipeline table document (freqopt.tables, "Pipelines") that the schema cannot say, or
    with a pipeline layout's table that is no pipeline table; None when nothing is. Run before the schema check,
    whose message for these cases ("'pipeline' is a required property") would not say what to do."""
    workload = data.get("workload") if isinstance(data.get("workload"), dict) else {}
    layout = workload.get("layout") if isinstance(workload.get("layout"), dict) else {}
    pp = layout.get("pp", 1)
    granularity = data.get("granularity")
    if isinstance(pp, int) and pp > 1 and granularity != INSTRUCTION:
        return (f"{path} is a table of granularity {granularity!r} for a pipeline layout (pp={pp}); a pipeline "
                f"takes an {INSTRUCTION}-level table (a clock per instruction): search the pipeline again at "
                f"granularity {INSTRUCTION!r}")  # fmt: skip
    if granularity != INSTRUCTION:
        return None
    if not isinstance(data.get("pipeline"), dict):
        return (f"{path} is an {INSTRUCTION}-level table without its \"pipeline\" object (the stages, micro-batches "
                "and plan per stage); it was written by hand or cut short: re-export it with freqopt")  # fmt: skip
    if pp == 1:
        return (f"{path} is an {INSTRUCTION}-level table, but its workload has no pipeline stages (layout pp=1); a "
                "pipeline table records its layout's pp: re-export it with freqopt")  # fmt: skip
    return None


def check_pipeline_section(data: dict[str, Any], path) -> None:
    """A schema-valid pipeline table's consistency: its stage count is its layout's pp, one entry per (stage, pass)
    with a front of distinct SM clocks only (no memory clock or power limit: those stay at the default), and a plan
    of every stage whose clocks are each pass's measured ones, M per pass.

    Raises:
        ClockTableError: one line naming the file, what is wrong and what to do.
    """
    pipeline = data["pipeline"]
    stages, micro_batches = pipeline["stages"], pipeline["micro_batches"]
    pp = layout_doc(data["workload"].get("layout")).get("pp", 1)
    redo = "re-export it with freqopt"
    if stages != pp:
        raise ClockTableError(f"{path}: its pipeline has {stages} stages, but its workload's layout has pp={pp}; "
                              f"{redo}")  # fmt: skip
    fronts: dict[tuple[int, str], set[int]] = {}
    for entry in data["entries"]:
        key = (entry["stage"], entry["pass"])
        if key[0] >= stages:
            raise ClockTableError(f"{path}: entry {entry['unit']!r} is for stage {key[0]} of a {stages}-stage "
                                  f"pipeline; {redo}")  # fmt: skip
        if key in fronts:
            raise ClockTableError(f"{path}: stage {key[0]}'s {key[1]} pass has two entries; {redo}")
        clocks = [option.get("sm_clock_mhz") for option in entry["front"]]
        if not clocks or None in clocks or len(set(clocks)) != len(clocks):
            raise ClockTableError(f"{path}: entry {entry['unit']!r} needs a front of distinct measured SM clocks "
                                  f"(none may be null or repeated); {redo}")  # fmt: skip
        if any(option.get(k) is not None for option in [entry["default"], *entry["front"]]
               for k in ("mem_clock_mhz", "power_limit_w")):  # fmt: skip
            raise ClockTableError(f"{path}: entry {entry['unit']!r} sets a memory clock or power limit; a pipeline "
                                  f"table's instructions change the SM clock only; {redo}")  # fmt: skip
        fronts[key] = set(clocks)
    missing = [f"stage{s}.{k}" for s in range(stages) for k in PASSES if (s, k) not in fronts]
    if missing:
        raise ClockTableError(f"{path}: no entry for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                              f"(one per stage and pass); {redo}")  # fmt: skip
    plan = pipeline["plan"]
    for what, lists, has, covers in (("plan", plan, "has", "covers"),
                                     ("requests", pipeline.get("requests"), "have", "cover")):
        if lists is None:
            continue
        if sorted(stage["stage"] for stage in lists) != list(range(stages)):
            raise ClockTableError(f"{path}: its {what} {covers} stages {sorted(s['stage'] for s in lists)}, not each "
                                  f"of 0..{stages - 1} once; {redo}")  # fmt: skip
        for stage in lists:
            for kind in PASSES:
                if len(stage[kind]) != micro_batches:
                    raise ClockTableError(f"{path}: stage {stage['stage']}'s {what} {has} {len(stage[kind])} {kind} "
                                          f"clocks, not one per micro-batch ({micro_batches}); {redo}")  # fmt: skip
    for stage in plan:
        for kind in PASSES:
            unmeasured = sorted(set(stage[kind]) - fronts[(stage["stage"], kind)])
            if unmeasured:
                raise ClockTableError(f"{path}: stage {stage['stage']}'s plan runs its {kind} pass at SM "
                                      f"{unmeasured[0]} MHz, which its front does not list (the plan picks measured "
                                      f"clocks); {redo}")  # fmt: skip


def load_table(path: str | Path, *, spec: GPUSpec | None = None) -> ClockTable:
    """Read and validate a clock table.

    Every command and function that reads a table reads it here, so each gets the same checks: the schema, a GPU
    type freqopt knows, and settings that type supports.

    Args:
        path: the JSON file.
        spec: the GPU the table will be applied to (a device's clock lists, as NVML reports them): the table must
            be for this GPU type and all its clocks and power limits supported. None: the table's own GPU type as
            search_spaces/ describes it.

    Raises:
        ClockTableError: unreadable, not JSON, not a freqopt clock table, another schema version, a GPU type
            freqopt does not know, another GPU type than ``spec``, or settings the GPU does not support; for a
            pipeline layout (pp > 1): a table of another granularity than "instruction", no "pipeline" object, a stage
            count other than the layout's pp, entries that do not cover each (stage, pass) once, or a plan that does
            not give each stage M clocks per pass among those measured (freqopt.tables, "Pipelines").
    """
    import jsonschema

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ClockTableError(f"cannot read clock table {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ClockTableError(f"{path} is not a text file, so not a clock table; re-export it with freqopt") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClockTableError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); re-export it with freqopt") from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_NAME:
        raise ClockTableError(f"{path} is not a freqopt clock table (no \"schema\": \"{SCHEMA_NAME}\")")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ClockTableError(
            f"{path} has clock-table schema version {data.get('schema_version')!r}; this freqopt reads version "
            f"{SCHEMA_VERSION}: re-export it with this freqopt version"
        )
    wrong = pipeline_table_error(data, path)
    if wrong:
        raise ClockTableError(wrong)
    try:
        jsonschema.validate(data, CLOCK_TABLE_SCHEMA)
    except jsonschema.ValidationError as e:
        where = "/".join(map(str, e.absolute_path)) or "top level"
        raise ClockTableError(f"{path} is a corrupt clock table ({where}: {e.message})") from e
    _integer_clocks(data)
    if data["granularity"] == INSTRUCTION:
        check_pipeline_section(data, path)
    table = ClockTable(data, source=str(Path(path).resolve()))
    if spec is None:
        from freqopt.errors import UnknownNameError
        from freqopt.gpu.specs import get_gpu

        try:
            spec = get_gpu(table.gpu)
        except UnknownNameError as e:
            raise ClockTableError(f"{path} was searched on GPU type {table.gpu!r}, which no file in search_spaces/ "
                                  "describes; search again on a known GPU type") from e  # fmt: skip
    table.check_gpu(spec, source=path)
    return table
