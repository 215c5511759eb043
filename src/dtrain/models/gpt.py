"""A small byte-level GPT: the model the default job trains.

Pre-norm transformer blocks with causal attention through
``F.scaled_dot_product_attention`` (the fused kernel where the device has one),
a learned position embedding and an output head tied to the token embedding.
The blocks live in ``self.blocks`` so that FSDP can wrap them one by one;
``pipeline_layers()`` gives the model as the chain a pipeline cuts (embeddings, each
block, norm + head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: fewer parameters, faster learning
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps early updates stable.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` to next-token logits ``(B, T, vocab)``."""
        _, time = idx.shape
        if time > self.cfg.seq_len:
            raise ValueError(f"sequence of {time} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a chain of layers for pipeline stages: embeddings, each block, norm +
        head. The layers share this model's modules (no copies), so the chain computes exactly
        ``self(idx)``."""
        return [GPTEmbedding(self), *self.blocks, GPTHead(self)]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.seq_len :])[:, -1, :] / max(temperature, 1e-5)
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


class GPTEmbedding(nn.Module):
    """The GPT's first pipeline layer: token + position embeddings."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class GPTHead(nn.Module):
    """The GPT's last pipeline layer: final norm and the (tied) output projection."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))
