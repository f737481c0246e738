"""A standard CNN's training throughput on the simulated GPU beside the published measurement (issue 36, item 3).

    python experiments/cnn_throughput.py

ResNet-50 v1.5 (He et al. 2016, "Deep Residual Learning for Image Recognition", CVPR, table 1; v1.5: the stride on
each downsampling bottleneck's 3x3 convolution, as NVIDIA's recipe has it), written here from the paper's table,
traced with freqopt.trace_step: batch 256 of 224 x 224 images, channels-last, bf16, SGD with momentum, and
profiled on the simulated GPUs (freqopt.profile of the trace, default settings). Its convolutions are cuDNN's
implicit GEMMs on tensor cores (freqopt.workload.trace's kinds; K = C_in x kh x kw: physics.gemm_inner_dim).

Published (NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
performance results", pytorch-21.03 NGC container, mixed precision, 1 GPU): 2470 img/s on an A100 80GB (DGX A100),
1200 img/s on a V100 16GB (DGX-1). Their runs include what the trace does not: DALI's data pipeline, AMP's casts
and fp32 master weights, batch norm in fp32, label smoothing.

Writes experiments/cnn/report.md and results.json.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import freqopt

OUT = Path(__file__).resolve().parent / "cnn"
BATCH = 256
PUBLISHED = {"a100-sxm4-80gb": (2470, "A100 80GB (DGX A100), mixed precision"),
             "v100-sxm2": (1200, "V100 16GB (DGX-1), mixed precision")}  # img/s, NVIDIA DeepLearningExamples



class Bottleneck(nn.Module):
    def __init__(self, c_in, width, stride):
        super().__init__()
        c_out = 4 * width
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False); self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False); self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False); self.bn3 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, n_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        layers, c = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(c, width, stride if i == 0 else 1)); c = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def trace_resnet50():
    """One training step of ResNet-50 at BATCH, traced on the meta device."""
    with torch.device("meta"):
        model = ResNet50().to(torch.bfloat16).to(memory_format=torch.channels_last)
        images = torch.randn(BATCH, 3, 224, 224, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (BATCH,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)

    def step():
        loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return freqopt.trace_step(step, name="resnet50", module=model, micro_batch_size=BATCH)


def main() -> None:
    trace = trace_resnet50()
    rows = []
    for gpu, (published, what) in PUBLISHED.items():
        report = freqopt.profile(trace, gpu=gpu)
        simulated = BATCH / report.time_s
        rows.append({"gpu": gpu, "published_img_s": published, "published": what, "simulated_img_s": simulated,
                     "ratio": simulated / published, "step_s": report.time_s,
                     "by_kind_s": {k: f.time_s for k, f in report.by_kind.items()}})  # fmt: skip
    OUT.mkdir(exist_ok=True)
    doc = {"date": datetime.date.today().isoformat(), "batch": BATCH, "tflop_per_step": trace.total_flops / 1e12,
           "rows": rows}  # fmt: skip
    (OUT / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# ResNet-50 training throughput: simulated against published (issue 36, item 3)", "",
             f"Written by `python experiments/cnn_throughput.py` on {doc['date']} (its docstring says what it traces "
             f"and where the published figures come from). Batch {BATCH}, {doc['tflop_per_step']:.2f} TFLOP per step.", "",
             "| GPU | published (img/s) | simulated (img/s) | simulated / published | step (ms): GEMMs and convolutions, elementwise |",
             "|---|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        k = r["by_kind_s"]
        lines.append(f"| {r['gpu']} ({r['published']}) | {r['published_img_s']} | {r['simulated_img_s']:.0f} | "
                     f"{r['ratio']:.2f} | {1e3 * r['step_s']:.1f}: {1e3 * k.get('gemm', 0):.1f}, "
                     f"{1e3 * k.get('elementwise', 0):.1f} |")  # fmt: skip
    lines += ["", "Reading: issue 36's target, within 20 % of the published throughput, is **not met**: the simulated "
              "steps are faster than measured, by the ratios above. Before this change the trace counted every "
              "convolution as an elementwise kernel without tensor cores (about 12x too slow each). What the ratio "
              "still lacks is not separated here: the published runs' data pipeline, AMP's casts and fp32 master "
              "weights, batch norm in fp32, and cuDNN's efficiency on the small-channel convolutions (the A100's "
              "GEMM efficiency is an assumed 0.75 of peak at any inner dimension; only the H100's is fitted on "
              "measured GEMMs). CNN figures from freqopt are therefore optimistic in time; no search figure in "
              "this repository rests on a CNN."]  # fmt: skip
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
