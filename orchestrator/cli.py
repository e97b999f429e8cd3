"""`pdorch` command line: the composition root (the only place that reads the environment)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from transport import bench
from transport.backends import BACKENDS


def _bench_transport(args: argparse.Namespace) -> int:
    try:
        size = bench.parse_size(args.size)
        result = bench.run(args.backend, size, args.iters, args.layers, args.rounds)
    except bench.BenchError as exc:
        print(f"pdorch bench transport: {exc}", file=sys.stderr)
        return 2
    print(result.json() if args.json else result.human())
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Until the end-to-end demo lands: the transport on both backends vs ucx_perftest."""
    status = 0
    for backend in BACKENDS:
        for size in ("16MiB", "64MiB"):
            ns = argparse.Namespace(
                backend=backend, size=size, iters=args.iters, layers=32, rounds=3, json=False
            )
            status |= _bench_transport(ns)
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdorch", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("PDORCH_LOG_LEVEL", "WARNING"))
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="benchmarks (ratios against a reference in the same run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bt = bsub.add_parser("transport", help="KV transfer throughput vs ucx_perftest tag_bw")
    bt.add_argument("--backend", choices=BACKENDS, default="ucx")
    bt.add_argument("--size", default="64MiB", help="KV bytes per transfer (e.g. 64MiB)")
    bt.add_argument("--iters", type=int, default=10)
    bt.add_argument("--layers", type=int, default=32, help="layers the KV is split into")
    bt.add_argument("--rounds", type=int, default=3, help="alternations of ours/reference")
    bt.add_argument("--json", action="store_true", help="print one JSON object")
    bt.set_defaults(func=_bench_transport)

    d = sub.add_parser("demo", help="run the demo")
    d.add_argument("--iters", type=int, default=5)
    d.set_defaults(func=_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
