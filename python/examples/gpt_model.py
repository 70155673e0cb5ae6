"""A small GPT-style decoder in plain torch.nn, and the loss and optimizer its runs share.

Token embedding + learned position embedding, ``n_layers`` pre-LayerNorm blocks (causal
self-attention: one qkv Linear, ``F.scaled_dot_product_attention(is_causal=True)``, an output
Linear; MLP: Linear to 4x, GELU, Linear back), a final LayerNorm and an LM head (tied to the
token embedding when ``tie_embeddings``). The blocks are the ``nn.ModuleList`` ``blocks``, the
unit ``fully_shard`` wraps. The default config has about 3.3 M parameters.

Initialization is a function of ``GPTConfig.seed`` alone (a private ``torch.Generator``), so
every rank of a job builds bitwise the same model. ``lm_loss`` computes cross-entropy in fp32
whatever the logits' dtype; ``make_optimizer`` is the AdamW every run of the example uses.

Run ``python gpt_model.py`` to print the parameter count and one forward's loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    tie_embeddings: bool = False
    seed: int = 0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads != 0:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of n_heads {cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, unit LayerNorm; residual outputs / sqrt(2L)."""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.cfg.tie_embeddings:
                    continue
                std = residual_std if name.endswith(".proj") else 0.02
                module.weight.normal_(0.0, std, generator=gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] of int64 ``tokens`` [batch, seq]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_optimizer(params: Iterable[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with fixed hyperparameters. ``foreach=False`` pins the single-tensor implementation
    (what CPU tensors get by default) so the update's arithmetic does not depend on the device."""
    return torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, foreach=False
    )


def main() -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig()
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    print(f"{cfg}\n{n_params} parameters; loss on random tokens {loss.item():.4f} (ln 256 = {math.log(256):.4f})")


if __name__ == "__main__":
    main()
