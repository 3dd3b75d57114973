"""Typed errors raised by the engine; the HTTP layer maps them to OpenAI-shaped responses.

Every error names the offending field (``param``) and the limit that was broken, so a user
can fix the request without reading server logs.
"""

from __future__ import annotations


class KVFleetError(Exception):
    """Base class of kvfleet's own errors."""


class InvalidRequestError(KVFleetError, ValueError):
    """A request parameter is invalid (HTTP 400).

    Attributes:
        param: name of the offending field as the API user wrote it (e.g. ``"top_p"``), or None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """prompt tokens (+ max_tokens) exceed max_model_len, or the prompt can never fit in the KV pool."""


class EngineDeadError(KVFleetError, RuntimeError):
    """The engine loop stopped unexpectedly; no new request can be served (HTTP 503)."""


class UnsupportedFeatureError(KVFleetError, ValueError):
    """A configuration option or request field names a feature that is not built yet ("not supported yet: ...").

    Attributes:
        param: the request field that asked for it (HTTP 400's ``param``), or None for start-up options.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
