"""A small byte-level GPT: the model the default job trains.

Pre-norm transformer blocks with causal attention through
``F.scaled_dot_product_attention`` (the fused kernel where the device has one),
a learned position embedding and an output head tied to the token embedding.
The blocks live in ``self.blocks`` so that FSDP can wrap them one by one;
``pipeline_layers()`` gives the model as the chain a pipeline cuts (embeddings, each
block, norm + head).
"""

from __future__ import annotations

import functools
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


class ResidualProjection(nn.Linear):
    """A linear map into the residual stream, initialized with GPT-2's smaller deviation
    (0.02 / sqrt(2 x layers)), which keeps early updates stable."""

    def __init__(self, d_in: int, d_out: int, n_layer: int) -> None:
        super().__init__(d_in, d_out)
        self.init_std = 0.02 / math.sqrt(2 * n_layer)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention. Under CPU autocast (bfloat16 or float16) it runs in float32 on the
    16-bit inputs: torch's CPU attention kernels are slower in bfloat16 than in float32 (the
    backward 2.5-4.7x here, AVX512-BF16; float16 has no arithmetic on most CPUs), and the
    softmax gains precision. On a GPU autocast's choice stands."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            y = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), is_causal=True, dropout_p=dropout_p
            )
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


def project_out(head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The output projection, in float32 also under autocast (any device). bfloat16 logits
    keep about three significant digits -- an error of ~0.04 on a logit of 10, in every
    log-probability the loss sees -- and the default job trained measurably worse with them:
    a final validation loss 1.028x float32's (mean of three seeds), 0.997x with float32
    logits (docs/benchmarks.md). The projection is small next to the blocks (vocabulary 256:
    about 4% of a bf16 step here)."""
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return head(x.float())
    return head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        # One projection for queries, keys and values, its outputs grouped by head (q, k, v
        # of head 0, then of head 1, ...): cut into equal contiguous parts, as tensor
        # parallelism cuts it, every part holds whole heads.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = ResidualProjection(cfg.d_model, cfg.d_model, cfg.n_layer)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # The head count comes from the projection's output: under tensor parallelism a rank
        # computes only its own heads.
        qkv = self.qkv(x).view(batch, time, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        y = attend(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, time, -1)
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
            ResidualProjection(4 * cfg.d_model, cfg.d_model, cfg.n_layer),
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
        # GPT-2's init at 0.02, then the residual projections' own (init_std) drawn again: the
        # order of draws every eagerly built GPT has had (the default job's losses pin it).
        self.apply(functools.partial(self.init_weights, scaled=False))
        for module in self.modules():
            if isinstance(module, ResidualProjection):
                nn.init.normal_(module.weight, mean=0.0, std=module.init_std)

    @staticmethod
    def init_weights(module: nn.Module, scaled: bool = True) -> None:
        """The tensors ``module`` holds itself, for a model built on the meta device
        (``Task.init_weights``): the distributions of the constructor's init, drawn in one
        pass over the modules (so its values differ from an eagerly built GPT's). ``scaled``
        false: every linear map at 0.02 (the constructor's first pass)."""
        if isinstance(module, nn.Linear):
            std = module.init_std if scaled and isinstance(module, ResidualProjection) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` to next-token logits ``(B, T, vocab)``."""
        _, time = idx.shape
        if time > self.cfg.seq_len:
            raise ValueError(f"sequence of {time} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(time, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return project_out(self.head, self.ln_f(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as a chain of layers for pipeline stages: embeddings, each block, norm +
        head. The layers share this model's modules (no copies), so the chain computes exactly
        ``self(idx)``."""
        return [GPTEmbedding(self), *self.blocks, GPTHead(self)]

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """Which linear maps tensor parallelism cuts, and how: in each block the attention's
        heads and the MLP's hidden units are split over ``degree`` ranks (Megatron-style:
        column-wise in, row-wise out, so each block needs one all-reduce forward and one
        backward). Everything else is replicated."""
        if self.cfg.n_head % degree or (4 * self.cfg.d_model) % degree:
            raise ValueError(
                f"n_head = {self.cfg.n_head} and 4 x d_model = {4 * self.cfg.d_model} must be "
                f"multiples of the tensor-parallel degree {degree}"
            )
        plan: dict[str, str] = {}
        for index in range(len(self.blocks)):
            prefix = f"blocks.{index}"
            plan[f"{prefix}.attn.qkv"] = "colwise"
            plan[f"{prefix}.attn.proj"] = "rowwise"
            plan[f"{prefix}.mlp.0"] = "colwise"
            plan[f"{prefix}.mlp.2"] = "rowwise"
        return plan

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
        return project_out(self.head, self.ln_f(x))
