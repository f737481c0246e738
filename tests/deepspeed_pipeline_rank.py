"""One rank of a real DeepSpeed pipeline (PipelineModule + PipelineEngine) built from freqopt's layer list, for
tests/test_pipeline_layout.py. Run under the DeepSpeed launcher on CPU ranks (gloo):

    python -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank tests/deepspeed_pipeline_rank.py \
        --partition-method parameters --out DIR

Each layer of freqopt.workload.pipeline_partition.pipeline_layers becomes an nn.Module whose class name is the
layer's type name (what PipelineModule partitions by), holding the layer's freqopt modules; the output layer holds
its own copy of the tied weight (as a TiedLayerSpec's copy on the last stage). The engine trains two steps of two
micro-batches (1F1B, P2P over gloo); each rank writes rank{R}.json: its stage, PipelineModule's partition
(``parts``), the parameters it holds, and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

TINY = {"n_layers": 5, "d_model": 64, "n_heads": 4, "vocab_size": 512, "seq_len": 16}
MICRO_BATCH, MICRO_BATCHES = 2, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--partition-method", default="parameters")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import deepspeed
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from deepspeed.pipe import PipelineModule

    from freqopt.workload.models.gpt3 import GPTConfig, GPTModel
    from freqopt.workload.pipeline_partition import pipeline_layers

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    config = GPTConfig(**TINY)
    model = GPTModel(config)

    class _Layer(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.kind = layer.name
            for name in layer.modules:
                module = model.get_submodule(name)
                if name == "lm_head":  # the last stage's own copy of the tied weight
                    module = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
                    module.weight.data.copy_(model.lm_head.weight.data)
                self.add_module(name.replace(".", "_"), module)

        def forward(self, x):
            if self.kind == "embedding":  # x: token ids (B, T)
                return self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            if self.kind == "lm_head":
                return self.lm_head(x)  # (B, T, V) logits; the loss is PipelineModule's loss_fn
            return next(iter(self.children()))(x)  # a block or the final norm

    layers = [type(layer.type_name, (_Layer,), {})(layer) for layer in pipeline_layers(model)]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    pipe = PipelineModule(layers=layers, num_stages=world, loss_fn=loss_fn, partition_method=args.partition_method)
    engine, *_ = deepspeed.initialize(
        model=pipe, model_parameters=[p for p in pipe.parameters() if p.requires_grad],
        config={"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                "zero_optimization": {"stage": 0}},
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (MICRO_BATCH, config.seq_len), generator=generator)
               for _ in range(2 * MICRO_BATCHES)]  # fmt: skip
    data = iter([(b, b) for b in batches])
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(2)]
    record = {"rank": rank, "stage": engine.stage_id, "parts": [int(p) for p in pipe.parts],
              "n_params": sum(p.numel() for p in pipe.parameters()), "losses": losses}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, out / f"rank{rank}.json")
    # Both ranks done before either tears down gloo: a rank exiting while its peer's P2P thread still runs can
    # abort it ("terminate called without an active exception", seen once in a fresh-clone run).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
