"""The operator's settings, filled in by the CLI (the only reader of flags and environment)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    namespaces: tuple[str, ...]
    """Namespaces whose DisaggregatedServices this operator serves (its Role lives there)."""

    resync_interval_s: float = 30.0
    """Every resource is re-reconciled this often: repairs drift (a hand-deleted or edited
    child) and refreshes the status from the children's readiness."""

    server: str | None = None
    """An API server URL used without authentication (``kubectl proxy``, tests). None:
    the pod's service account, else the local kubeconfig."""

    api_timeout_s: float = 10.0
    """Deadline of each API call the operator makes itself."""

    retry_delay_s: float = 5.0
    """How long kopf waits before retrying a handler after a transient API error."""

    liveness_endpoint: str | None = None
    """Where kopf serves its liveness probe, e.g. ``http://0.0.0.0:8080/healthz``."""
