"""Incremental detokenization and stop-string handling.

``IncrementalDetokenizer`` follows the prefix/read-offset scheme of HF text-generation-inference and
vLLM: decode a small window of tokens before and after the newest ones and emit only the new
suffix, holding back output while it ends in U+FFFD (an incomplete UTF-8 sequence from byte-fallback
tokens). The deltas therefore never split a character and concatenate to the full text.
"""

from __future__ import annotations

from ..model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context so the first output piece gets its spacing right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (possibly "")."""
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        new_text = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""


def find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string occurrence that ends after ``new_from`` (i.e. uses new text).

    Returns (start index, stop string) or None.
    """
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string (held back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
