"""Speculative decoding: proposers of draft tokens behind one interface (proposer.Proposer).

The scheduler reserves KV slots for 1 + γ tokens per decoding sequence, where the sequence's draft gate
(gate.py, ``DraftGate``) picks γ ≤ k (``num_speculative_tokens``) from its acceptance, or 0 while speculation
does not pay; the engine asks the proposer for γ drafts, the runner verifies them in one target pass and
sample/rejection.py accepts a prefix.
"""

from __future__ import annotations

from ..spec_decode_config import SpeculativeConfig
from .proposer import Proposer, config_read_bytes, decode_read_bytes


def draft_cost(cfg: SpeculativeConfig, target, target_config, dtype, max_model_len: int) -> float:
    """Cost of proposing one draft token relative to one target decode step, as weight bytes read
    (decode is memory-bound): 0 for n-gram lookup, (first L layers + head) / (all layers + head) for
    layer_skip, draft / target for a draft model — the draft's from its architecture config at the
    model dtype (FP8 checkpoints at their stored bytes), before any draft weight is loaded, so that a
    draft no acceptance rate pays for is never loaded (the acceptance cut-off: spec_decode/gate.py DraftGate).

    Raises ValueError naming the speculative_config key when the draft does not fit the target
    (layer count, vocabulary, context length); ModelLoadError when the draft model cannot be read.
    """
    if cfg.method == "ngram":
        return 0.0
    if cfg.method == "layer_skip":
        num_layers = len(target.layers)
        if not 1 <= cfg.num_draft_layers < num_layers:
            raise ValueError(f"speculative_config.num_draft_layers must be in [1, {num_layers - 1}] "
                             f"(the target has {num_layers} layers), got {cfg.num_draft_layers}")
        return decode_read_bytes(target, cfg.num_draft_layers) / decode_read_bytes(target)
    from ..config import resolve_model
    from ..model.loader import load_model_config

    mcfg = load_model_config(resolve_model(cfg.model))
    if mcfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {mcfg.vocab_size} tokens, the target "
                         f"{target_config.vocab_size}: the draft model must share the target's tokenizer")
    if mcfg.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model supports {mcfg.max_position_embeddings} positions, "
                         f"max_model_len is {max_model_len}")
    return config_read_bytes(mcfg, dtype.itemsize) / decode_read_bytes(target)


def build_proposer(cfg: SpeculativeConfig, dtype, device: str, max_model_len: int) -> Proposer:
    """The proposer of ``cfg.method`` (a draft model is loaded here). Call ``draft_cost`` first: it
    checks that the draft fits the target."""
    if cfg.method == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "layer_skip":
        from .layer_skip import LayerSkipProposer

        return LayerSkipProposer(cfg.num_draft_layers)
    from ..config import resolve_model
    from ..model.loader import load_model
    from .draft_model import DraftModelProposer

    model, mcfg = load_model(resolve_model(cfg.model), dtype, device, max_positions=max_model_len)
    return DraftModelProposer(model, mcfg, dtype, device)
