"""Self-speculation from the target's own first layers (our method name ``layer_skip``; LayerSkip,
Elhoushi et al. 2024; Draft & Verify, Zhang et al. 2023).

The drafter is the target with an early exit: its first L decoder layers, the final norm and the LM
head (``LlamaForCausalLM.forward(num_layers=L)``). No extra weights and no second KV cache: the draft
reads and writes the target's own KV of layers < L. Positions < num_computed_tokens hold the target's
verified KV, which is exactly what the first L layers compute for them; draft positions are written
by the drafter and overwritten (all layers) by the verification pass.
"""

from __future__ import annotations

from ..sequence import TokenSpan
from .drafting import draft_autoregressive
from .proposer import DraftRequest, Drafts, Proposer


class LayerSkipProposer(Proposer):
    def __init__(self, num_draft_layers: int):
        self.num_draft_layers = num_draft_layers
        self.runner = None

    def bind(self, runner) -> None:
        self.runner = runner

    def propose(self, reqs: list[DraftRequest]) -> list[Drafts]:
        def first(r: DraftRequest) -> TokenSpan:
            p = r.seq.num_computed_tokens
            return TokenSpan(r.seq.token_ids[p:p + 1], p, r.block_table, "last")

        return draft_autoregressive(reqs, first, lambda spans: self.runner.execute(spans, num_layers=self.num_draft_layers),
                                    self.runner.compute_logits)
