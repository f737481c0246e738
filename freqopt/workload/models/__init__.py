"""Models freqopt can trace: the GPT-3 family (Brown et al. 2020), BERT (Devlin et al. 2019) and DistilBERT
(Sanh et al. 2019), and any Hugging Face causal LM from its config.json (``hf:PATH``, freqopt.workload.models.hf).

    >>> from freqopt.workload.models import get_workload
    >>> w = get_workload("gpt3-small", micro_batch_size=4)
    >>> w.config.d_model
    768
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from freqopt.errors import InvalidSettingError, check_positive_int
from freqopt.workload.layout import SINGLE_GPU, Layout
from freqopt.workload.models.bert import BERT_CONFIGS, BertConfig, BertModel
from freqopt.workload.models.gpt3 import ATTENTION_PATHS, GPT3_CONFIGS, GPTConfig, GPTModel
from freqopt.workload.models.hf import HFConfig, build_hf_model, is_hf_model, load_hf_config
from freqopt.workload.model_names import check_model_name

__all__ = ["GPTConfig", "GPTModel", "BertConfig", "BertModel", "HFConfig", "ModelConfig", "Workload", "MODELS",
           "DEFAULT_MICRO_BATCH_SIZE", "get_workload", "list_models", "build_model", "count_parameters",
           "config_from_dict"]

ModelConfig = GPTConfig | BertConfig | HFConfig
MODELS: dict[str, ModelConfig] = {**GPT3_CONFIGS, **BERT_CONFIGS}

# Sequences per GPU per step. Small enough that gpt3-small..gpt3-xl train in bf16 without activation
# recomputation on an 80 GB GPU (activations ~34 s b h L bytes, Korthikanti et al. 2022, eq. 2).
DEFAULT_MICRO_BATCH_SIZE = 4


@dataclass(frozen=True)
class Workload:
    """One training iteration of a model: its name, architecture, micro-batch (sequences per model replica per
    step) and parallel layout (the trace is one rank's)."""

    model: str
    config: ModelConfig
    micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE
    layout: Layout = SINGLE_GPU

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.config.seq_len


def list_models() -> list[str]:
    return list(MODELS)


def get_workload(
    model: str, *, micro_batch_size: int | None = None, seq_len: int | None = None, n_heads: int | None = None,
    layout: Layout | None = None, vocab_multiple: int | None = None, attention: str | None = None,
) -> Workload:
    """The named model with optional overrides, on an optional parallel layout (default one GPU).

    Args:
        model: a name of ``list_models()``, or ``hf:PATH`` for a Hugging Face causal LM built from the config.json
            at PATH (a file or a folder holding one; freqopt.workload.models.hf); its Workload.model is ``hf:`` and the
            config's folder name.
        micro_batch_size: sequences per model replica per step (default 4).
        seq_len: tokens per sequence (default the model's context: 2048 for GPT-3, 512 for BERT; for ``hf:`` the
            config's max_position_embeddings up to 2048).
        n_heads: attention heads; must divide d_model (built-in models only).
        layout: data- and tensor-parallel degrees (default one GPU).
        vocab_multiple: pad the embedding and output layer's vocabulary to a multiple of this (default the model's:
            128 for the GPT-3 family, as Megatron-LM; 1 for BERT); 1 = no padding (built-in models only).
        attention: how the GPT-3 family's attention calls its fused kernel (freqopt.workload.models.gpt3.ATTENTION_PATHS):
            "flash" (the default: freqopt.flash_attention, FlashAttention-2 on a GPU) or "sdpa" (PyTorch's
            F.scaled_dot_product_attention, whose kernel PyTorch picks: cuDNN's on Hopper); GPT-3 models only.

    Raises:
        UnknownNameError: unknown model; the message lists the known ones.
        InvalidSettingError: a non-positive override, heads that do not divide d_model, an ``attention`` not in
            ATTENTION_PATHS or given for a model outside the GPT-3 family, or a tensor-parallel degree that does not
            divide the heads (and, for ``hf:``, the key/value heads).
        FreqoptError: for ``hf:PATH``, also the errors of ``freqopt.workload.models.hf.load_hf_config``
            (transformers missing, no config or a corrupt one at PATH).
    """
    if is_hf_model(model):
        if attention is not None:
            raise InvalidSettingError(f"attention applies to the GPT-3 models; {model} runs its config's attention",
                                      argument="attention")  # fmt: skip
        return _hf_workload(model, micro_batch_size, seq_len, n_heads, layout, vocab_multiple)
    check_model_name(model)
    config = MODELS[model]
    if attention is not None:
        if not isinstance(config, GPTConfig) or attention not in ATTENTION_PATHS:
            raise InvalidSettingError(f"attention {attention!r}: one of {', '.join(ATTENTION_PATHS)}, for the GPT-3 "
                                      "models only", argument="attention")  # fmt: skip
        config = dataclasses.replace(config, attention=attention)
    for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len), ("n_heads", n_heads),
                        ("vocab_multiple", vocab_multiple)):  # fmt: skip
        check_positive_int(name, value, optional=True)
    if seq_len is not None:
        config = dataclasses.replace(config, seq_len=seq_len)
    if vocab_multiple is not None:
        config = dataclasses.replace(config, vocab_multiple=vocab_multiple)
    if n_heads is not None:
        if config.d_model % n_heads:
            raise InvalidSettingError(
                f"n_heads {n_heads} does not divide d_model {config.d_model} of {model}; pick a divisor",
                argument="n_heads",
            )
        config = dataclasses.replace(config, n_heads=n_heads)
    layout = layout or SINGLE_GPU
    layout.check_model(model, config.n_heads)
    return Workload(model, config, micro_batch_size or DEFAULT_MICRO_BATCH_SIZE, layout)


