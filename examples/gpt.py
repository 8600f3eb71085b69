"""A small GPT-style language model and a deterministic byte-level data source for it.

The model is deliberately ordinary (pre-LN blocks, causal attention, tied embeddings, dropout) so
that checkpointing it exercises what real trainers have: parameters shared under two state-dict
names, a stochastic forward pass that depends on the global RNG, and an optimizer with per-group
settings. Sizes are fields of :class:`GPTConfig`, so the same code yields a toy for tests or a
state of a few GB for benchmarks.

The data source is synthetic so that the demo needs no download, yet it has structure (a fixed
vocabulary of "words" and a Markov chain over them), so the loss visibly falls. Its position and
generator state are checkpointed with everything else: resuming a run must also resume its data.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. The defaults train in seconds on a laptop CPU.

    About ``12 * n_layers * d_model**2`` parameters sit in the blocks; e.g. ``d_model=1024,
    n_layers=12`` gives ~150M parameters, ~1.8 GB with AdamW's two moments.
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.proj(out.transpose(1, 2).reshape(batch, seq, width)))


class Block(nn.Module):
    """Pre-LN transformer block: normalising before each sublayer keeps deep stacks trainable."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        hidden = config.mlp_ratio * config.d_model
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, hidden),
            nn.GELU(),
            nn.Linear(hidden, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns ``(logits, loss or None)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Tied: one tensor under two state-dict names, which a checkpointer must store once and
        # restore so that the two stay one parameter.
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat in depth.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than seq_len={self.config.seq_len}")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Decay matrices only: decaying biases and LayerNorm gains just pulls them off their useful scale."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class TokenStream:
    """Endless batches ``(x, y)`` of byte-level "text", ``y`` being ``x`` shifted by one byte.

    The language (words and which word may follow which) is fixed by ``seed``; sampling from it
    uses a generator of its own so that the data order does not depend on, or disturb, the global
    torch RNG that dropout draws from. ``state_dict()`` holds what changes while training (the
    batch count and the generator state) plus the settings, so that restoring into a stream built
    differently fails loudly instead of silently yielding other data.
    """

    N_WORDS = 64
    SUCCESSORS = 4

    def __init__(self, batch_size: int, seq_len: int, seed: int = 0) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = 0
        language = torch.Generator().manual_seed(seed)
        letters = torch.randint(ord("a"), ord("z") + 1, (self.N_WORDS, 8), generator=language)
        lengths = torch.randint(2, 9, (self.N_WORDS,), generator=language)
        self.words = [bytes(row[:n].tolist()) + b" " for row, n in zip(letters, lengths.tolist(), strict=True)]
        # Each word is followed by one of a few words, with skewed probabilities: learnable structure.
        successors = torch.stack([torch.randperm(self.N_WORDS, generator=language)[: self.SUCCESSORS]
                                  for _ in range(self.N_WORDS)])
        weights = torch.rand(self.N_WORDS, self.SUCCESSORS, generator=language) ** 2 + 0.05
        self.transitions = torch.zeros(self.N_WORDS, self.N_WORDS).scatter_(1, successors, weights)
        # Every word is at least 3 bytes with its space, so this many always fill a sequence.
        self.words_per_row = (seq_len + 1) // 3 + 1
        self.generator = torch.Generator().manual_seed(seed + 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        current = torch.randint(self.N_WORDS, (self.batch_size,), generator=self.generator)
        chain = [current]
        for _ in range(self.words_per_row - 1):
            current = torch.multinomial(self.transitions[current], 1, generator=self.generator).squeeze(1)
            chain.append(current)
        rows = torch.stack(chain, dim=1).tolist()
        text = b"".join(b"".join(self.words[w] for w in row)[: self.seq_len + 1] for row in rows)
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long().view(self.batch_size, self.seq_len + 1)
        self.position += 1
        return tokens[:, :-1], tokens[:, 1:]

    def _settings(self) -> dict[str, int]:
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {**self._settings(), "position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {key: state[key] for key in self._settings()}
        if saved != self._settings():
            raise ValueError(f"TokenStream state was saved with {saved}, this stream has {self._settings()}")
        self.position = state["position"]
        self.generator.set_state(state["generator"])
