"""`pdorch operator`: the Kubernetes operator serving DisaggregatedService resources.

Its flags fill `OperatorConfig`; their defaults are its field defaults.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from orchestrator.cli.common import CommandError, Commands, Parents, add_command, default
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
    import kopf  # noqa: PLC0415

    from orchestrator.operator.runner import run_operator  # noqa: PLC0415 - imports kopf

    if not args.server and not _credentials(os.environ):
        raise CommandError(_NO_LOGIN)
    try:
        await run_operator(operator_config(args))
    except kopf.LoginError as exc:  # no service account, kubeconfig or --server
        raise CommandError(f"{_NO_LOGIN} ({exc.args[0].split('.')[0]})") from exc
    return 0


SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_NO_LOGIN = (
    "no Kubernetes credentials: run it in a pod (service account), with a kubeconfig "
    "($KUBECONFIG, ~/.kube/config), or with --server URL (kubectl proxy)"
)


def _credentials(env: Mapping[str, str]) -> bool:
    """Whether kopf will find a way to log in (checked first: without one it logs a
    traceback per watcher before giving up)."""
    configs = env.get("KUBECONFIG", "").split(os.pathsep) if env.get("KUBECONFIG") else []
    paths = [Path(c) for c in configs if c] or [Path.home() / ".kube" / "config"]
    return SERVICE_ACCOUNT_TOKEN.exists() or any(p.is_file() for p in paths)


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(
        namespaces=tuple(args.namespace),
        resync_interval_s=args.resync_interval,
        server=args.server or None,
        liveness_endpoint=args.liveness or None,
    )
