"""Vocabulary embedding whose table is stored by a QuantMethod (model dtype, or packed GGUF), split
over the vocabulary under tensor parallelism.

``VocabEmbedding`` is a ``Linear`` of shape [vocab, hidden] (so the tied lm_head multiplies through
the same method): ``forward(ids [T] int64) → [T, hidden]`` in the model dtype gathers rows;
``project(hidden [N, hidden]) → [N, vocab shard]`` is the tied output projection. The parameter is still
named ``weight`` (checkpoint name ``embed_tokens.weight``).

Vocab-parallel (Megatron-LM; vLLM's VocabParallelEmbedding / ParallelLMHead): with ``vocab_range``
(first, end) rank r keeps rows [first, end) of the table (``sharding.TPShard.vocab``; the last shard is
zero-padded). A lookup embeds the ids the rank owns, writes zeros for the others, and one all-reduce
sums the ranks' rows; ``gather_logits`` concatenates the ranks' logit shards on rank 0.
"""

from __future__ import annotations

import torch

from .linear import Linear


class VocabEmbedding(Linear):
    def __init__(self, vocab_size: int, hidden_size: int, quant_method=None, params_dtype=None, tp=None,
                 vocab_range: tuple[int, int] | None = None):
        first, end = vocab_range or (0, vocab_size)
        parallel = tp is not None and tp.is_parallel
        super().__init__(hidden_size, vocab_size, bias=False, quant_method=quant_method, params_dtype=params_dtype,
                         prefix="embed_tokens", tp=tp, column_slices=[(first, end - first)] if parallel else None)
        self.num_embeddings, self.embedding_dim = vocab_size, hidden_size
        self.first, self.end = first, end

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.column_slices is None:
            return self.quant_method.embedding(self, ids)
        mine = (ids >= self.first) & (ids < self.end)
        out = self.quant_method.embedding(self, (ids - self.first).masked_fill(~mine, 0))
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden, None)


def gather_logits(local: torch.Tensor, vocab_size: int, tp=None) -> torch.Tensor | None:
    """This rank's logits [N, vocab shard] float32 → [N, vocab_size] on rank 0 (None on the others);
    ``local`` itself without tensor parallelism."""
    if tp is None or not tp.is_parallel:
        return local
    full = tp.gather_to_rank0(local, dim=-1)
    return None if full is None else full[:, :vocab_size]
