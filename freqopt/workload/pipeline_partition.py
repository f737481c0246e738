"""A model's layers split into pipeline stages, as DeepSpeed's PipelineModule splits them.

DeepSpeed's PipelineModule (deepspeed.runtime.pipe.module) takes a model as a flat list of layers (``LayerSpec``s)
and gives each of ``num_stages`` stages a run of consecutive layers, by its ``partition_method``:

* ``"parameters"`` (DeepSpeed's default): balance the layers' trainable parameter counts,
* ``"uniform"``: balance the number of layers,
* ``"type:REGEX"``: balance the number of layers whose class name matches REGEX (case-insensitive search), e.g.
  ``"type:Block"`` for the transformer blocks.

The balancing is ``deepspeed.runtime.utils.partition_balanced``: a dynamic program over (first i layers, j parts)
that minimizes the difference between the heaviest and the lightest part, keeping among equal costs the last split
point it tries; ``partition_uniform`` gives the first ``n mod parts`` parts one layer more. ``partition_uniform`` and
``partition_balanced`` here compute the same boundaries (tests/test_pipeline_layout.py checks them against
DeepSpeed's own functions and PipelineModule's ``_partition_layers``): written here so that planning a layout needs
no DeepSpeed import (seconds, and an accelerator set up) on a machine that only plans.

freqopt's modules as DeepSpeed's layer list (``pipeline_layers``), as Megatron-DeepSpeed's GPTModelPipe lists a GPT:

* GPT-3: ``EmbeddingPipe`` (token and position embeddings, wte + wpe), one ``Block`` per transformer block, the
  final ``LayerNorm`` (ln_f), and ``LMHeadPipe`` (the output layer, lm_head). The output layer is tied to the token
  embedding; like a ``TiedLayerSpec``, which DeepSpeed builds on both the first and the last stage (and counts on
  both: ``PipelineModule._count_layer_params`` builds every spec), its count includes the tied weight
  (padded vocabulary x d_model).
* BERT: ``EmbeddingPipe`` (wte, wpe, the segment embedding and the embedding layer norm), one ``EncoderBlock`` per
  block, and ``MLMHeadPipe`` (dense, layer norm and the tied output layer, with its bias).

Hugging Face models (``hf:``) have no layer list here yet, and are refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from freqopt.errors import InvalidSettingError

__all__ = ["PARTITION_METHODS", "DEFAULT_PARTITION_METHOD", "PipelineLayer", "PipelineStage", "partition_uniform",
           "partition_balanced", "partition_layers", "pipeline_layers", "partition_stages", "stage_parameters"]

PARTITION_METHODS = ("parameters", "uniform", "type:REGEX")
DEFAULT_PARTITION_METHOD = "parameters"  # PipelineModule(partition_method='parameters') in DeepSpeed


@dataclass(frozen=True)
class PipelineLayer:
    """One entry of the model's layer list, as DeepSpeed's PipelineModule would hold it.

    Attributes:
        name: freqopt's name for it (``embedding``, ``layers.3``, ``ln_f``, ``lm_head``, ``head``).
        type_name: the class name DeepSpeed sees (``LayerSpec.typename.__name__``), which ``type:REGEX`` matches.
        modules: the freqopt modules it holds (qualified names under the model).
        n_params: its trainable parameters, a tied weight counted (as PipelineModule._count_layer_params counts).
        forward: ``forward(x, idx)``: its computation on the model it was listed from; x (B, T, d) activations
            (None for the first layer), idx (B, T) the token ids (the embedding's input, the loss's targets). The
            last layer returns the mean cross-entropy loss.
    """

    name: str
    type_name: str
    modules: tuple[str, ...]
    n_params: int
    forward: Callable = field(compare=False, repr=False)


@dataclass(frozen=True)
class PipelineStage:
    """The layers one pipeline stage holds: ``layers[start:stop]`` of the model's layer list.

    Attributes:
        stage: 0 .. stages - 1; stage 0 holds the embedding, the last one the output layer and the loss.
        stages: pipeline stages (Layout.pp).
        start, stop: the stage's layers in the list, stop exclusive.
        layers: the PipelineLayers themselves.
    """

    stage: int
    stages: int
    start: int
    stop: int
    layers: tuple[PipelineLayer, ...]

    @property
    def n_params(self) -> int:
        """Trainable parameters of the stage's layers (unsharded; a tied weight counted on every stage holding it)."""
        return sum(layer.n_params for layer in self.layers)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (num_parts + 1, ascending, from 0 to num_items) giving each part num_items // num_parts items,
    the first num_items % num_parts parts one more; with num_items <= num_parts, one item per part and the rest
    empty. DeepSpeed's ``deepspeed.runtime.utils.partition_uniform``."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries (num_parts + 1) splitting ``weights`` into num_parts runs of consecutive items, none empty, that
    minimize the heaviest run's weight minus the lightest's; DeepSpeed's ``deepspeed.runtime.utils.
    partition_balanced`` (the linear partition problem by dynamic programming, its tie-breaking kept: among split
    points of equal cost the last one tried wins). With no more items than parts: partition_uniform.

    O(n^2 parts) in numpy: milliseconds for gpt3-175b's 99 layers."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    heaviest = np.full((n + 1, m + 1), np.inf)  # (first i items, j parts) -> the best split's heaviest part
    lightest = np.full((n + 1, m + 1), np.inf)  # ... its lightest part (DeepSpeed leaves [0, 0] infinite)
    split = np.zeros((n + 1, m + 1), dtype=int)  # ... where its last part starts
    heaviest[0, 0] = 0.0
    for i in range(1, n + 1):
        last = prefix[i] - prefix[:i]  # (i,): the last part's weight, starting at k = 0 .. i - 1
        for j in range(1, min(i, m) + 1):
            top = np.maximum(heaviest[:i, j - 1], last)
            low = np.minimum(lightest[:i, j - 1], last)
            cost = top - low
            k = int(np.flatnonzero(cost == cost.min())[-1])  # the last k of least cost
            heaviest[i, j], lightest[i, j], split[i, j] = top[k], low[k], k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(int(split[parts[-1], j]))
    return parts[::-1]


