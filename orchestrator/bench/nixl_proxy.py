"""A proxy in front of vLLM's own disaggregated serving (its NixlConnector), for
`pdorch bench serving`: ``python -m orchestrator.bench.nixl_proxy --port P --prefill URL
--decode URL``.

It does what vLLM's example proxy (``toy_proxy_server.py`` in vLLM's NIXL integration
tests) does, for ``POST /v1/completions`` only: send the request to the prefill server
unstreamed with ``max_tokens`` 1 and ``kv_transfer_params.do_remote_decode``; take the
``kv_transfer_params`` of its answer (where the prompt's blocks wait on the prefill side)
and send the original request with them to the decode server, whose NIXL connector pulls
the blocks; relay the decode server's answer (streamed or not) to the client unchanged.
``GET /health`` is 200 once both servers answer theirs.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill server is told: keep the prompt's KV for a remote decode."""

TIMEOUT_S = 600.0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server gets it. Pure."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return out | {"max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The request as the decode server gets it. Pure."""
    return body | {"kv_transfer_params": kv_transfer_params}


def build_app(prefill: str, decode: str) -> Starlette:
    client = httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S))

    async def completions(request: Request) -> Response:
        body = await request.json()
        first = await client.post(f"{prefill}/v1/completions", json=prefill_body(body))
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        params = first.json().get("kv_transfer_params")
        if not params:
            return JSONResponse({"error": {"message": "prefill gave no kv_transfer_params"}}, 502)
        upstream = client.build_request(
            "POST", f"{decode}/v1/completions", json=decode_body(body, params)
        )
        resp = await client.send(upstream, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for part in resp.aiter_raw():
                    yield part
            finally:
                await resp.aclose()

        return StreamingResponse(
            relay(), resp.status_code, media_type=resp.headers.get("content-type")
        )

    async def health(request: Request) -> Response:
        for url in (prefill, decode):
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health", timeout=2)).status_code == 200:
                    continue
            return Response(status_code=503)
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="base URL of the prefill server")
    parser.add_argument("--decode", required=True, help="base URL of the decode server")
    args = parser.parse_args()
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
