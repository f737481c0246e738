"""Pictures of a search, saved beside its clock tables (matplotlib, the ``plots`` extra).

Two figures per search:

* ``STEM-energy-time.png``: energy against time per iteration, the default settings and each granularity's
  validated schedule (filled), with the free-switching figure where one was measured (hollow), and the budget
  as a vertical line at (1 + max_slowdown) x the default time. Points left of the line meet the budget; lower
  is less energy.
* ``STEM-clocks.png``: per clock granularity, the SM clock (and the memory clock, where it is not the highest)
  each kernel was given, over the iteration's timeline. Kernel times are the simulated GPU's at default settings
  (freqopt.gpu.backends.simulated, noiseless), so the timeline has the same shape whatever backend searched; an
  unlocked (default) setting is drawn at the GPU type's highest SM clock, hatched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["plot_energy_time", "plot_clocks", "clock_series", "timeline_ms", "write_search_figures", "have_matplotlib"]


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (freqopt.errors.install_hint("plots") says how to install it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(**kwargs):
    """A matplotlib Figure of its own (matplotlib.figure.Figure(**kwargs)), drawn by the Agg canvas when saved.

    pyplot is never imported: a figure made without it needs no backend chosen, opens no window and is held in
    no global list to be closed (matplotlib's "embedding in a web application server" example does the same),
    and the figures are written without the half second pyplot's import takes.
    """
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(fig, path: Path) -> Path:
    """Save ``fig`` as PNG atomically (a temporary file renamed over ``path``)."""
    import io

    from freqopt.files import atomic_write_bytes

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def plot_energy_time(result, path: str | Path) -> Path:
    """Energy against time per iteration for each granularity of ``result`` (a SearchResult), with the budget
    line (module docstring); written to ``path`` as PNG.

    Raises:
        ImportError: matplotlib is not installed.
        OutputError: ``path`` cannot be written.
    """
    base = result.baseline
    fig = _figure(figsize=(7.5, 5))
    ax = fig.subplots()
    ax.scatter([1e3 * base.time_s], [base.energy_j], color="k", marker="s", s=50, label="default", zorder=3)
    markers = "ovD^P*X"
    for i, (g, r) in enumerate(result.results.items()):
        color = f"C{i}"
        ax.scatter([1e3 * r.validated.time_s], [r.validated.energy_j], color=color, marker=markers[i % 7],
                   s=60, label=f"{g}: {result.energy_saved_pct(g):.2f} % saved", zorder=3, alpha=0.8)  # fmt: skip
        if r.ideal is not None:
            ax.scatter([1e3 * r.ideal.time_s], [r.ideal.energy_j], facecolors="none", edgecolors=color,
                       marker=markers[i % 7], s=60, label=f"{g}, free switching", zorder=3)  # fmt: skip
    limit_ms = 1e3 * base.time_s * (1 + result.max_slowdown)
    ax.axvline(limit_ms, color="k", ls="--", lw=0.9, label=f"budget: +{100 * result.max_slowdown:g} % time")
    ax.set_xlabel("time per iteration (ms)")
    ax.set_ylabel("energy per iteration (J)")
    w = result.trace.workload
    ax.set_title(f"{w.model} ({w.layout}) on {result.gpu}: validated per granularity", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, Path(path))


def timeline_ms(trace, spec) -> np.ndarray:
    """Kernel boundaries over one iteration, shape (K + 1,), ms: the simulated GPU's noiseless kernel times at
    default settings (freqopt.gpu.backends.simulated), accumulated."""
    import numpy as np

    from freqopt.gpu.backends.base import DEFAULT_SETTING
    from freqopt.gpu.backends.simulated import SimulatedGPU

    time_s = SimulatedGPU(spec, noise=False).kernel_times_s(trace.kernels, DEFAULT_SETTING)
    return 1e3 * np.concatenate([[0.0], np.cumsum(time_s)])


def clock_series(result, granularity: str, spec) -> tuple:
    """Per kernel of ``result``'s trace, the clocks ``granularity``'s schedule gives it: (SM clock MHz, memory
    clock MHz, unlocked), each shape (K,); an unlocked clock is given as the highest the GPU type has."""
    import numpy as np

    from freqopt.search.validate import per_kernel_settings

    settings = per_kernel_settings(result.trace, result.results[granularity].units)
    sm = np.array([s.sm_clock_mhz or spec.max_sm_clock_mhz for s in settings], dtype=float)
    mem = np.array([s.mem_clock_mhz or max(spec.mem_clocks_mhz) for s in settings], dtype=float)
    return sm, mem, np.array([s.sm_clock_mhz is None for s in settings])


def plot_clocks(result, path: str | Path) -> Path:
    """The SM (and memory) clock of every kernel over the iteration's timeline, one panel per clock granularity
    of ``result`` (module docstring); written to ``path`` as PNG.

    Raises:
        ImportError: matplotlib is not installed.
        OutputError: ``path`` cannot be written.
    """
    import numpy as np

    from freqopt.gpu.specs import get_gpu

    spec = result.spec if result.spec is not None else get_gpu(result.gpu)
    trace = result.trace
    granularities = [g for g in result.results if g != "power-cap"]
    edges_ms = timeline_ms(trace, spec)
    passes = [(i, k.pass_name) for i, k in enumerate(trace.kernels) if i == 0 or k.pass_name != trace.kernels[i - 1].pass_name]
    top = max(spec.max_sm_clock_mhz, max(spec.mem_clocks_mhz)) * 1.12
    fig = _figure(figsize=(10, 1.6 + 1.5 * len(granularities)))
    axes = fig.subplots(max(len(granularities), 1), 1, sharex=True, squeeze=False)
    for ax, g in zip(axes[:, 0], granularities):
        sm, mem, unlocked = clock_series(result, g, spec)
        ax.stairs(sm, edges_ms, color="C0", lw=1.2, label="SM clock")
        if unlocked.any():
            ax.stairs(np.where(unlocked, sm, np.nan), edges_ms, fill=True, hatch="///", color="C0", alpha=0.15,
                      label="default (unlocked)")  # fmt: skip
        if (mem < max(spec.mem_clocks_mhz)).any():
            ax.stairs(mem, edges_ms, color="C3", lw=1.0, label="memory clock")
        for i, name in passes:  # where each pass starts
            ax.axvline(edges_ms[i], color="0.5", lw=0.6, ls=":")
            ax.text(edges_ms[i], top * 0.97, f" {name}", fontsize=7, va="top", color="0.35")
        ax.set_ylabel(f"{g}\nMHz", fontsize=9)
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("time in the iteration at default settings (ms, simulated)")
    w = trace.workload
    axes[0, 0].set_title(f"{w.model} ({w.layout}) on {result.gpu}: the clocks each kernel was given", fontsize=10)
    fig.tight_layout()
    return _save(fig, Path(path))


def write_search_figures(result, out: str | Path) -> dict[str, Path]:
    """Both figures of ``result`` into folder ``out`` as STEM-energy-time.png and STEM-clocks.png
    (freqopt.tables.table_stem); the clocks figure only when a clock granularity was searched.

    Returns:
        figure name ("energy-time", "clocks") -> path.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
        OutputError: ``out`` cannot be written.
    """
    from freqopt.tables import table_stem

    if not have_matplotlib():
        from freqopt.errors import install_hint

        raise ImportError(f"figures need matplotlib: {install_hint('plots')}")
    out = Path(out)
    stem = table_stem(result.trace.workload, result.gpu, result.max_slowdown, result.seed)
    paths = {"energy-time": plot_energy_time(result, out / f"{stem}-energy-time.png")}
    if any(g != "power-cap" for g in result.results):
        paths["clocks"] = plot_clocks(result, out / f"{stem}-clocks.png")
    return paths
