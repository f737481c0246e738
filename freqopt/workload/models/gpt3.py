"""The GPT-3 family as PyTorch modules (Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1).

A decoder-only transformer with pre-layer-norm blocks, learned position embeddings, GELU MLPs of width
4 d_model and an output layer tied to the token embedding. Dense attention in every layer (GPT-3 alternated
dense and locally banded sparse layers; dense is what GPU training runs today). Linear layers carry the
names DeepSpeed AutoTP recognizes (q_proj, k_proj, v_proj, o_proj, up_proj, down_proj) and the blocks sit in
an nn.ModuleList, so the same module trains tensor-parallel under DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from freqopt.workload.models.ops import flash_attention

__all__ = ["GPTConfig", "GPTModel", "GPT3_CONFIGS", "init_weights", "ATTENTION_PATHS"]

# How a model's attention calls its fused kernel (GPTConfig.attention):
# * "flash": freqopt.flash_attention (freqopt.workload.models.ops), which on a CUDA GPU always runs FlashAttention-2
#   (aten._scaled_dot_product_flash_attention); traced as freqopt.flash_attention and its backward.
# * "sdpa": torch.nn.functional.scaled_dot_product_attention, whose kernel PyTorch picks: cuDNN's fused attention on
#   Hopper with PyTorch 2.11 (the kernels the measured H100 steps of experiments/data/h100/whole_steps ran: their
#   torch.profiler names are cudnn_generated_fort_native_sdpa_sm90_flash_*), FlashAttention-2 on Ampere; traced as
#   freqopt.workload.models.sdpa.SDPA_KERNEL_NAMES, which a GPU file rates apart (GPUSpec.attention_rate_rel).
ATTENTION_PATHS = ("flash", "sdpa")


class AttentionShape:
    """Shared by model configs with ``d_model``, ``n_heads``, ``vocab_size`` and ``vocab_multiple``: the heads must
    divide the width, and the embedding and output layers hold the vocabulary padded to ``vocab_multiple``."""

    d_model: int
    n_heads: int
    vocab_size: int
    vocab_multiple: int

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads {self.n_heads} does not divide d_model {self.d_model}")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be a positive integer, not {self.vocab_multiple}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the token embedding and output layer: ``vocab_size`` rounded up to a multiple of
        ``vocab_multiple``. Tokens stay below ``vocab_size``; the padding rows are never a target."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


@dataclass(frozen=True)
class GPTConfig(AttentionShape):
    """A GPT-3 model's shape. ``vocab_size`` is the tokenizer's; the embedding and output layer hold
    ``padded_vocab_size`` rows (50304 for GPT-3's 50257 at the default ``vocab_multiple`` 128)."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int = 50257  # GPT-2/GPT-3 byte-pair vocabulary (Brown et al. 2020, section 2.1)
    seq_len: int = 2048  # n_ctx of every GPT-3 model (Table 2.1)
    causal: bool = True  # decoder: each token attends to earlier tokens only
    bias: bool = True  # GPT-2/GPT-3 linear layers and layer norms carry biases
    ffn_mult: int = 4  # d_ff = 4 d_model (Table 2.1)
    # Embedding and output rows padded to a multiple of 128 (Megatron-LM's --make-vocab-size-divisible-by 128;
    # nanoGPT pads GPT-2's 50257 to 50304): a logit GEMM with N = 50257 ran 4.5x slower than the roofline on an
    # H100. 1: no padding.
    vocab_multiple: int = 128
    attention: str = "flash"  # ATTENTION_PATHS: freqopt's FlashAttention-2 op, or PyTorch's SDPA (its kernel choice)

    def __post_init__(self):
        super().__post_init__()
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, not {self.attention!r}")


# Table 2.1 of Brown et al. 2020. Two rows of the table do not multiply out, and d_head is kept:
# XL prints 24 heads of 128 for d_model 2048 (24 x 128 = 3072): 16 heads of 128, as llm.c and Spaan et al. 2026 run it;
# 13B prints d_model 5140 with 40 heads of 128: 5120 = 40 x 128.
GPT3_CONFIGS: dict[str, GPTConfig] = {
    "gpt3-small": GPTConfig(n_layers=12, d_model=768, n_heads=12),
    "gpt3-medium": GPTConfig(n_layers=24, d_model=1024, n_heads=16),
    "gpt3-large": GPTConfig(n_layers=24, d_model=1536, n_heads=16),
    "gpt3-xl": GPTConfig(n_layers=24, d_model=2048, n_heads=16),
    "gpt3-2.7b": GPTConfig(n_layers=32, d_model=2560, n_heads=32),
    "gpt3-6.7b": GPTConfig(n_layers=32, d_model=4096, n_heads=32),
    "gpt3-13b": GPTConfig(n_layers=40, d_model=5120, n_heads=40),
    "gpt3-175b": GPTConfig(n_layers=96, d_model=12288, n_heads=96),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.head_dim, self.causal, self.attention = config.head_dim, config.causal, config.attention
        self.q_proj = nn.Linear(d, d, bias=config.bias)
        self.k_proj = nn.Linear(d, d, bias=config.bias)
        self.v_proj = nn.Linear(d, d, bias=config.bias)
        self.o_proj = nn.Linear(d, d, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, d)
        # -1 heads: under AutoTP the projections are column-parallel and each rank holds nh / tp heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        if self.attention == "sdpa":  # PyTorch picks the kernel (ATTENTION_PATHS); traced through FusedSDPA
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, nh, T, hs)
        else:
            y = flash_attention(q, k, v, self.causal)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d)
        return self.o_proj(y)  # (B, T, d)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, config.ffn_mult * config.d_model, bias=config.bias)
        self.down_proj = nn.Linear(config.ffn_mult * config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))  # (B, T, d) -> (B, T, 4d) -> (B, T, d)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, d)
        return x + self.mlp(self.ln_2(x))  # (B, T, d)


def init_weights(module: nn.Module) -> None:
    """GPT-2/GPT-3 initialization (Radford et al. 2019): weights N(0, 0.02), biases zero; layer norms as PyTorch
    sets them (weight 1, bias 0). Without it, nn.Embedding's N(0, 1) makes the tied output layer's logits ~30 wide.
    On the meta device it costs nothing."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPTModel(nn.Module):
    """GPTModel(config)(idx, targets) -> mean cross-entropy loss; (idx) -> logits (B, T, V), V the padded
    vocabulary (``config.padded_vocab_size``). idx, targets (B, T) token ids below ``config.vocab_size``, of any
    strides (targets sliced from a token batch are not contiguous)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (GPT-2, Radford et al. 2019)
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, d)
        for block in self.layers:
            x = block(x)  # (B, T, d)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
