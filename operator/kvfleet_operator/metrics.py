"""Operator metrics (Prometheus, served on /metrics by ``kvfleet-operator run --metrics-port``).

kvfleet_operator_reconciles_total{result}        counter, result = success | degraded | error | coalesced | unchanged
kvfleet_operator_reconcile_errors_total{reason}  counter, API errors by HTTP reason
kvfleet_operator_reconcile_duration_seconds      histogram of one reconcile pass (seconds)
kvfleet_operator_child_writes_total{kind,action} counter, create | patch | delete of children
kvfleet_operator_api_requests_total{verb,resource,code} counter, the operator's own API calls (not kopf's watches)
"""
from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

RECONCILES = Counter("kvfleet_operator_reconciles", "Reconcile passes by result.", ["result"])
ERRORS = Counter("kvfleet_operator_reconcile_errors", "Reconcile passes that failed on an API error.", ["reason"])
DURATION = Histogram("kvfleet_operator_reconcile_duration_seconds", "Duration of one reconcile pass.",
                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
CHILD_WRITES = Counter("kvfleet_operator_child_writes", "Writes to owned children.", ["kind", "action"])
API_REQUESTS = Counter("kvfleet_operator_api_requests", "The operator's API calls by verb, resource (the plural, "
                       "with its subresource) and HTTP status (0: no response).", ["verb", "resource", "code"])


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve the default registry on http://ADDR:PORT/metrics in a background thread."""
    start_http_server(port, addr=addr)
