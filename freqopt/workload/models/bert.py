"""BERT and DistilBERT as PyTorch modules, trained with the masked-language-model objective.

BERT (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers", section 3 and appendix A):
post-layer-norm encoder blocks, GELU MLPs of width 4 d_model, learned position and segment embeddings, and the
MLM head (dense + GELU + layer norm, then an output layer tied to the token embedding, with a bias).
DistilBERT (Sanh et al. 2019, arXiv 1910.01108): BERT-base with half the layers and no segment embeddings.
Linear layers carry the names DeepSpeed AutoTP recognizes, as in gpt3.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from freqopt.workload.models.gpt3 import AttentionShape, init_weights
from freqopt.workload.models.ops import flash_attention

__all__ = ["BertConfig", "BertModel", "BERT_CONFIGS"]


@dataclass(frozen=True)
class BertConfig(AttentionShape):
    """A BERT model's shape. The vocabulary is not padded by default (``vocab_multiple`` 1): 30522 rows, as in
    HF bert-base-uncased, which the V100 calibration data of McDonald et al. 2022 ran."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int = 30522  # WordPiece vocabulary of the uncased BERT checkpoints
    seq_len: int = 512  # max_position_embeddings of BERT and DistilBERT
    segment_embeddings: bool = True  # BERT's token-type embeddings; DistilBERT drops them
    causal: bool = False  # bidirectional attention
    ffn_mult: int = 4
    vocab_multiple: int = 1  # embedding and output rows: vocab_size rounded up to a multiple of this


BERT_CONFIGS: dict[str, BertConfig] = {
    "bert-base": BertConfig(n_layers=12, d_model=768, n_heads=12),  # 110M (Devlin et al. 2019)
    "bert-large": BertConfig(n_layers=24, d_model=1024, n_heads=16),  # 340M
    "distilbert": BertConfig(n_layers=6, d_model=768, n_heads=12, segment_embeddings=False),  # 66M (Sanh 2019)
}


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        d = config.d_model
        self.head_dim = config.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, d)
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        y = flash_attention(q, k, v, False).transpose(1, 2).reshape(B, T, -1)  # (B, T, d)
        return self.o_proj(y)


class EncoderBlock(nn.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        d = config.d_model
        self.attn = SelfAttention(config)
        self.ln_1 = nn.LayerNorm(d, eps=1e-12)
        self.up_proj = nn.Linear(d, config.ffn_mult * d)
        self.down_proj = nn.Linear(config.ffn_mult * d, d)
        self.ln_2 = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x))  # (B, T, d)
        return self.ln_2(x + self.down_proj(F.gelu(self.up_proj(x))))  # (B, T, d)


class BertModel(nn.Module):
    """BertModel(config)(idx, targets) -> MLM cross-entropy; (idx) -> logits (B, T, V), V the padded vocabulary
    (``config.padded_vocab_size``). idx, targets (B, T) token ids below ``config.vocab_size``, of any strides."""

    def __init__(self, config: BertConfig):
        super().__init__()
        d = config.d_model
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, d)
        self.wpe = nn.Embedding(config.seq_len, d)
        self.wse = nn.Embedding(2, d) if config.segment_embeddings else None
        self.ln_emb = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_layers))
        self.head_dense = nn.Linear(d, d)
        self.head_ln = nn.LayerNorm(d, eps=1e-12)
        self.lm_head = nn.Linear(d, config.padded_vocab_size)
        self.lm_head.weight = self.wte.weight  # tied, as in BERT's MLM head
        self.apply(init_weights)  # N(0, 0.02), as BERT (Devlin et al. 2019)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, d)
        if self.wse is not None:
            x = x + self.wse(torch.zeros_like(idx))  # one segment
        x = self.ln_emb(x)
        for block in self.layers:
            x = block(x)  # (B, T, d)
        logits = self.lm_head(self.head_ln(F.gelu(self.head_dense(x))))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
