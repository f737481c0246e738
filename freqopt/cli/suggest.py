"""The ``freqopt train`` command that search and transfer suggest for the table they wrote: one that runs as printed,
from any folder, and finishes on the machine it was suggested on.

On the simulated backend (``sim``, and a search whose backend is not known) the model would otherwise train at the
workload's full micro-batch on this machine's CPU: gpt3-small's 4 x 2048 tokens take 127 s a step on a 2-core CPU,
eight steps by default. The suggestion adds ``--small-step`` (each step runs one short sequence on the CPU while
the simulated GPU's figures stay the full workload's: freqopt.apply.train's module docstring, "Small steps"; the
README's main search's suggestion takes 23 s in all on 2 cores), and ``--compare``, so that the run measures
the table's saving against the default clocks in alternating blocks. On a real GPU (``nvml``) the step measured is the
step run: the suggestion trains the full workload there (``--backend nvml``), with ``--compare``.

A layout of several GPUs runs one process per rank on this machine's CPU under DeepSpeed's launcher, each step a
collective round: the simulated suggestion adds ``--steps 2`` there (the search's pp=2 example's suggestion at the
default 8 steps takes 376 s on 2 cores beside the test suite, over the 5 minutes a suggested run may take; at 2 steps
69 s, with the same 25.51 % saving).
"""

from __future__ import annotations

import shlex

from freqopt.cli import absolute_model, absolute_path

__all__ = ["backend_options", "train_command"]


def backend_options(backend: str | None, *, multi_gpu: bool = False) -> list[str]:
    """The options of a suggested ``freqopt train`` for a table found on ``backend`` (module docstring): "nvml":
    ["--backend", "nvml", "--compare"]; anything else (the simulated GPU, None: not known): ["--small-step",
    "--compare"], after ["--steps", "2"] where the layout has several GPUs (``multi_gpu``)."""
    if backend == "nvml":
        return ["--backend", "nvml", "--compare"]
    return (["--steps", "2"] if multi_gpu else []) + ["--small-step", "--compare"]


def train_command(model: str, workload, table_path, *, backend: str | None = "sim", n_heads: int | None = None,
                  vocab_multiple: int | None = None, micro_batches: int | None = None,
                  sizes: bool = True) -> str:  # fmt: skip
    """The ``freqopt train`` command line that applies the table at ``table_path`` to ``workload``.

    Args:
        model: the --model value the user gave (an ``hf:PATH`` is made absolute).
        workload: the table's Workload (its micro-batch, sequence length and layout are written out).
        table_path: the table's file (made absolute).
        backend: the backend the table was found on: "nvml" trains on the real GPU at full size; anything else
            (the simulated GPU, None: not known) trains with --small-step on the simulated one (module docstring).
        n_heads, vocab_multiple: the overrides the user gave, passed on where not None.
        micro_batches: a pipeline's micro-batches per step, passed on where not None.
        sizes: write --micro-batch-size and --seq-len (the table sets them when they are left out).

    Returns:
        One shell command line; every argument quoted where the shell needs it (shlex.quote).
    """
    args = ["freqopt", "train", "--model", absolute_model(model)]
    if sizes:
        args += ["--micro-batch-size", str(workload.micro_batch_size), "--seq-len", str(workload.config.seq_len)]
    if n_heads is not None:
        args += ["--n-heads", str(n_heads)]
    if vocab_multiple is not None:
        args += ["--vocab-multiple", str(vocab_multiple)]
    if not workload.layout.is_single_gpu:
        args += ["--layout", str(workload.layout)]
    if micro_batches is not None:
        args += ["--micro-batches", str(micro_batches)]
    args += ["--table", absolute_path(table_path)]
    args += backend_options(backend, multi_gpu=not workload.layout.is_single_gpu)
    return " ".join(shlex.quote(a) for a in args)
