"""Runs the operator: a fresh kopf registry with our handlers, in the current event loop."""

from __future__ import annotations

import kopf

from orchestrator.operator.config import OperatorConfig
from orchestrator.operator.handlers import register


async def run_operator(config: OperatorConfig) -> None:
    """Until SIGTERM/SIGINT (kopf installs the handlers and stops its tasks in order)."""
    registry = kopf.OperatorRegistry()
    register(registry, config)
    await kopf.operator(
        registry=registry,
        # One replica, no peering: peering would need cluster-wide permissions; the
        # operator Deployment runs a single replica with the Recreate strategy instead.
        standalone=True,
        namespaces=list(config.namespaces),
        liveness_endpoint=config.liveness_endpoint,
    )
