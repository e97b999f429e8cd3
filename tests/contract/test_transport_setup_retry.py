"""A KV connection lost while it is set up is made once more.

A receiver on a starved loop can drop a newcomer — a TLS handshake its sender finished in
time but the receiver reached late — and the sender's next write finds the link closed
(seen in CI: a vLLM decode worker on a loaded CPU; the request failed over). Nothing was
offered on such a link, so the sender connects once more, for every way a transfer starts
(`send`, eager or layered, and `open`); a receiver that drops every newcomer costs two
connections and a retryable `PeerLostError`, not a third.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from transport import errors, testing, wire
from transport.backends import make_data_plane, make_sender
from transport.base import TransportSettings
from transport.link import Link
from transport.receiver import KvReceiver, _Conn
from transport.security import LinkTls, load_dir
from transport.sender import KvSender

pytest.importorskip("cryptography", reason="the test extra's cryptography")
from tests.contract.kv_tls_certs import make_pki

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("event_loop_kind")]

SETTINGS = TransportSettings(connect_timeout_s=2.0, idle_timeout_s=2.0)
KIB = testing.KIB


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("kv-pki"))


class _DropsNewcomers(KvReceiver):
    """Closes its first ``drops`` connections once accepted (and, with TLS, once the
    handshake is done), before their HELLO: as a receiver that gave up on them."""

    def __init__(self, drops: int, tls: LinkTls | None) -> None:
        super().__init__(make_data_plane("tcp"), SETTINGS, None, tls)
        self.drops = drops
        self.newcomers = 0

    async def _converse(self, link: Link, conn: _Conn) -> None:
        self.newcomers += 1
        if self.newcomers <= self.drops:
            return  # `_serve` closes the link
        await super()._converse(link, conn)


def _tls(pki: Path, tls: bool, identity: str) -> LinkTls | None:
    return load_dir(pki, identity) if tls else None


async def _open_and_send(address: str, sender: KvSender, cache: wire.KvCache) -> None:
    transfer = await sender.open(address, cache.header)
    async with transfer:
        for i, (k, v) in enumerate(cache.layers):
            await transfer.send_layer(i, k, v)
        await transfer.finish()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("how", ["eager", "layered", "open"])
def test_a_newcomer_dropped_at_setup_is_made_again(pki: Path, tls: bool, how: str) -> None:
    size = 4 * KIB if how == "eager" else 512 * KIB

    async def run() -> None:
        receiver = _DropsNewcomers(1, _tls(pki, tls, "decode"))
        address = await receiver.start()
        sender = make_sender("tcp", SETTINGS, tls=_tls(pki, tls, "prefill"))
        try:
            cache = testing.synthetic_cache(f"retry-{how}", 1, size)
            if how == "open":
                await _open_and_send(address, sender, cache)
            else:
                await sender.send(address, cache)
            got = await receiver.take(cache.header.request_id, 1, 5)
            assert testing.digest(got) == testing.digest(cache)
            assert receiver.newcomers == 2
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_receiver_dropping_every_newcomer_costs_two_connections(pki: Path, tls: bool) -> None:
    async def run() -> None:
        receiver = _DropsNewcomers(10, _tls(pki, tls, "decode"))
        address = await receiver.start()
        sender = make_sender("tcp", SETTINGS, tls=_tls(pki, tls, "prefill"))
        try:
            cache = testing.synthetic_cache("dropped", 1, 4 * KIB)
            with pytest.raises(errors.PeerLostError) as lost:
                await sender.send(address, cache)
            assert lost.value.retryable
            assert receiver.newcomers == 2
            assert receiver.inbox.bytes_in_use == 0
            assert receiver.inbox.held() == []
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())
