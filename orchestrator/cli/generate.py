"""`pdorch generate`: stream one completion from an orchestrator (a gRPC client)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

from orchestrator.cli.common import (
    CommandError,
    Commands,
    Parents,
    add_command,
    client_tls,
    client_token,
    non_negative_float,
    positive_float,
    positive_int,
    seed,
)
from orchestrator.cli.state import orphaned_state, stale_state, state_path

NAME = "generate"
HELP = "stream a completion from an orchestrator"

FINISH_REASONS = {
    "FINISH_REASON_LENGTH": "stopped: --max-tokens reached",
    "FINISH_REASON_STOP": "stopped: a --stop string",
    "FINISH_REASON_EOS": "finished: end of sequence",
    "FINISH_REASON_CANCELLED": "cancelled",
    "FINISH_REASON_ERROR": "failed",
}
"""`common.proto`'s FinishReason names, for people."""

NO_TOKENS = (
    "(no tokens: the model ended the text at once; an instruct model such as smollm2 wants "
    "its chat template: --chat)"
)


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    g = add_command(
        sub,
        NAME,
        parents,
        parents.orchestrator,
        parents.client_tls,
        help=HELP,
        description="Send one prompt to an orchestrator and print the tokens as they come; "
        "timings, KV bytes and the workers used go to stderr at the end.",
    )
    g.add_argument("prompt", help="the prompt text (a chat message with --chat)")
    g.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    g.add_argument(
        "--max-tokens", type=positive_int, default=64, help="tokens at most (default %(default)s)"
    )
    g.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0: greedy (default %(default)s)",
    )
    g.add_argument("--seed", type=seed, default=0, help="sampling seed (default %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    g.add_argument("--request-id", default="", help="idempotency key (default: one is made up)")
    g.add_argument(
        "--timeout",
        type=positive_float,
        default=300.0,
        help="seconds for the whole request (default %(default)s)",
    )
    g.set_defaults(run=run)


def finish_line(reason: str, ttft_ms: float, tpot_ms: float, kv_bytes: int, route: str) -> str:
    """The line after the text: why it ended, timings, the KV moved, the workers."""
    why = FINISH_REASONS.get(reason, reason.removeprefix("FINISH_REASON_").lower())
    return f"[{why}] ttft {ttft_ms:.0f} ms, tpot {tpot_ms:.1f} ms, kv {kv_bytes:,} bytes, {route}"


def orphan_note(env: Mapping[str, str], address: str) -> str | None:
    """A line for a call to the cluster a killed `pdorch up` left serving (`orphaned_state`)
    at ``address``: it serves, but nothing supervises it; None for any other."""
    state = orphaned_state(env)
    if state is None or state.orchestrator != address:
        return None
    return (
        f"pdorch generate: `pdorch up` (pid {state.pid}) is gone (killed); its cluster at "
        f"{address} serves on without it \N{EM DASH} `pdorch down` stops it"
    )


def no_answer(env: Mapping[str, str], address: str, tls_hint: str) -> str:
    """Why no orchestrator answers at ``address``: a `pdorch up` killed with its
    orchestrator gone too left a state file (and maybe processes) that `pdorch down`
    clears; else the usual suspects."""
    left = stale_state(env)
    if left is not None and orphaned_state(env) is None:
        return (
            f"no orchestrator answers at {address}: the `pdorch up` of {state_path(env)} "
            f"(pid {left.pid}) is gone (killed) and its orchestrator is not running; "
            "`pdorch down` stops what it left running, then `pdorch up` starts a new cluster"
        )
    return (
        f"no orchestrator answers at {address} (is `pdorch up` running? "
        f"--orchestrator or $PDORCH_ORCHESTRATOR name another{tls_hint})"
    )


TRIES = 5
"""Attempts at a request the orchestrator refused with a retry-after (its request store
away — a Redis primary failing over — or load), while no token has come."""
MAX_RETRY_AFTER_S = 10.0
"""The longest retry-after honoured (a larger one is read as this)."""


def retry_after(trailing: object) -> float | None:
    """The seconds a refusal's trailing ``retry-after`` asks to wait (capped); None when
    it has none — an error not worth retrying as it is."""
    from orchestrator.rpc.service import RETRY_AFTER_KEY  # noqa: PLC0415

    for key, value in trailing or ():  # type: ignore[attr-defined]
        if key == RETRY_AFTER_KEY:
            try:
                return min(max(float(value), 0.0), MAX_RETRY_AFTER_S)
            except ValueError:
                return None
    return None


async def run(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415

    from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc  # noqa: PLC0415

    req = orchestrator_pb2.GenerateRequest(
        # Named here: a retry (below) resubmits this request, never starts a second one.
        request_id=args.request_id or uuid.uuid4().hex,
        max_tokens=args.max_tokens,
        sampling=common_pb2.SamplingParams(temperature=args.temperature, seed=args.seed),
        stop=args.stop,
    )
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    from orchestrator.rpc.client import channel as client_channel  # noqa: PLC0415

    tls = client_tls(args)
    note = orphan_note(os.environ, args.orchestrator)
    if note is not None:
        print(note, file=sys.stderr)
    deadline = time.monotonic() + args.timeout
    async with client_channel(args.orchestrator, client_token(os.environ), tls=tls) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        tokens = 0
        attempt = 0
        while True:
            attempt += 1
            try:
                left = max(deadline - time.monotonic(), 0.001)
                async for chunk in stub.Generate(req, timeout=left):
                    tokens += len(chunk.token_ids)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    if chunk.finish_reason:
                        t = chunk.timings
                        route = f"{chunk.prefill_worker or '-'} -> {chunk.decode_worker}"
                        reason = common_pb2.FinishReason.Name(chunk.finish_reason)
                        print(file=sys.stderr)
                        if not tokens and not args.chat:
                            print(NO_TOKENS, file=sys.stderr)
                        print(
                            finish_line(reason, t.ttft_ms, t.tpot_ms, chunk.kv_bytes, route),
                            file=sys.stderr,
                        )
            except grpc.aio.AioRpcError as exc:
                wait = retry_after(exc.trailing_metadata())
                if wait is None or tokens or attempt >= TRIES:
                    return _failed(exc, channel, args, tls)
                if time.monotonic() + wait >= deadline:
                    return _failed(exc, channel, args, tls)
                print(
                    f"pdorch generate: {exc.code().name}: {exc.details()}; trying again in "
                    f"{wait:g} s",
                    file=sys.stderr,
                )
                await asyncio.sleep(wait)
            else:
                return 0


def _failed(exc: Any, channel: Any, args: argparse.Namespace, tls: object) -> int:
    """A request that failed: its status in one line; a `CommandError` when nothing
    answered at all."""
    import grpc  # noqa: PLC0415

    connected = channel.get_state() is grpc.ChannelConnectivity.READY
    if exc.code() == grpc.StatusCode.UNAVAILABLE and not connected:
        # (Connected, the orchestrator itself said UNAVAILABLE — no workers, its store
        # away, shutting down: its words say which, below.)
        tls_hint = (
            "; with --tls-dir, its CA and client certificate must be the server's"
            if tls is not None
            else "; one serving TLS needs --tls-dir"
        )
        raise CommandError(no_answer(os.environ, args.orchestrator, tls_hint)) from None
    print(f"\npdorch generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1
