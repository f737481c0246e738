"""MkDocs hooks.

- The experiments' reports (experiments/**: Markdown, figures, JSON) become pages and files of the site under
  experiments/, so that the documentation links to them by the same relative paths as the README does, and
  ``mkdocs build --strict`` checks those links too.
- A page's ``<!-- wings -->`` line becomes a Mermaid diagram of freqopt's wings (a sub-package or a top-level
  module each) and the imports between them, drawn at every build from the code by the same import reader and
  layer list that tests/test_layers.py holds the code to, so the picture cannot drift from the code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
KINDS = {".md", ".png", ".json"}
WINGS_MARK = "<!-- wings -->"


def on_files(files, config):
    for path in sorted((ROOT / "experiments").rglob("*")):
        if path.is_file() and path.suffix in KINDS:
            files.append(File(str(path.relative_to(ROOT)), src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if WINGS_MARK in markdown:
        markdown = markdown.replace(WINGS_MARK, wings_diagram())
    if PROVENANCE_MARK in markdown:
        markdown = markdown.replace(PROVENANCE_MARK, provenance_table())
    if STEPS_MARK in markdown:
        markdown = markdown.replace(STEPS_MARK, real_steps_table())
    return markdown


PROVENANCE_MARK = "<!-- provenance -->"
STEPS_MARK = "<!-- real-steps -->"


def provenance_table() -> str:
    """Per GPU type, what each family of its simulated figures rests on: its GPU file's [provenance] table, read at
    every build (so the page says what the files say)."""
    from freqopt.gpu.specs import PROVENANCE_FAMILIES, get_gpu, list_gpus

    lines = []
    for name in list_gpus():
        spec = get_gpu(name)
        lines += [f"### {name}", "", f"{spec.marketing_name}; host `{spec.host}`.", "", "| family | rests on |",
                  "|---|---|"]  # fmt: skip
        lines += [f"| {family.replace('_', ' ')} | {spec.provenance.get(family, '')} |" for family in PROVENANCE_FAMILIES]
        lines.append("")
    return "\n".join(lines)


def real_steps_table() -> str:
    """The shared real whole steps beside the simulated ones: the simulated GPU's before its fit on them (the H200's
    as h200_check_residuals.json records device_check.json's, the H100's in the one h100_whole_steps_residuals_*.json)
    and the fitted one's with the step left out of the fits that use the steps (the H200's host
    factor: h200_check_residuals.json's host.leave_one_out; the H100's kernel classes and host factor:
    h100_whole_steps_loo.json), all in experiments/."""
    import json

    exp = ROOT / "experiments"
    h200 = json.loads((exp / "h200_check_residuals.json").read_text())
    h200_loo = {r["step"]: r for r in h200["host"]["leave_one_out"]}
    h100_loo = json.loads((exp / "h100_whole_steps_loo.json").read_text())["steps"]
    (before,) = exp.glob("h100_whole_steps_residuals_*.json")  # exactly one: the unfitted GPU's residuals
    h100_before = {r["step"]: r for r in json.loads(before.read_text())["steps"]}
    lines = ["| GPU | step | time: before / after, left out (%) | energy: before / after, left out (%) |",
             "|---|---|---:|---:|"]
    for r in h200["steps"]:
        lo = h200_loo[r["step"]]
        lines.append(f"| h200-sxm | {r['step']} | {r['time_before_error_pct']:+.1f} / {lo['time_error_pct']:+.1f} | "
                     f"{r['energy_before_error_pct']:+.1f} / {lo['energy_error_pct']:+.1f} |")
    for r in h100_loo:
        b = h100_before[r["step"]]
        lines.append(f"| h100-sxm | {r['step']} | {b['time_error_pct']:+.1f} / {r['time_error_pct']:+.1f} | "
                     f"{b['energy_error_pct']:+.1f} / {r['energy_error_pct']:+.1f} |")
    return "\n".join(lines)


def _layers_module():
    spec = importlib.util.spec_from_file_location("freqopt_layers", ROOT / "tests" / "test_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wing(module: str) -> str | None:
    """freqopt.search.runner -> "search/", freqopt.api -> "api.py"; the package root itself -> None."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return parts[1] + "/" if (ROOT / "freqopt" / parts[1]).is_dir() else parts[1] + ".py"


def wings_diagram() -> str:
    """A Mermaid flowchart: a box per wing, highest layer on top, an arrow A --> B where a module of A imports one
    of B (including imports under ``if TYPE_CHECKING:``) and no longer way through other wings implies it."""
    layers = _layers_module()
    graph = layers.import_graph(type_checking=True)
    edges: dict[str, set[str]] = {}
    level: dict[str, int] = {}
    for module, targets in graph.items():
        wing = _wing(module)
        if wing is None:
            continue
        level[wing] = min(level.get(wing, len(layers.LAYERS)), layers.layer_of(module))
        edges.setdefault(wing, set()).update(w for t in targets if (w := _wing(t)) not in (None, wing))

    def reaches(a: str, b: str, skip: tuple[str, str]) -> bool:
        seen, todo = set(), [a]
        while todo:
            node = todo.pop()
            for nxt in edges.get(node, ()):
                if (node, nxt) != skip and nxt not in seen:
                    if nxt == b:
                        return True
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    ids = {wing: "w" + "".join(c if c.isalnum() else "_" for c in wing) for wing in level}
    lines = ["```mermaid", "flowchart TD"]
    for wing in sorted(level, key=lambda w: (-level[w], w)):
        lines.append(f'    {ids[wing]}["{wing}"]')
    for wing in sorted(edges, key=lambda w: (-level[w], w)):
        for target in sorted(edges[wing], key=lambda w: (-level[w], w)):
            if not reaches(wing, target, skip=(wing, target)):
                lines.append(f"    {ids[wing]} --> {ids[target]}")
    lines.append("```")
    return "\n".join(lines)
