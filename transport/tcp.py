"""TCP backend: payloads travel inline on the control connection (asyncio streams).

For hosts without UCX. With `LinkTls` the KV bytes are encrypted too (they share the
link). Nothing to set up beyond the control connection, so the data plane
is empty: `link.Link` writes and reads the payload bytes itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from transport.base import DataPlane, Peer, TransportSettings
from transport.receiver import KvReceiver
from transport.security import LinkTls
from transport.sender import KvSender
from transport.wire import ModelSpec


class TcpDataPlane(DataPlane):
    name = "tcp"
    inline = True

    async def start(self) -> bytes:
        return b""

    async def send(self, peer: Peer, tag: int, buffers: Sequence[memoryview]) -> None:
        raise NotImplementedError("TCP payloads travel inline on the control link")

    async def recv(self, peer: Peer, tag: int, into: memoryview) -> None:
        raise NotImplementedError("TCP payloads travel inline on the control link")

    def fail_channel(self, peer: Peer) -> None:
        """Nothing is held outside the control link, which its owner closes."""

    def release(self, peer: Peer) -> None:
        """Nothing is held per channel."""

    async def close(self) -> None:
        """No resources beyond the links."""


def tcp_sender(settings: TransportSettings | None = None, tls: LinkTls | None = None) -> KvSender:
    return KvSender(TcpDataPlane(), settings or TransportSettings(), tls)


def tcp_receiver(
    settings: TransportSettings | None = None,
    model: ModelSpec | None = None,
    tls: LinkTls | None = None,
) -> KvReceiver:
    return KvReceiver(TcpDataPlane(), settings or TransportSettings(), model, tls)
