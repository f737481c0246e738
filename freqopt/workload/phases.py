"""Phases: where a running job can switch clocks.

A DVFS runtime cannot switch clocks between any two kernels: it sees the job only at module hooks and the
optimizer step (a job's only hooks into its own progress), and a switch takes milliseconds to land
(``GPUSpec.clock_switch_s``: the NVML call plus the transition, 6-26 ms on Hopper, over 100 ms on consumer parts; Velicka et al. 2025, Spaan et
al. 2026). So:

* ``PhaseHooks`` marks a boundary at the start of the forward and of the backward of every phase module (each
  child of a transformer block, the embeddings, the final norm and the output layer) and at the optimizer step.
  The tracer records the same marks, so a phase is the span of traced kernels between two marks, and the
  runtime, counting marks, always knows which phase the GPU is entering.
* ``phase_spans`` turns a trace's marks into the kernel span of each phase.

What a clock table becomes on these phases once switching has a cost (one setting per phase, switches only into
runs of phases at least as long as the switch latency) is freqopt.search.realize's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
import warnings

import torch.nn as nn

__all__ = ["STEP_MARK", "phase_modules", "PhaseHooks", "phase_spans"]

STEP_MARK = "step"

# Embeddings take token ids, which need no gradient; their backward pre-hook still fires, as intended.
HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to"


@contextlib.contextmanager
def quiet_backward_hooks():
    """A context in which PyTorch's warning about full backward hooks on modules without gradient inputs (the
    embeddings) is silenced; wrap ``loss.backward()`` in it when using ``PhaseHooks`` directly (DVFSRuntime
    silences it itself while entered)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=HOOK_WARNING)
        yield


def phase_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose forward and backward starts are phase boundaries: the children of every block in the
    model's ModuleList of blocks, and the model's other direct children (embeddings, final norm, output layer).
    A child that holds the ModuleList further down (a Hugging Face model's ``model`` or ``transformer``, or a
    wrapper around one) is searched in turn, so ``LlamaForCausalLM`` gives ``model.embed_tokens``,
    ``model.layers.0.self_attn``, ..., ``model.norm``, ``lm_head``. Works on a DeepSpeed engine's ``module`` too.
    Blocks' children come in registration order; the hooks mark them in the order they run."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            for i, block in enumerate(child):
                out.extend((f"{name}.{i}.{sub}", m) for sub, m in block.named_children())
        elif any(isinstance(m, nn.ModuleList) for m in child.modules()):
            out.extend((f"{name}.{sub}", m) for sub, m in phase_modules(child))
        else:
            out.append((name, child))
    return out


class PhaseHooks:
    """Calls ``on_mark(label)`` at every phase boundary of ``model``: ``fwd:NAME`` before a phase module's forward,
    ``bwd:NAME`` when its backward starts (a full backward pre-hook), and ``step`` from ``mark_step()``.

    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, model: nn.Module, on_mark: Callable[[str], None]):
        self.model, self.on_mark = model, on_mark
        self.handles: list = []

    def __enter__(self) -> PhaseHooks:
        for name, module in phase_modules(self.model):
            self.handles.append(module.register_forward_pre_hook(lambda m, args, _n=name: self.on_mark(f"fwd:{_n}")))
            if any(p.requires_grad for p in module.parameters()):
                self.handles.append(module.register_full_backward_pre_hook(
                    lambda m, grad, _n=name: self.on_mark(f"bwd:{_n}")))  # fmt: skip
        return self

    def mark_step(self) -> None:
        self.on_mark(STEP_MARK)

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def phase_spans(marks: Sequence[tuple[str, int]], n_kernels: int) -> list[tuple[str, int, int]]:
    """(label, first kernel, end kernel) of every phase, from a trace's marks (label, kernel index); kernels before
    the first mark form a phase labelled "start". Empty phases are dropped."""
    spans = []
    points = [("start", 0)] + list(marks) + [("end", n_kernels)]
    for (label, first), (_, end) in zip(points, points[1:]):
        if end > first:
            spans.append((label, first, end))
    return spans
