"""`pdorch certs DIR`: a throwaway CA and a certificate per pdorch identity, for processes run
by hand with ``--tls-dir DIR`` (local clusters make their own; a deployment's CA is its own,
README: Security)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from orchestrator.cli.common import Commands, Parents, add_command

NAME = "certs"
HELP = "make a throwaway CA and pdorch's certificates in a directory (for --tls-dir)"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    c = add_command(
        sub,
        NAME,
        parents,
        help=HELP,
        description="Writes DIR/ca.pem and, for each identity (pdorch-orchestrator, "
        "pdorch-prefill, pdorch-decode, pdorch-worker, pdorch-client), DIR/<identity>.pem "
        "and DIR/<identity>.key (mode 0600). Files of those names are replaced. The CA's "
        "key is not kept. Needs the cryptography package.",
    )
    c.add_argument("dir", help="the directory (created if need be)")
    c.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME|IP",
        help="a further DNS name or IP address every certificate carries (repeatable; "
        "localhost and 127.0.0.1 always are)",
    )
    c.set_defaults(call=run)


def run(args: argparse.Namespace) -> int:
    from orchestrator.certs import make_tls_dir  # noqa: PLC0415 - cryptography

    out = make_tls_dir(args.dir, hosts=args.host)
    print(f"{out}: ca.pem and a certificate per identity; pass --tls-dir {out}", flush=True)
    return 0
