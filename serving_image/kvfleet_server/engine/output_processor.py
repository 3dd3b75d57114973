"""OutputProcessor: what happens to a sampled token — logprobs, grammar acceptance and jump-forward,
detokenization, stop conditions (stop tokens, EOS, stop strings, length) — and the RequestOutputs
(cumulative text plus the delta since the last one) the engine returns.

After vLLM v1's ``OutputProcessor`` / ``Detokenizer``; stop strings are held back while they may still
match (``detokenizer.partial_stop_len``).
"""

from __future__ import annotations

import logging

from .detokenizer import find_stop, partial_stop_len
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sample.sampler import TokenLogprobs
from ..sequence import Request, Sequence, SeqStatus

logger = logging.getLogger("kvfleet.engine")


class OutputProcessor:
    """Appends sampled tokens to sequences and builds RequestOutputs (engine thread only).

    Args:
        tokenizer: kvfleet ``Tokenizer`` (pieces for logprobs, EOS ids, detokenization, jump-forward).
        scheduler: the ``Scheduler`` a finished sequence is removed from (its blocks freed at once).
        config: the EngineConfig (``enable_jump_forward``: append the tokens a grammar forces after a sampled
            one, SGLang's jump-forward).
    """

    def __init__(self, tokenizer, scheduler, config):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.config = config

    def logprob_entry(self, tok: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        d = {tok: Logprob(tok, lp.logprob, self.tokenizer.id_to_piece(tok), lp.rank)}
        for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if t not in d:
                d[t] = Logprob(t, v, self.tokenizer.id_to_piece(t), r)
        return d

    def append(self, seq: Sequence, tok: int, lp: TokenLogprobs | None) -> int:
        """Append the sampled token (and, with jump-forward, the grammar's forced tokens after it), check
        stop conditions; returns how many tokens jump-forward added beyond the sampled one."""
        req = seq.request
        p = req.params
        seq.token_ids.append(tok)
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(self.logprob_entry(tok, lp))
        toks, grammar_end = [tok], None
        if seq.grammar is not None:  # hook: structured output (jump-forward only where no logprobs are kept)
            toks, terminated = seq.grammar.advance(
                tok, self.tokenizer, seq.output_token_ids, seq.num_tokens_left + 1,
                self.config.enable_jump_forward and seq.logprobs is None and tok not in p.stop_token_ids)
            if toks is None:  # cannot happen under the bitmask; end the sequence, never crash
                logger.error("request %s: sampled token %d outside its grammar", req.request_id, tok)
                self.finish(seq, "stop")
                return 0
            seq.token_ids[-1:] = toks
            grammar_end = "stop" if terminated else None  # ignore_eos: the grammar ended, nothing may follow
        reason = (self._stop_reason(seq, toks) or grammar_end
                  or ("length" if seq.num_tokens_left <= 0 else None))
        if reason is not None:
            self.finish(seq, reason)
        return len(toks) - 1

    def _stop_reason(self, seq: Sequence, toks: list[int]) -> str | None:
        """Detokenize ``toks`` (just appended) until one ends the sequence: "stop" for a stop token, EOS
        (unless ignore_eos) or a stop string (the text cut there); None if none does."""
        p = seq.request.params
        for tok in toks:
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return "stop"
            if tok in self.tokenizer.eos_token_ids and not p.ignore_eos:
                return "stop"
            delta = seq.detok.add(tok)
            if not delta:
                continue
            old = len(seq.text)
            seq.text += delta
            m = find_stop(seq.text, old, p.stop) if p.stop else None
            if m is not None:
                idx, s = m
                seq.text = seq.text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                seq.stop_reason = s
                return "stop"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED

    def make_output(self, req: Request) -> RequestOutput:
        comps = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            stops = req.params.stop
            visible = len(seq.text)
            if stops and not seq.is_finished:
                visible -= partial_stop_len(seq.text, stops)
            visible = max(visible, seq.emitted_text_len)
            text = seq.text[:visible]
            out_ids = seq.output_token_ids
            lps = seq.logprobs
            comps.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(out_ids),
                delta_text=text[seq.emitted_text_len:], delta_token_ids=out_ids[seq.emitted_tokens:],
                logprobs=list(lps) if lps is not None else None,
                delta_logprobs=lps[seq.emitted_tokens:] if lps is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
            seq.emitted_text_len = visible
            seq.emitted_tokens = len(out_ids)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=comps, finished=req.finished, prompt_logprobs=req.prompt_logprobs, metrics=req.metrics,
            num_cached_tokens=req.num_cached_tokens,
        )
