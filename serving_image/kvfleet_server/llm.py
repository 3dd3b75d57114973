"""Offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(messages, params)``
(vLLM's names), driving ``LLMEngine`` until every request finishes."""

from __future__ import annotations

import itertools

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Offline batched generation.

    Args:
        model: HF directory, .gguf file, or None / "smollm2" for the bundled SmolLM2-135M-Instruct.
        **engine_config_kwargs: any EngineConfig field (dtype, block_size, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **engine_config_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_config_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_default_sampling_params(self, **fields) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (``--generation-config``, see
        generation_config.py; what ``generate`` uses when given none), then ``fields`` on top (vLLM's
        ``LLM.get_default_sampling_params``, plus overrides)."""
        d = self.engine.generation_defaults
        max_tokens = d.resolve_max_tokens(fields.get("max_tokens"))
        return SamplingParams(**(d.params | fields | ({} if max_tokens is None else {"max_tokens": max_tokens})))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, *, add_special_tokens: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists); outputs in input order.

        Raises InvalidRequestError / PromptTooLongError before anything runs if any request is invalid.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p, add_special_tokens=add_special_tokens)
                added.append(rid)
        except Exception:
            self.engine.abort_request(added)
            self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat completion for one conversation (list of {"role", "content"} dicts) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm, add_special_tokens=False)
