"""Speculative decoding: proposers of draft tokens behind one interface (proposer.Proposer).

The scheduler reserves slots for 1 + k tokens per decoding sequence, the engine asks the proposer
for drafts, the runner verifies them in one target pass and sample/rejection.py accepts a prefix.
"""

from __future__ import annotations

from .config import SpeculativeConfig
from .proposer import Proposer


def build_proposer(cfg: SpeculativeConfig, target, target_config, tokenizer, dtype, device: str,
                   max_model_len: int) -> Proposer:
    """The proposer of ``cfg.method``. Raises ValueError naming the speculative_config key when the
    draft does not fit the target (layer count, vocabulary, context length)."""
    if cfg.method == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "layer_skip":
        from .layer_skip import LayerSkipProposer

        return LayerSkipProposer(cfg.num_draft_layers, target)
    from ..config import resolve_model
    from ..model.loader import load_model

    model, mcfg = load_model(resolve_model(cfg.model), dtype, device, max_positions=max_model_len)
    if mcfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {mcfg.vocab_size} tokens, the target "
                         f"{target_config.vocab_size}: the draft model must share the target's tokenizer")
    if mcfg.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model supports {mcfg.max_position_embeddings} positions, "
                         f"max_model_len is {max_model_len}")
    from .draft_model import DraftModelProposer

    return DraftModelProposer(model, mcfg, dtype, device, target)
