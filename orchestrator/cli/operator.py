"""`pdorch operator`: the Kubernetes operator serving DisaggregatedService resources.

Its flags fill `OperatorConfig`; their defaults are its field defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from orchestrator.cli.common import Commands, Parents, add_command, default
from orchestrator.operator.config import OperatorConfig

NAME = "operator"
HELP = "run the Kubernetes operator (DisaggregatedService)"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    op = add_command(sub, NAME, parents, help=HELP)
    op.add_argument(
        "--namespace", action="append", required=True, help="serve this namespace (repeatable)"
    )
    op.add_argument(
        "--resync-interval",
        type=float,
        default=default(OperatorConfig, "resync_interval_s"),
        help="re-reconcile every resource every S",
    )
    op.add_argument(
        "--server",
        default=env.get("PDORCH_KUBE_SERVER", ""),
        help="API server URL used without authentication (kubectl proxy); "
        "default: the pod's service account, else the kubeconfig",
    )
    op.add_argument("--liveness", default="", help="serve kopf's liveness probe at this URL")
    op.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    from orchestrator.operator.runner import run_operator  # noqa: PLC0415 - imports kopf

    await run_operator(operator_config(args))
    return 0


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(
        namespaces=tuple(args.namespace),
        resync_interval_s=args.resync_interval,
        server=args.server or None,
        liveness_endpoint=args.liveness or None,
    )
