"""Run real DeepSpeed training steps of a freqopt model and record, per rank, the GEMMs and collectives it runs.

This is the ground truth that freqopt's meta-device traces of parallel layouts are checked against
(tests/test_deepspeed.py). Launch it with DeepSpeed's launcher, one process per rank; on a machine without a GPU
DeepSpeed picks its CPU accelerator and the gloo backend carries the collectives::

    deepspeed --num_gpus 2 --no_local_rank --module freqopt.workload.deepspeed_profile --layout tp=2 --out DIR

Each rank writes ``DIR/rank{R}.json``: {"rank", "world_size", "layout", "n_params", "gemms": [[M, K, N], ...],
"collectives": [{"op", "shape", "dtype", "group_size"}, ...]} for the second training step (the first builds
DeepSpeed's buffers and checks the tensor-parallel inputs). GEMMs are the ``aten::mm``/``aten::addmm`` events of
torch.profiler (with ``record_shapes``), outside the attention operator, whose CPU fallback runs its own
matmuls where a GPU runs one fused kernel. Collectives are the profiler's ``gloo:all_reduce`` events; the size of
each one's process group, which the profiler does not record, is taken from a ``record_function`` label that this
script puts around every ``torch.distributed.all_reduce`` call, and the two lists are checked to agree.

The model is a GPTModel; ``deepspeed_config`` is the configuration used (ZeRO stage 0, AutoTP when tp > 1, as in
../shared/deepspeed-notes.md), with ``adamw_factory``'s AdamW as the client optimizer, as ``freqopt train`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from pathlib import Path

__all__ = ["deepspeed_config", "adamw_factory", "TINY_GPT", "main"]

# A GPT small enough to train on two CPU ranks in seconds, with every kind of layer the real models have.
TINY_GPT = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 512, "seq_len": 16}
_LABEL = "freqopt.all_reduce"


def deepspeed_config(micro_batch_size: int, tp: int, *, bf16: bool = False) -> dict:
    """DeepSpeed configuration: ZeRO stage 0 data parallelism, gradient clipping at 1.0 (GPT-3, Brown et al. 2020
    appendix B; DeepSpeed's usual setting), AutoTP tensor parallelism when tp > 1, and with ``bf16`` BF16 weights
    over DeepSpeed's FP32 master weights. The optimizer is not configured here: pass ``adamw_factory(...)`` to
    ``deepspeed.initialize(optimizer=...)``."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 1.0,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def adamw_factory(*, fused: bool):
    """DeepSpeed's client optimizer, as a callable of the parameters: torch's AdamW with GPT-3's settings (lr 6e-4
    of GPT-3 Small, betas (0.9, 0.95), eps 1e-8, weight decay 0.1; Brown et al. 2020, Table 2.1 and appendix B),
    the fused multi-tensor kernel (``fused=True``, CUDA) or the foreach one (CPU), as freqopt's trace models the
    step (one fused AdamW kernel). A callable, so that DeepSpeed hands it the parameters after AutoTP has sharded
    the module and, with bf16, its FP32 master copies become the optimizer's parameters."""
    import torch

    def make(params):
        return torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                 fused=True if fused else None, foreach=None if fused else True)  # fmt: skip

    return make


def _label_all_reduces() -> None:
    """Wrap torch.distributed.all_reduce so that each call runs inside a profiler label naming its group size."""
    import torch.distributed as dist
    from torch.profiler import record_function

    original = dist.all_reduce
    if getattr(original, "_freqopt_labelled", False):
        return

    def all_reduce(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        label = f"{_LABEL} shape={list(tensor.shape)} dtype={str(tensor.dtype).removeprefix('torch.')} " \
                f"group_size={dist.get_world_size(group)}"  # fmt: skip
        with record_function(label):
            return original(tensor, *args, **kwargs)

    all_reduce._freqopt_labelled = True
    dist.all_reduce = all_reduce


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _gemm_dims(shapes: list[list[int]]) -> list[int] | None:
    """[M, K, N] of an mm or addmm from its recorded input shapes (addmm: bias, input, weight)."""
    matrices = [s for s in shapes if len(s) == 2]
    if len(matrices) < 2:
        return None
    (m, k), (k2, n) = matrices[-2], matrices[-1]
    return [m, k, n] if k == k2 else None


def record_step(engine, batch) -> dict:
    """Profile one training step of ``engine`` on ``batch`` and return its GEMMs and collectives."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = engine(batch, batch)
        engine.backward(loss)
        engine.step()
    gemms, labelled, gloo = [], [], []
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if event.name in ("aten::mm", "aten::addmm"):
            if not any("flash_attention" in a.name for a in _ancestors(event)):
                dims = _gemm_dims(event.input_shapes)
                if dims:
                    gemms.append(dims)
        elif event.name.startswith(_LABEL):
            fields = dict(re.findall(r"(\w+)=(\[[^\]]*\]|\S+)", event.name))
            labelled.append({"op": "all_reduce", "shape": json.loads(fields["shape"]), "dtype": fields["dtype"],
                             "group_size": int(fields["group_size"])})  # fmt: skip
        elif event.name == "gloo:all_reduce":
            gloo.append(list(event.input_shapes[0]) if event.input_shapes else [])
    seen = Counter(json.dumps(c["shape"]) for c in labelled)
    profiled = Counter(json.dumps(s) for s in gloo)
    if seen != profiled:
        raise RuntimeError(f"profiler saw all-reduces {dict(profiled)}, the labels {dict(seen)}")
    return {"gemms": gemms, "collectives": labelled}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="dp=2", help="dp=N,tp=M over the launched ranks")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--out", required=True, help="folder for rank{R}.json")
    args = parser.parse_args(argv)

    import deepspeed
    import torch

    from freqopt.workload.layout import parse_layout
    from freqopt.workload.models.gpt3 import GPTConfig, GPTModel

    layout = parse_layout(args.layout)
    if layout.is_pipeline:
        raise SystemExit(f"--layout {layout}: this profile runs dp and tp; pipeline stages are checked against "
                         "DeepSpeed by tests/test_pipeline_layout.py")  # fmt: skip
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if world != layout.world_size:
        raise SystemExit(f"--layout {layout} needs {layout.world_size} ranks, launched {world}")
    _label_all_reduces()
    torch.manual_seed(0)  # equal initial weights on every rank
    config = GPTConfig(**TINY_GPT)
    model = GPTModel(config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw_factory(fused=False),
                                      config=deepspeed_config(args.micro_batch_size, layout.tp))  # fmt: skip
    # Every rank of a tp group must feed the same tokens (AutoTP checks); dp ranks get their own.
    data_rank = rank // layout.tp
    generator = torch.Generator().manual_seed(1000 + data_rank)
    batch = torch.randint(0, config.vocab_size, (args.micro_batch_size, config.seq_len), generator=generator)
    loss = engine(batch, batch)  # step 1: buffers, consistency checks
    engine.backward(loss)
    engine.step()
    record = record_step(engine, batch)
    record.update(rank=rank, world_size=world, layout=layout.as_dict(),
                  n_params=sum(p.numel() for p in engine.module.parameters()))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, out / f"rank{rank}.json")


if __name__ == "__main__":
    main()
