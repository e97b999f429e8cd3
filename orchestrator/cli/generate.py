"""`pdorch generate`: stream one completion from an orchestrator (a gRPC client)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from orchestrator.cli.common import Commands, Parents, add_command
from orchestrator.cli.orchestrator import ServerSettings

NAME = "generate"
HELP = "stream a completion from an orchestrator"


def register(sub: Commands, parents: Parents, env: Mapping[str, str]) -> None:
    g = add_command(sub, NAME, parents, help=HELP)
    g.add_argument("prompt")
    g.add_argument("--orchestrator", default=ServerSettings().address)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--request-id", default="")
    g.add_argument("--timeout", type=float, default=300.0)
    g.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415

    from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc  # noqa: PLC0415

    req = orchestrator_pb2.GenerateRequest(
        request_id=args.request_id,
        max_tokens=args.max_tokens,
        sampling=common_pb2.SamplingParams(temperature=args.temperature, seed=args.seed),
        stop=args.stop,
    )
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    async with grpc.aio.insecure_channel(args.orchestrator) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        try:
            async for chunk in stub.Generate(req, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    t = chunk.timings
                    print(
                        f"\n[{common_pb2.FinishReason.Name(chunk.finish_reason)}] "
                        f"ttft {t.ttft_ms:.0f} ms, tpot {t.tpot_ms:.1f} ms, "
                        f"kv {chunk.kv_bytes} bytes, {chunk.prefill_worker or '-'} -> "
                        f"{chunk.decode_worker}",
                        file=sys.stderr,
                    )
        except grpc.aio.AioRpcError as exc:
            print(f"\npdorch generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
