"""A language model's tied embedding and output projection, the tests' smallest model whose one
Parameter is listed under two keys (``emb.weight`` and ``head.weight``)."""

from __future__ import annotations

import torch


class TiedLM(torch.nn.Module):
    def __init__(self, seed: int, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))
