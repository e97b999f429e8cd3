"""TLS at accept: a receiver takes a link's TLS handshake whatever its event loop has
already read.

The receiver used to accept a link in plaintext and upgrade it (`StreamWriter.start_tls`)
while senders speak TLS at once. On uvloop, which starts reading an accepted socket before
the connection's handler runs, a busy loop had read the sender's ClientHello into the
plaintext stream's buffer by the time the upgrade began; the TLS layer never saw it, and
the handshake stalled until the sender's connect timed out (48 of 50 in a standalone
repro; on the simulated fleet on uvloop, requests failed over). These tests build that
shape on purpose: each client's ClientHello is in the receiver's socket before its loop
gets to run, and every link must still complete its handshake and HELLO, on both loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from transport import control, testing
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.security import client_context, load_dir

pytest.importorskip("cryptography", reason="the test extra's cryptography")
pytest.importorskip("uvloop", reason="uvloop not installed")
import uvloop

from tests.contract.kv_tls_certs import make_pki

pytestmark = pytest.mark.timeout(60)

SETTINGS = TransportSettings(connect_timeout_s=2.0, idle_timeout_s=2.0)
CLIENTS = 20
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("kv-pki"))


def _run(loop_name: str, main: Callable[[], object]) -> None:
    loop = LOOPS[loop_name]()
    try:
        loop.run_until_complete(main())  # type: ignore[arg-type]
    finally:
        loop.close()


class _EarlyHello:
    """A TLS client on a plain blocking socket (in a thread) that sends its ClientHello
    before it waits for anything, then completes the handshake and the link's HELLO
    exchange. ``sent`` is set once the ClientHello is in the receiver's socket."""

    def __init__(self, address: str, ctx: ssl.SSLContext) -> None:
        host, _, port = address.rpartition(":")
        self.addr = (host, int(port))
        self.ctx = ctx
        self.sent = threading.Event()
        self.error: BaseException | None = None
        self.answer: control.Kind | None = None
        self.thread = threading.Thread(target=self._main, name="early-hello", daemon=True)

    def _main(self) -> None:
        try:
            self.answer = self._talk()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.sent.set()

    def _talk(self) -> control.Kind:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.ctx.wrap_bio(incoming, outgoing, server_side=False)
        with socket.create_connection(self.addr, timeout=10) as sock:
            with contextlib.suppress(ssl.SSLWantReadError):
                tls.do_handshake()
            sock.sendall(outgoing.read())  # the ClientHello, on loopback: in its socket now
            self.sent.set()
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    sock.sendall(outgoing.read())
                    self._feed(sock, incoming, "during the TLS handshake")
            tls.write(control.hello(b"e" * control.INSTANCE_ID_BYTES, b""))
            sock.sendall(outgoing.read())
            head = self._read(sock, tls, incoming, control.HEAD_SIZE)
            kind, length = control.decode_head(head)
            self._read(sock, tls, incoming, length)
            return kind

    @staticmethod
    def _feed(sock: socket.socket, incoming: ssl.MemoryBIO, when: str) -> None:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"the receiver closed the connection {when}")
        incoming.write(data)

    def _read(
        self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, n: int
    ) -> bytes:
        got = b""
        while len(got) < n:
            try:
                more = tls.read(n - len(got))
            except ssl.SSLWantReadError:
                self._feed(sock, incoming, "before its HELLO")
                continue
            if not more:  # the receiver's close_notify
                raise ConnectionError("the receiver closed the connection before its HELLO")
            got += more
        return got


def _prefill_context(pki: Path) -> ssl.SSLContext:
    return client_context(pki / "ca.pem", pki / "pdorch-prefill.pem", pki / "pdorch-prefill.key")