def partition_layers(layers: Sequence[PipelineLayer], stages: int, method: str = DEFAULT_PARTITION_METHOD) -> list[int]:
    """Stage boundaries (stages + 1) over ``layers``, as PipelineModule._partition_layers computes them.

    Args:
        layers: the model's layer list (pipeline_layers).
        stages: pipeline stages, positive.
        method: "parameters", "uniform" or "type:REGEX" (case-insensitive, as DeepSpeed lowercases it; the regex
            searched in each layer's type_name, ignoring case).

    Raises:
        InvalidSettingError: an unknown method (argument "partition_method"), a type regex that does not compile
            or matches no layer; more stages than layers (argument "layout").
    """
    if not isinstance(method, str):
        raise InvalidSettingError(f"partition_method must be a string, not {type(method).__name__}",
                                  argument="partition_method")  # fmt: skip
    if stages > len(layers):
        raise InvalidSettingError(f"layout pp={stages} gives some stage no layer: the model has {len(layers)} pipeline "
                                  f"layers; choose pp from 1 to {len(layers)}", argument="layout")  # fmt: skip
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(layers), stages)
    if lowered == "parameters":
        return partition_balanced([layer.n_params for layer in layers], stages)
    if lowered.startswith("type:"):
        pattern = lowered.split(":")[1]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise InvalidSettingError(f"partition_method {method!r}: {pattern!r} is not a regular expression ({e})",
                                      argument="partition_method") from e  # fmt: skip
        matched = [1 if regex.search(layer.type_name) else 0 for layer in layers]
        if not any(matched):
            types = ", ".join(dict.fromkeys(layer.type_name for layer in layers))
            raise InvalidSettingError(f"partition_method {method!r} matches no layer; the layer types are {types}",
                                      argument="partition_method")  # fmt: skip
        return partition_balanced(matched, stages)
    raise InvalidSettingError(f"partition_method {method!r} is not one of DeepSpeed's; choose parameters (the "
                              "default), uniform or type:REGEX", argument="partition_method")  # fmt: skip


def _params(model: torch.nn.Module, names: Sequence[str]) -> int:
    """Trainable parameters of the named submodules (each module's own, tied ones included, each tensor once)."""
    seen: dict[int, int] = {}
    for name in names:
        for p in model.get_submodule(name).parameters():
            if p.requires_grad:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def pipeline_layers(model: torch.nn.Module) -> list[PipelineLayer]:
    """The layer list DeepSpeed's PipelineModule would hold for freqopt's ``model`` (a GPTModel or BertModel, as
    freqopt.workload.models.build_model builds it, tensor-parallel sharded or not); the module docstring gives the
    mapping. Parameter counts are of ``model`` as given.

    Raises:
        InvalidSettingError: a model other than the built-in GPT-3 and BERT ones (argument "layout").
    """
    from freqopt.workload.models.bert import BertModel
    from freqopt.workload.models.gpt3 import GPTModel

    if isinstance(model, GPTModel):
        return _gpt_layers(model)
    if isinstance(model, BertModel):
        return _bert_layers(model)
    raise InvalidSettingError(f"pipeline layouts (pp > 1) take the built-in GPT-3 and BERT models, not a "
                              f"{type(model).__name__}; use dp and tp for it", argument="layout")  # fmt: skip


