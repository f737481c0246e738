"""freqopt's layers: no import cycle, and no module imports a layer above its own.

The import graph is read from the source with ``ast``: module-level imports and imports inside functions both
count (a function-level import is still a dependency, only a late one); imports under ``if TYPE_CHECKING:`` do
not (they never run). Only imports of freqopt's own modules are edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "freqopt"

# Lowest first. A module may import modules of its own layer and of the layers below, never of a layer above.
# The package is grouped into wings (workload/, gpu/, search/, pipeline/, apply/, measure/, integrations/, cli/),
# each one layer or a few consecutive ones, so that imports between wings run one way; the package root holds only the
# foundations, the table format and the name resolver that the wings above the GPU share, and the search's API.
LAYERS: list[tuple[str, ...]] = [
    # Foundations: errors, the atomic file write that everything writing a file uses, the slowdown budget's parser.
    # The package root only names its lazy exports (strings, imported on first use).
    # The names a search takes that need nothing built: its granularities. A user's command run as a child that
    # signals reach (measured by freqopt measure, held at a table's setting by freqopt apply).
    ("freqopt", "freqopt.errors", "freqopt.files", "freqopt.budget", "freqopt.granularities", "freqopt.command"),
    # The workload. Parallel layouts and the kernel data classes;
    # the built-in models' names;
    ("freqopt.workload.layout", "freqopt.workload.kernels", "freqopt.workload.model_names"),
    # the models (PyTorch modules and their custom operators), the phase hooks on them, and the module-structure
    # fingerprint a trace carries;
    ("freqopt.workload.models", "freqopt.workload.phases", "freqopt.workload.fingerprint"),
    # the model's layers split into pipeline stages as DeepSpeed's PipelineModule splits them;
    ("freqopt.workload.pipeline_partition",),
    # the tracers (a built-in or Hugging Face model, or a user's own step function -> kernels), the memory a
    # training step holds (a meta-device forward pass of the models), and real DeepSpeed steps to check them by.
    # and a serving engine's prefill and decode kernels, built from a Hugging Face config.
    ("freqopt.workload.trace", "freqopt.workload.step_trace", "freqopt.workload.memory",
     "freqopt.workload.deepspeed_profile", "freqopt.workload.serving"),
    # and a pipeline layout's stages, each traced by the tracer's recorder.
    ("freqopt.workload.pipeline_trace",),
    # The GPU. Its types;
    ("freqopt.gpu.spec_parts", "freqopt.gpu.specs"),
    # the client's end of freqoptd's protocol (a socket and JSON lines);
    ("freqopt.gpu.daemon_client",),
    # NVML device access (set calls through freqoptd where the user has no root), and traced kernels re-run on a
    # device;
    ("freqopt.gpu.nvml", "freqopt.gpu.replay"),
    # AMD GPUs through AMD SMI, behind NVML's device interface (its errors subclass NVML's);
    ("freqopt.gpu.amdsmi",),
    # freqoptd, the daemon that holds a node's NVML set calls for users without root (its policy, server, command);
    ("freqopt.daemon",),
    # where measurements come from: the simulated GPU and the real one;
    ("freqopt.gpu.backends",),
    # the simulated GPU's calibration (backends + traces).
    ("freqopt.gpu.calibration",),
    # What every wing above the GPU shares: the clock-table format, and names resolved to models, GPUs and backends.
    ("freqopt.tables", "freqopt.resolve"),
    # The search, on a backend and a trace, and the figures of one.
    ("freqopt.search",),
    # The pipeline, on the search's studies and validation: its DAG and schedules, the clock planner, the simulated
    # pipeline, the pipeline's search and stragglers, and its clock table.
    ("freqopt.pipeline",),
    # The search's API functions: one call (api), and joining a running search (worker); a run's output checked
    # before any work (output).
    ("freqopt.api", "freqopt.output", "freqopt.worker"),
    # Applying a table: transfer, the runtime, training, the energy statement.
    ("freqopt.apply",),
    # On top of applying, side by side (neither imports the other): training frameworks' hooks (the Hugging Face
    # Trainer callback), and measurement (profiling, the torch.profiler comparison, benchmark, power capping).
    ("freqopt.integrations", "freqopt.measure"),
    # The command line, and ``python -m freqopt`` (freqopt/__main__.py), which only runs it.
    ("freqopt.cli", "freqopt.__main__"),
]  # fmt: skip

# (importer, imported): upward imports that remain, each with the reason. Keep this list short and explained.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, type_checking: bool = False) -> set[str]:
    """The freqopt modules ``module`` imports anywhere outside ``if TYPE_CHECKING:`` blocks (inside them too where
    ``type_checking``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # ``from pkg import submodule``
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name == "freqopt" or name.startswith("freqopt.")}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """freqopt module -> the freqopt modules it imports (names resolved to existing modules, self-edges dropped);
    with ``type_checking``, imports made only for annotations (``if TYPE_CHECKING:``) count too."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for imported in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", type_checking):
            while imported not in paths and "." in imported:  # ``from freqopt.x import name``: a name, not a module
                imported = imported.rsplit(".", 1)[0]
            if imported in paths and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest entry that is ``module`` or a package containing it."""
    best, best_len = None, -1
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = i, len(entry)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return best


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# Package __init__ modules re-export their submodules, so the package imports its own children: not a cycle of
# layers, only of names. Edges from a package to its own submodules are left out of the cycle check.
def _without_package_reexports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}