def _hf_workload(model, micro_batch_size, seq_len, n_heads, layout, vocab_multiple) -> Workload:
    check_positive_int("micro_batch_size", micro_batch_size, optional=True)
    check_positive_int("seq_len", seq_len, optional=True)
    for name, value in (("n_heads", n_heads), ("vocab_multiple", vocab_multiple)):
        if value is not None:
            raise InvalidSettingError(f"{name} applies to the built-in models; for {model} edit its config.json",
                                      argument=name)  # fmt: skip
    config = load_hf_config(model, seq_len=seq_len)
    layout = layout or SINGLE_GPU
    layout.check_model(config.name, config.n_heads)
    if config.n_kv_heads % layout.tp:
        raise InvalidSettingError(
            f"tensor-parallel degree tp={layout.tp} does not divide the {config.n_kv_heads} key/value heads of "
            f"{config.name}; choose tp from {', '.join(str(d) for d in range(1, config.n_kv_heads + 1) if config.n_kv_heads % d == 0)}"
        )
    return Workload(config.name, config, micro_batch_size or DEFAULT_MICRO_BATCH_SIZE, layout)


def config_from_dict(model: str, data: dict) -> ModelConfig:
    """The config of ``model`` from ``dataclasses.asdict`` of it (a search job's record): an HFConfig for ``hf:``
    names, else the built-in config's type."""
    if is_hf_model(model):
        return HFConfig(**data)
    check_model_name(model)
    return type(MODELS[model])(**data)


def build_model(config: ModelConfig, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16):
    """The model's module on ``device``; on "meta" it holds no memory, at any size. An HFConfig builds an
    HFCausalLM (freqopt.workload.models.hf), which takes (idx, targets) as the built-in models do."""
    if isinstance(config, HFConfig):
        return build_hf_model(config, device=device, dtype=dtype)
    module = BertModel if isinstance(config, BertConfig) else GPTModel
    with torch.device(device):
        return module(config).to(dtype)


def count_parameters(config: ModelConfig, tp: int = 1) -> int:
    """Parameters of the module (tied weights counted once) held by one of ``tp`` tensor-parallel ranks,
    computed on the meta device."""
    from freqopt.workload.models.parallel import shard_tensor_parallel

    return sum(p.numel() for p in shard_tensor_parallel(build_model(config), tp).parameters())
