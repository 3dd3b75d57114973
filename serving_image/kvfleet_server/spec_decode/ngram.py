"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method).

The longest suffix n-gram of the sequence (prompt + output), n in [prompt_lookup_min,
prompt_lookup_max], that also occurs earlier in the sequence proposes the tokens that followed its
most recent earlier occurrence. No model runs; the drafts are deterministic (one-hot q).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .proposer import DraftRequest, Drafts, Proposer


def ngram_lookup(tokens: list[int] | np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier occurrence of the longest suffix n-gram
    (n from n_max down to n_min); [] when none occurs. Pure function over a token sequence."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = len(arr)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows starting at 0 .. L-n-1: every occurrence except the suffix itself
        windows = sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == arr[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, reqs: list[DraftRequest]) -> list[Drafts]:
        return [Drafts(ngram_lookup(r.seq.token_ids, self.n_min, self.n_max, r.num_drafts)) for r in reqs]