def test_the_graph_sees_known_imports():
    """The graph builder itself: a module-level import, a function-level one, and a TYPE_CHECKING one."""
    graph = import_graph()
    assert "freqopt.gpu.specs" in graph["freqopt.gpu.backends.base"]  # module level
    assert "freqopt.gpu.backends.simulated" in graph["freqopt.gpu.backends"]  # inside get_backend
    assert "freqopt.workload.kernels" not in graph["freqopt.gpu.backends.base"]  # under TYPE_CHECKING only
    assert "freqopt.workload.kernels" in import_graph(type_checking=True)["freqopt.gpu.backends.base"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(_without_package_reexports(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_module_imports_a_layer_above_it():
    """Not even for an annotation: an ``if TYPE_CHECKING:`` import never runs, but a reader of the lower module
    still has to know the higher one to read its types (the annotation names a protocol of its own instead)."""
    upward = []
    for module, targets in sorted(import_graph(type_checking=True).items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(module) and (module, target) not in KNOWN_UPWARD:
                upward.append(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_known_upward_imports_still_exist():
    """A known exception that is gone must leave the list, so the list never hides a new upward import."""
    graph = import_graph()
    gone = [f"{m} -> {t}" for m, t in KNOWN_UPWARD if t not in graph[m]]
    assert not gone, "no longer imported, remove from KNOWN_UPWARD: " + ", ".join(gone)


def test_the_kernel_data_classes_import_nothing_of_freqopt():
    assert import_graph()["freqopt.workload.kernels"] == set()


def test_integrations_and_measurement_import_neither_the_other():
    """The two wings share the layer below the CLI (LAYERS); that holds only while neither imports the other."""
    wings = ("freqopt.integrations", "freqopt.measure")
    crossing = [f"{m} -> {t}" for m, ts in import_graph().items() for t in ts
                if any(m.startswith(a) and t.startswith(b) for a, b in (wings, wings[::-1]))]  # fmt: skip
    assert not crossing, "between integrations/ and measure/: " + ", ".join(crossing)


def test_no_module_imports_another_modules_private_names():
    """Issue 50, item 8: what one module needs from another is a public name (no leading underscore); a private name
    is its own module's business. Read from the source as above: ``from freqopt.x import _name`` anywhere in freqopt."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("freqopt"):
                found += [f"{path.relative_to(PACKAGE.parent)}: {alias.name} from {node.module}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]  # fmt: skip
    assert not found, "private names imported across modules:\n" + "\n".join(found)