def _loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    B, T = idx.shape
    return F.cross_entropy(logits.view(B * T, -1), idx.reshape(B * T))  # as the models' forward


def _blocks(model, type_name: str) -> list[PipelineLayer]:
    def block_forward(block):
        return lambda x, idx: block(x)

    return [PipelineLayer(f"layers.{i}", type_name, (f"layers.{i}",), _params(model, [f"layers.{i}"]),
                          block_forward(block)) for i, block in enumerate(model.layers)]  # fmt: skip


def _gpt_layers(model) -> list[PipelineLayer]:
    """GPTModel.forward, cut at its layers (same operators, same order)."""

    def embedding(x, idx):
        return model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, d)

    embed = ("wte", "wpe")
    return [
        PipelineLayer("embedding", "EmbeddingPipe", embed, _params(model, embed), embedding),
        *_blocks(model, type(model.layers[0]).__name__),
        PipelineLayer("ln_f", "LayerNorm", ("ln_f",), _params(model, ["ln_f"]), lambda x, idx: model.ln_f(x)),
        PipelineLayer("lm_head", "LMHeadPipe", ("lm_head",), _params(model, ["lm_head"]),
                      lambda x, idx: _loss(model.lm_head(x), idx)),
    ]  # fmt: skip


def _bert_layers(model) -> list[PipelineLayer]:
    """BertModel.forward, cut at its layers (same operators, same order)."""

    def embedding(x, idx):
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, d)
        if model.wse is not None:
            x = x + model.wse(torch.zeros_like(idx))
        return model.ln_emb(x)

    def head(x, idx):
        return _loss(model.lm_head(model.head_ln(F.gelu(model.head_dense(x)))), idx)

    embed = ("wte", "wpe", "ln_emb") + (("wse",) if model.wse is not None else ())
    head_modules = ("head_dense", "head_ln", "lm_head")
    return [
        PipelineLayer("embedding", "EmbeddingPipe", embed, _params(model, embed), embedding),
        *_blocks(model, type(model.layers[0]).__name__),
        PipelineLayer("head", "MLMHeadPipe", head_modules, _params(model, head_modules), head),
    ]


def partition_stages(model: torch.nn.Module, stages: int,
                     method: str = DEFAULT_PARTITION_METHOD) -> list[PipelineStage]:  # fmt: skip
    """The model's layers (pipeline_layers) split into ``stages`` stages by ``method`` (partition_layers).

    Counts are of ``model`` as given: pass the unsharded model to partition as DeepSpeed does (PipelineModule
    counts its layers as built, before any tensor-parallel sharding).

    Raises:
        InvalidSettingError: as pipeline_layers and partition_layers.
    """
    layers = pipeline_layers(model)
    bounds = partition_layers(layers, stages, method)
    return [PipelineStage(s, stages, bounds[s], bounds[s + 1], tuple(layers[bounds[s]:bounds[s + 1]]))
            for s in range(stages)]  # fmt: skip


def stage_module_parameters(model: torch.nn.Module, stage: PipelineStage) -> int:
    """Trainable parameters of ``stage``'s modules in ``model`` as it is now (sharded or not), each tensor once."""
    return _params(model, [name for layer in stage.layers for name in layer.modules])


def stage_parameters(config, layout, method: str = DEFAULT_PARTITION_METHOD) -> list[int]:
    """Per pipeline stage of ``layout`` (layout.pp stages), the trainable parameters one of its ranks holds: the
    stage's layers, tensor-parallel sharded by layout.tp (the tied output layer's weight counted on the last
    stage as on the first, as DeepSpeed keeps a copy on both). Built on the meta device: no memory, any size.

    Raises:
        InvalidSettingError: as partition_stages.
    """
    from freqopt.workload.models import build_model
    from freqopt.workload.models.parallel import shard_tensor_parallel

    model = build_model(config)
    stages = partition_stages(model, layout.pp, method)  # unsharded counts, as DeepSpeed partitions
    model = shard_tensor_parallel(model, layout.tp)
    return [stage_module_parameters(model, stage) for stage in stages]
