"""Hugging Face language models as freqopt workloads: ``get_workload("hf:PATH")``.

PATH is a ``config.json`` or a folder holding one (a local path; nothing is downloaded). The model is built from
the config alone with ``transformers.AutoModelForCausalLM.from_config`` (``AutoModelForMaskedLM`` for an encoder
such as BERT, trained as a masked LM: HFConfig.task) on the meta device in bf16, so it holds no
weights and costs nothing at any size, with ``attn_implementation="sdpa"`` (attention through
``torch.nn.functional.scaled_dot_product_attention``, which the tracer records as one fused FlashAttention kernel
each way: freqopt.workload.models.sdpa) and ``use_cache=False`` (training keeps no key/value cache).

Tested on Llama, Mistral, Qwen2 (RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention) and GPT-2
(LayerNorm, GELU, learned positions, a fused q/k/v ``Conv1D``) configs in tests/data/hf. What the trace shows is
what HF's eager modules launch: e.g. RMSNorm as separate pow/mean/rsqrt/mul kernels, rotary embeddings as
elementwise kernels, and the loss over the logits upcast to float32. Mixture-of-experts configs (Mixtral, Qwen2-MoE,
DeepSeek-V3 in tests/data/hf) build with transformers' default "grouped_mm" experts, traced as grouped GEMMs
(freqopt.workload.moe).

transformers is an optional dependency: ``pip install 'transformers>=4.47' 'accelerate>=1.1'``, or ``pip install -e
'.[hf]'`` in the freqopt checkout (freqopt.errors.install_hint).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from freqopt.errors import InvalidSettingError, UnknownNameError, install_hint

__all__ = ["HF_PREFIX", "DEFAULT_HF_SEQ_LEN", "HFConfig", "HFCausalLM", "is_hf_model", "load_hf_config",
           "build_hf_model"]

from freqopt.workload.model_names import HF_PREFIX, read_hf_config_json  # noqa: E402  (one spelling of the prefix)
# Tokens per sequence when the config allows more: 2048, GPT-3's context (freqopt's default workload size), so
# that a model with a 128k context is not traced at 128k tokens unless asked (seq_len=...).
DEFAULT_HF_SEQ_LEN = 2048
_INSTALL = f"Hugging Face models need transformers: {install_hint('hf')}"


def is_hf_model(name: str) -> bool:
    """Whether a model name asks for a Hugging Face config (``hf:PATH``)."""
    return isinstance(name, str) and name.startswith(HF_PREFIX)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UnknownNameError(_INSTALL) from None
    return transformers


@dataclass(frozen=True)
class HFConfig:
    """A Hugging Face causal-LM config as a frozen, hashable freqopt model config.

    Attributes:
        name: the model's display name, ``hf:`` and the config's folder name (``hf:llama``).
        config_json: the whole HF config as JSON (sorted keys), from which ``build_hf_model`` rebuilds the model;
            it makes two configs of the same folder name distinct (study names hash the config).
        seq_len: tokens per sequence (default min(max_position_embeddings, DEFAULT_HF_SEQ_LEN)).
        n_layers, d_model, n_heads, n_kv_heads, head_dim, vocab_size: the architecture, read from the config.
        tied_embeddings: the output layer shares the token embedding's weight.
        max_seq_len: the longest sequence the config allows (max_position_embeddings or n_positions).
        task: "causal-lm" (AutoModelForCausalLM: decoders, GPT-2, Llama, ...) or "masked-lm"
            (AutoModelForMaskedLM: encoders such as BERT and RoBERTa, as they are pre-trained: bidirectional
            attention, the loss over every position's logits).
    """

    name: str
    config_json: str
    seq_len: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    max_seq_len: int
    task: str = "causal-lm"

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output layer: HF's vocab_size as the config gives it (no padding)."""
        return self.vocab_size

    vocab_multiple = 1  # no padding beyond what the config's vocab_size holds

    @property
    def causal(self) -> bool:
        """Causal attention (a decoder trained as a causal LM); False for a masked LM's bidirectional attention."""
        return self.task == "causal-lm"

    @property
    def model_type(self) -> str:
        return json.loads(self.config_json)["model_type"]

    def hf_config(self):
        """The transformers config object (raises UnknownNameError without transformers)."""
        transformers = _transformers()
        data = json.loads(self.config_json)
        return transformers.AutoConfig.for_model(**data)


def load_hf_config(model: str, *, seq_len: int | None = None) -> HFConfig:
    """The HFConfig of ``hf:PATH``, read with ``transformers.AutoConfig`` from a local config.json.

    Args:
        model: ``hf:`` and a config.json or a folder holding one.
        seq_len: tokens per sequence; at most the config's max_position_embeddings.

    Raises:
        UnknownNameError: transformers missing (says how to install it), no config at PATH, or a
            model_type transformers does not know or that is no causal or masked language model (the message says
            how to trace it with freqopt.trace_step instead).
        InvalidSettingError: an unreadable or corrupt config, or seq_len beyond the config's positions.
    """
    transformers = _transformers()
    path = Path(model[len(HF_PREFIX):]).expanduser()
    read_hf_config_json(path)  # clear errors for a missing or corrupt file before transformers reads it
    folder = (path if path.is_dir() else path.parent).resolve().name or "model"
    name = HF_PREFIX + re.sub(r"[^A-Za-z0-9._-]+", "_", folder)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UnknownNameError(f"transformers cannot build the config {str(path)!r}: {str(e).splitlines()[0]}") from None
    task = _task(transformers, config)
    if task is None:
        raise UnknownNameError(_not_a_language_model(transformers, config, path))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_heads = text.num_attention_heads
    n_kv_heads = getattr(text, "num_key_value_heads", None) or n_heads
    d_model = text.hidden_size
    head_dim = getattr(text, "head_dim", None) or d_model // n_heads
    max_seq_len = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if max_seq_len is None:
        raise InvalidSettingError(f"{str(path)!r} gives no max_position_embeddings; the sequence length is unknown")
    if seq_len is not None and seq_len > max_seq_len:
        raise InvalidSettingError(f"seq_len {seq_len} exceeds the {max_seq_len} positions of {str(path)!r}")
    tied = bool(getattr(config, "tie_word_embeddings", True))
    return HFConfig(
        name=name, config_json=json.dumps(config.to_dict(), sort_keys=True, default=str),
        seq_len=seq_len or min(max_seq_len, DEFAULT_HF_SEQ_LEN), n_layers=text.num_hidden_layers, d_model=d_model,
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=text.vocab_size,
        tied_embeddings=tied, max_seq_len=max_seq_len, task=task,
    )  # fmt: skip


def _task(transformers, config) -> str | None:
    """How a model of ``config`` is trained: "masked-lm" for an encoder (transformers has a masked LM for its type
    and the config is not a decoder's: BERT is pre-trained so, not as the BertLMHeadModel its causal mapping
    names), else "causal-lm" where transformers has a causal LM for it; None for neither."""
    if type(config) in transformers.AutoModelForMaskedLM._model_mapping and not getattr(config, "is_decoder", False):
        return "masked-lm"
    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        return "causal-lm"
    return None


# What to trace with freqopt.trace_step where hf: builds no model: (the transformers auto class whose mapping holds
# the config, what it is, the step to trace, one line). Both traced so in tests/test_hf.py.
_TRACE_STEP_EXAMPLES = (
    ("AutoModelForSeq2SeqLM", "a sequence-to-sequence LM",
     "m = AutoModelForSeq2SeqLM.from_config(config) under torch.device('meta'), then freqopt.trace_step(lambda: "
     "(m(input_ids=x, labels=y).loss.backward(), opt.step()), name='t5', module=m)"),
    ("AutoModelForImageClassification", "an image classifier",
     "m = AutoModelForImageClassification.from_config(config) under torch.device('meta'), then "
     "freqopt.trace_step(lambda: (m(pixel_values=x, labels=y).loss.backward(), opt.step()), name='vit', module=m)"),
)


def _not_a_language_model(transformers, config, path: Path) -> str:
    """The one-line refusal of a config that hf: cannot train: freqopt's hf: builds causal and masked language
    models only (token ids in, a language model's loss out); where the model is one transformers builds otherwise,
    how to trace its step with freqopt.trace_step instead."""
    where = f"{str(path)!r} (model_type {config.model_type!r})"
    for auto, what, example in _TRACE_STEP_EXAMPLES:
        mapping = getattr(getattr(transformers, auto, None), "_model_mapping", None)
        if mapping is not None and type(config) in mapping:
            return (f"{where} is {what} ({auto}); freqopt's hf: models are causal and masked language models only, "
                    f"so trace its training step with freqopt.trace_step on the meta device instead: {example}")
    return (f"{where}: freqopt's hf: models are causal and masked language models only, and transformers has "
            "neither for it; trace its training step with freqopt.trace_step(step_fn, name=..., module=model) on "
            "the meta device instead")


class HFCausalLM(nn.Module):
    """A Hugging Face language model with the built-in models' calling convention: ``(idx, targets)`` -> the loss
    HF computes (``model(input_ids=idx, labels=targets).loss``: a causal LM shifts the labels by one itself, so pass
    the input ids as targets; a masked LM takes them as they are, its loss over every position, as the masked
    positions' loss costs the same kernels), ``(idx)`` -> logits (B, T, V). idx, targets (B, T) token ids below
    vocab_size."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return self.model(input_ids=idx).logits
        return self.model(input_ids=idx, labels=targets).loss


def build_hf_model(config: HFConfig, *, device: str | torch.device = "meta",
                   dtype: torch.dtype = torch.bfloat16) -> HFCausalLM:  # fmt: skip
    """The model of ``config`` on ``device`` (no weights loaded; on "meta" no memory), in training mode, with
    SDPA attention and no key/value cache."""
    transformers = _transformers()
    hf_config = config.hf_config()
    hf_config.use_cache = False
    auto = transformers.AutoModelForMaskedLM if config.task == "masked-lm" else transformers.AutoModelForCausalLM
    try:
        with torch.device(device):
            try:
                model = auto.from_config(hf_config, attn_implementation="sdpa", dtype=dtype)
            except ValueError as e:
                if "scaled_dot_product_attention" not in str(e):
                    raise
                # transformers has no SDPA path for this architecture (Gemma-2 in 5.x: its attention soft-caps the
                # logits): it then runs eager attention, separate GEMMs and a softmax, which is what is traced.
                warnings.warn(f"{config.name}: transformers has no SDPA attention for model_type "
                              f"{config.model_type!r}; traced with its eager attention (unfused GEMMs and softmax), "
                              "as transformers runs it", UserWarning, stacklevel=2)  # fmt: skip
                model = auto.from_config(hf_config, attn_implementation="eager", dtype=dtype)
    except (ValueError, TypeError, AssertionError, RuntimeError, KeyError, AttributeError, NotImplementedError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InvalidSettingError(f"transformers cannot build {config.name} (model_type {config.model_type!r}) from "
                                  f"its config: {first}; check the config's sizes and token ids") from None  # fmt: skip
    return HFCausalLM(model.train())
