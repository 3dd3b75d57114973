"""SamplingParams: per-request generation controls with OpenAI / vLLM meaning.

Validation lives here so the engine, the offline ``LLM`` API and the HTTP server all refuse the
same bad input with the same message (``InvalidRequestError`` naming the field and the limit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidRequestError

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint enforced while decoding (vLLM's ``StructuredOutputsParams``); exactly one field is set.

    Attributes:
        json: a JSON Schema (dict or JSON text); the output is a JSON document valid against it.
        regex: a regular expression the whole output matches.
        choice: a list of strings; the output is exactly one of them.
        grammar: an EBNF grammar (GBNF/xgrammar dialect, start symbol ``root``).
        json_object: True: the output is any JSON object (OpenAI's ``response_format: json_object``).
        compiled: the compiled grammar, filled by ``sample.grammar.GrammarCompiler`` (the server compiles
            off the engine thread before adding the request; the engine compiles it otherwise).

    Raises:
        InvalidRequestError: from ``validate()`` when no field or several are set, or a field has the wrong type.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    compiled: object | None = field(default=None, repr=False, compare=False)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def validate(self, param: str = "structured_outputs") -> None:
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(
                f"{param} must set exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                f"{', '.join(set_) if set_ else 'none'}", param=param)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(f"{param}.json must be a JSON Schema object", param=f"{param}.json")
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequestError(f"{param}.regex must be a string", param=f"{param}.regex")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise InvalidRequestError(f"{param}.grammar must be a non-empty EBNF string", param=f"{param}.grammar")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(f"{param}.choice must be a non-empty list of non-empty strings",
                                      param=f"{param}.choice")


@dataclass
class SamplingParams:
    """Controls how tokens are chosen for one request (vLLM's ``SamplingParams``).

    Attributes:
        n: number of completions sampled from one prompt (they share the prompt's KV blocks).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p × the top probability; in [0, 1].
        seed: per-request RNG seed; the same seed gives the same tokens whatever else is batched.
        presence_penalty, frequency_penalty: OpenAI penalties in [-2, 2] over generated tokens.
        repetition_penalty: CTRL/HF-style multiplicative penalty (> 0; 1 disables) over prompt + output.
        max_tokens: maximum generated tokens per completion (None: up to max_model_len; 0: the prompt is
            computed, e.g. for prompt_logprobs, and nothing is generated).
        min_tokens: EOS and stop_token_ids are suppressed until this many tokens are generated.
        ignore_eos: keep generating after EOS (EOS is emitted but does not stop).
        stop: strings that end generation; matched across token boundaries and excluded from text.
        stop_token_ids: token ids that end generation (the token is not included in the text).
        include_stop_str_in_output: keep the matched stop string in the text.
        logprobs: number of top log-probabilities (0..max_logprobs, 20 by default) to return per generated
            token; None = off.
        prompt_logprobs: number of top log-probabilities per prompt token; None = off.
        skip_special_tokens: leave special tokens out of the detokenized text.
        structured_outputs: a grammar the output must follow (JSON schema, regex, choice, EBNF, any JSON
            object); EOS and stop_token_ids are only allowed where the grammar can end.

    Raises:
        InvalidRequestError: from ``validate()`` when a field is outside its range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Check every field; raises InvalidRequestError naming the field and its limit."""

        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(f"{param} {msg}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be non-negative, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            bad("max_tokens", f"must be at least 0 (0: compute the prompt only, e.g. for prompt_logprobs), "
                              f"got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:  # the upper bound is the engine's max_logprobs (--max-logprobs)
                bad(name, f"must be non-negative, got {v}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
