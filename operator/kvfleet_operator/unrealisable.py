"""``Unrealisable``: a spec that passed the schema but cannot be run (rendering and the server-flag contract
raise it; the reconcile reports it as a Degraded condition)."""

from __future__ import annotations


class Unrealisable(Exception):
    """The spec passed the schema but cannot be turned into running pods.

    ``reason`` is a CamelCase condition reason, ``message`` names the field and the problem.
    ``retryable``: the cause lies outside the spec (e.g. another object in the way), so the reconcile
    retries with backoff instead of waiting for a spec change.
    """

    def __init__(self, reason: str, message: str, retryable: bool = False):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retryable = retryable
