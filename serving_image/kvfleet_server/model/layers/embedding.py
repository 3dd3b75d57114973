"""Vocabulary embedding whose table is stored by a QuantMethod (model dtype, or packed GGUF).

``VocabEmbedding`` is a ``Linear`` of shape [vocab, hidden] (so the tied lm_head multiplies through
the same method): ``forward(ids [T] int64) → [T, hidden]`` in the model dtype gathers rows;
``project(hidden [N, hidden]) → [N, vocab]`` is the tied output projection. The parameter is still
named ``weight`` (checkpoint name ``embed_tokens.weight``).
"""

from __future__ import annotations

import torch

from .linear import Linear


class VocabEmbedding(Linear):
    def __init__(self, vocab_size: int, hidden_size: int, quant_method=None, params_dtype=None):
        super().__init__(hidden_size, vocab_size, bias=False, quant_method=quant_method, params_dtype=params_dtype,
                         prefix="embed_tokens")
        self.num_embeddings, self.embedding_dim = vocab_size, hidden_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embedding(self, ids)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden, None)
