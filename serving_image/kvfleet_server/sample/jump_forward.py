"""Jump-forward decoding: append the grammar's forced continuation without sampling it.

After Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs" (compressed
finite-state machine, LMSYS blog 2024-02): where the grammar allows exactly one continuation text
(``{"name": "`` after ``{``), its tokens are appended in the same step and computed together in the
next forward pass, instead of one forward pass per token.

Retokenization: the forced text is encoded together with a window of the sequence's latest output
tokens, so the appended tokens are the tokenizer's own split of the joined text (not the forced text
tokenized on its own, which can split differently at the boundary). Only the window's last token,
sampled this step and not yet computed, may be replaced; if the re-encoding changes any earlier
window token (its KV is computed, its text emitted), the jump is skipped. The last planned token is
held back unless the plan completes the grammar: the text after it is not known yet, and the
tokenizer may merge it with what follows.
"""

from __future__ import annotations

from .grammar import SequenceGrammar

WINDOW_TOKENS = 4


def plan_jump_forward(grammar: SequenceGrammar, tokenizer, output_ids: list[int], budget: int) -> list[int] | None:
    """Tokens that replace the last output token (sampled this step, already accepted by ``grammar``).

    Args:
        grammar: the sequence's grammar, positioned after ``output_ids``.
        tokenizer: kvfleet Tokenizer (``encode`` / ``decode``).
        output_ids: the sequence's generated tokens, the last one just sampled.
        budget: most tokens the replacement may hold (max_tokens / max_model_len room + 1).
    Returns:
        None (no jump: nothing forced, a boundary that does not retokenize cleanly, or nothing gained),
        or a list of >= 2 tokens starting with the replacement of the last token; ``grammar`` has then
        accepted exactly that list instead of the last token.
    """
    if budget < 2 or not output_ids:
        return None
    forced = grammar.forced_continuation()
    if not forced:
        return None
    window = output_ids[-WINDOW_TOKENS:]
    text = tokenizer.decode(window, skip_special_tokens=False)
    if "\ufffd" in text:  # the window splits a multi-byte character
        return None
    new = tokenizer.encode(text + forced, add_special_tokens=False)
    keep = len(window) - 1
    if new[:keep] != window[:keep]:
        return None
    tail = new[keep:][:budget]
    if len(tail) < 2:
        return None
    last = window[-1]
    grammar.rollback(1)
    accepted = 0
    for t in tail:
        if not grammar.accept(t):
            break
        accepted += 1
    if accepted and not grammar.is_completed:
        grammar.rollback(1)  # hold back the last planned token
        accepted -= 1
    if accepted < 2:
        grammar.rollback(accepted)
        grammar.accept(last)
        return None
    return tail[:accepted]