@contextlib.contextmanager
def _clients(address: str, pki: Path, n: int) -> Iterator[list[_EarlyHello]]:
    clients = [_EarlyHello(address, _prefill_context(pki)) for _ in range(n)]
    try:
        yield clients
    finally:
        for c in clients:
            c.thread.join(15)


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_client_hellos_already_buffered_at_accept_complete(pki: Path, loop_name: str) -> None:
    """N links whose ClientHello reached the receiver's socket while its loop was busy
    (blocked here on purpose until every one was sent): all complete their handshake and
    get the receiver's HELLO. The old receiver (plaintext accept, then `start_tls`) lost
    them on uvloop: the handshake timed out and the receiver closed the connection."""

    async def main() -> None:
        receiver = make_receiver("tcp", SETTINGS, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        try:
            with _clients(address, pki, CLIENTS) as clients:
                for c in clients:
                    c.thread.start()
                for c in clients:  # the loop is busy: nothing of the receiver's runs
                    assert c.sent.wait(10), "a client could not send its ClientHello"
                done = await asyncio.to_thread(lambda: [c.thread.join(15) for c in clients])
                assert len(done) == CLIENTS
            failed = [repr(c.error) for c in clients if c.error is not None]
            assert not failed, f"{len(failed)} of {CLIENTS} links failed: {failed[:3]}"
            assert [c.answer for c in clients] == [control.Kind.HELLO] * CLIENTS
        finally:
            await receiver.close()

    _run(loop_name, main)


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_kv_senders_on_a_busy_receiver_loop_deliver(pki: Path, loop_name: str) -> None:
    """Real senders (in a thread, on their own loop) open N links at once to a receiver
    whose loop is busy while they connect; every KV arrives intact."""
    caches = [testing.synthetic_cache(f"busy-{i}", 1, 64 * testing.KIB) for i in range(CLIENTS)]

    async def send_all(address: str, started: threading.Event) -> None:
        sender = make_sender("tcp", SETTINGS, tls=load_dir(pki, "prefill"))
        try:
            sends = [asyncio.ensure_future(sender.send(address, c)) for c in caches]
            await asyncio.sleep(0)  # the connects are under way
            started.set()
            await asyncio.gather(*sends)
        finally:
            await sender.close()

    async def main() -> None:
        receiver = make_receiver("tcp", SETTINGS, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        started = threading.Event()
        outcome: list[BaseException | None] = []

        def senders() -> None:
            try:
                asyncio.run(send_all(address, started))
                outcome.append(None)
            except BaseException as exc:  # reported by the test
                outcome.append(exc)

        thread = threading.Thread(target=senders, name="kv-senders", daemon=True)
        try:
            thread.start()
            assert started.wait(10)
            # Busy: the senders' ClientHellos reach the socket before this loop reads.
            threading.Event().wait(0.5)
            await asyncio.to_thread(thread.join, 30)
            assert outcome == [None], outcome
            for cache in caches:
                got = await receiver.take(cache.header.request_id, 1, 5)
                assert testing.digest(got) == testing.digest(cache)
        finally:
            await receiver.close()

    _run(loop_name, main)


class _LateFinish(_EarlyHello):
    """A TLS client that completes its side of the handshake (TLS 1.3: its last flight is
    then ready to go) and holds that flight, with its HELLO, until ``go`` is set — a
    receiver whose loop runs late sees the sender's finish arrive late."""

    def __init__(self, address: str, ctx: ssl.SSLContext) -> None:
        super().__init__(address, ctx)
        self.done_here = threading.Event()
        self.go = threading.Event()

    def _talk(self) -> control.Kind:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.ctx.wrap_bio(incoming, outgoing, server_side=False)
        with socket.create_connection(self.addr, timeout=10) as sock:
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    sock.sendall(outgoing.read())
                    self._feed(sock, incoming, "during the TLS handshake")
            tls.write(control.hello(b"l" * control.INSTANCE_ID_BYTES, b""))
            self.done_here.set()
            self.go.wait(10)
            sock.sendall(outgoing.read())  # the client's finish and its HELLO
            head = self._read(sock, tls, incoming, control.HEAD_SIZE)
            kind, length = control.decode_head(head)
            self._read(sock, tls, incoming, length)
            return kind


@pytest.mark.parametrize("loop_name", list(LOOPS))
def test_a_handshake_the_sender_finished_in_time_is_not_cut_by_a_late_receiver(
    pki: Path, loop_name: str
) -> None:
    """The sender's side of the handshake is done within its ``connect_timeout_s``; the
    receiver's loop then stalls past that long since its accept before it reads the
    sender's finish. The receiver still completes the handshake and answers HELLO: its own
    deadline for a newcomer (``accept_timeout_s``) is longer than the sender's. A receiver
    held to the sender's deadline closed the link (seen in CI: a vLLM decode worker's loop
    on a loaded CPU, and the prefill's next write found the link closed)."""
    settings = TransportSettings(connect_timeout_s=1.0, idle_timeout_s=2.0)
    assert settings.accept_timeout_s > settings.connect_timeout_s

    async def main() -> None:
        receiver = make_receiver("tcp", settings, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        try:
            client = _LateFinish(address, _prefill_context(pki))
            started = time.monotonic()  # the receiver's accept follows
            client.thread.start()
            assert await asyncio.to_thread(client.done_here.wait, 10)
            client.go.set()
            # The receiver's loop runs late: the finish arrives while it is busy, and it
            # gets to it past the sender's deadline, counted from its accept.
            threading.Event().wait(1.3 * settings.connect_timeout_s - (time.monotonic() - started))
            await asyncio.to_thread(client.thread.join, 15)
            assert client.error is None, repr(client.error)
            assert client.answer is control.Kind.HELLO
        finally:
            await receiver.close()

    _run(loop_name, main)
