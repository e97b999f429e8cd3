"""uvicorn serving the gateway inside the orchestrator's event loop.

We bind the listening socket ourselves (so port 0 works and a bind error is an ordinary
``OSError`` at start, not uvicorn's ``sys.exit``) and keep uvicorn away from signals: the
process's owner (the CLI) handles SIGTERM and calls `HttpServer.stop`, which stops accepting,
lets open responses finish for ``drain_grace_s``, then cancels them.

With `ServedTls` it serves HTTPS (uvicorn's ssl settings): the orchestrator's certificate,
and, when required (``--client-cert required``, as the gRPC API), a client certificate the
CA signed — one from another CA, or none, fails the handshake. Which identity a client
certificate names is not checked here (uvicorn does not hand it to the app): the bearer
token decides what an HTTP caller may do.

A client cannot hold connections for free: a request's head (line and headers) must be in
within `HEAD_TIMEOUT_S` of the connection's start or of the previous response's end (else
the connection is closed — uvicorn has no such deadline, and any byte received restarted
its keep-alive timer, so a head sent a byte at a time held a connection forever), and past
`MAX_CONNECTIONS` open connections a new request is answered 503. (The body's deadline is
the app's: `GatewaySettings.body_timeout_s`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0
"""A request's line and headers must arrive within this of the connection's start (or the
previous response's end); a client that has not sent them by then is disconnected."""
MAX_CONNECTIONS = 4096
"""Open connections past which a new request is answered 503 (uvicorn's
``limit_concurrency``): one client must not take every file descriptor of the process,
which its Redis and worker connections need too."""


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's head."""

    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()  # the next request on this connection: its head, in time

    def _await_head(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_late)

    def _head_late(self) -> None:
        self._head_deadline = None
        waiting = self.cycle is None or self.cycle.response_complete  # no request under way
        if waiting and not self.transport.is_closing():
            log.info("closed an HTTP connection from %s: no request head within %gs",
                     self.client, HEAD_TIMEOUT_S)  # fmt: skip
            self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """No signal handlers: the CLI owns the process's signals."""
        yield


@dataclass(frozen=True, slots=True)
class ServedTls:
    """The files an HTTPS gateway serves with (`orchestrator.api.tls.Tls.ssl_files`)."""

    certfile: str
    keyfile: str
    ca_certs: str
    client_cert_required: bool = False


class HttpServer:
    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        drain_grace_s: float,
        tls: ServedTls | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.requested_port = port
        self.drain_grace_s = drain_grace_s
        self._config = uvicorn.Config(
            app,
            http=_Protocol,
            limit_concurrency=MAX_CONNECTIONS,
            ws="none",  # no websockets: nothing to import (or to warn about)
            lifespan="off",
            log_config=None,  # the CLI configures logging; a library never does
            access_log=False,
            timeout_graceful_shutdown=max(1, math.ceil(drain_grace_s)),
            ssl_certfile=tls.certfile if tls else None,
            ssl_keyfile=tls.keyfile if tls else None,
            ssl_ca_certs=tls.ca_certs if tls else None,
            ssl_cert_reqs=_cert_reqs(tls),
        )
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def start(self, timeout_s: float = 10.0) -> None:
        """Listen, and return once uvicorn serves (or raise: bind error, early exit)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.requested_port))
        except OSError:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(
            self._server.serve(sockets=[sock]), name=f"pdorch-gateway-{self.port}"
        )
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server exited while starting")
            if time.monotonic() > deadline:
                await self.stop()
                raise TimeoutError(f"HTTP server not serving after {timeout_s}s")
            await asyncio.sleep(0.01)  # polling uvicorn's `started` flag, with a deadline

    async def stop(self) -> None:
        """Stop accepting, drain for ``drain_grace_s``, cancel the rest. Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        self._server.should_exit = True
        try:
            # uvicorn cancels responses still open after its graceful timeout; the margin
            # covers its own polling (0.1 s ticks) before we cancel it outright.
            await asyncio.wait_for(asyncio.shield(task), self.drain_grace_s + 5.0)
        except TimeoutError:
            log.warning("HTTP server did not stop in time; cancelling it")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _cert_reqs(tls: ServedTls | None) -> int:
    """Client certificates: required (and verified), or none asked for."""
    return ssl.CERT_REQUIRED if tls is not None and tls.client_cert_required else ssl.CERT_NONE
