"""The KV link over mutual TLS, who may send KV, and UCX payloads keyed by one-time tokens.

Real sockets, real TLS (certificates from throwaway CAs made by ``cryptography``): the
conformance suite's basic cases run with TLS on for every backend; each attack — a plain TCP
peer, a certificate from another CA, a valid certificate whose identity may not send KV, a
UCX payload without the token the authenticated link announced, a replayed token — is
refused and leaves nothing adopted (no KV held, no bytes reserved).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from pathlib import Path

import numpy as np
import pytest

from transport import control, errors, testing, wire
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import Peer, TransportSettings
from transport.receiver import KvReceiver
from transport.security import LinkTls, client_context, load_dir
from transport.ucx import UcxDataPlane, ucx_available

pytest.importorskip("cryptography", reason="the test extra's cryptography")
from tests.contract.kv_tls_certs import make_pki

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("event_loop_kind")]
"""Every test on asyncio's loop and on uvloop's (tests/contract/conftest.py)."""

_UCX = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")]
BACKENDS = [pytest.param("ucx", marks=_UCX), pytest.param(UCX_READ, marks=_UCX), "tcp"]
KIB, MIB = testing.KIB, testing.MIB
SETTINGS = TransportSettings(connect_timeout_s=2.0, idle_timeout_s=2.0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("kv-pki"))


@pytest.fixture(scope="module")
def rogue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA, with a prefill certificate of its own."""
    return make_pki(tmp_path_factory.mktemp("rogue-pki"), ("prefill",), ca_name="rogue CA")


# ------------------------------------------------------------------ TLS on: it works


@pytest.mark.parametrize("backend", BACKENDS)
def test_basic_conformance_over_tls(backend: str, pki: Path) -> None:
    tls = testing.TlsFiles(str(pki))  # this process: prefill; the peer process: decode
    asyncio.run(testing.check_sizes(backend, (1 * KIB, 4 * MIB), tls=tls))
    asyncio.run(testing.check_replay(backend, tls=tls))


def test_a_worker_identity_sends_and_receives(pki: Path) -> None:
    async def run() -> None:
        receiver = make_receiver("tcp", SETTINGS, tls=load_dir(pki, "worker"))
        address = await receiver.start()
        sender = make_sender("tcp", SETTINGS, tls=load_dir(pki, "worker"))
        try:
            cache = testing.synthetic_cache("w", 1, 256 * KIB)
            await sender.send(address, cache)
            assert testing.digest(await receiver.take("w", 1, 5)) == testing.digest(cache)
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())


# ------------------------------------------------------------------ refused peers


async def _nothing_adopted(receiver: KvReceiver, rid: str) -> None:
    assert receiver.inbox.bytes_in_use == 0
    assert receiver.inbox.held() == []
    with pytest.raises(errors.TransferTimeoutError):
        await receiver.take(rid, 1, timeout_s=0.2)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]


def _refused_twice(caplog: pytest.LogCaptureFixture, reason: str) -> None:
    """The receiver closes a refused handshake without a word the sender can read (no TLS
    alert reaches it), so the sender takes it for a connection lost at setup and makes it
    once more (`KvSender._acquire`): two connections, each refused and logged once."""
    lines = _refusals(caplog)
    assert len(lines) == 2, lines
    assert all(reason in line for line in lines), lines
    peers = {line.split()[5] for line in lines}  # "refused a KV connection from HOST:PORT"
    assert len(peers) == 2, lines
    assert all(p.startswith("127.0.0.1:") for p in peers), lines


async def _offer(pki: Path, tls: LinkTls | None) -> None:
    """A TLS decode receiver, offered KV by a sender with ``tls`` (None: plain TCP); the
    offer must be refused, nothing adopted."""
    receiver = make_receiver("tcp", SETTINGS, tls=load_dir(pki, "decode"))
    address = await receiver.start()
    sender = make_sender("tcp", SETTINGS, tls=tls)
    try:
        with pytest.raises(errors.TransportError) as refused:
            await sender.send(address, testing.synthetic_cache("attack", 1, 256 * KIB))
        assert not refused.value.retryable or isinstance(refused.value, errors.PeerLostError)
        await _nothing_adopted(receiver, "attack")
    finally:
        await sender.close()
        await receiver.close()


def test_a_plain_tcp_peer_is_refused(pki: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "transport")
    asyncio.run(_offer(pki, None))
    _refused_twice(caplog, "no verified certificate")


def test_a_plain_tcp_peer_never_gets_hello(pki: Path) -> None:
    """The receiver's HELLO (its UCX address) goes only to an authenticated sender."""

    async def run() -> None:
        receiver = make_receiver("tcp", SETTINGS, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(control.hello(b"i" * control.INSTANCE_ID_BYTES, b""))
            try:
                answer = await asyncio.wait_for(reader.read(), 5)
            except ConnectionError:
                answer = b""
            assert answer == b"", answer  # closed: no HELLO, no data address
        finally:
            writer.close()
            await receiver.close()

    asyncio.run(run())


def test_a_certificate_from_another_ca_is_refused(
    pki: Path, rogue: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "transport")
    # The attacker trusts our CA (so it gets past its own check of the receiver) and shows
    # a prefill certificate its own CA signed.
    tls = LinkTls(
        client=client_context(
            pki / "ca.pem", rogue / "pdorch-prefill.pem", rogue / "pdorch-prefill.key"
        )
    )
    asyncio.run(_offer(pki, tls))
    _refused_twice(caplog, "TLS handshake failed: CERTIFICATE_VERIFY_FAILED")


@pytest.mark.parametrize("identity", ["decode", "orchestrator", "client"])
def test_a_valid_certificate_that_may_not_send_kv_is_refused(
    pki: Path, identity: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "transport")

    async def run() -> None:
        receiver = make_receiver("tcp", SETTINGS, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        # The sender is hostile: it sends to anyone (its own identity check is off).
        tls = dataclasses.replace(load_dir(pki, identity), receivers=lambda cert: True)
        sender = make_sender("tcp", SETTINGS, tls=tls)
        try:
            with pytest.raises(errors.PeerRejectedError) as refused:
                await sender.send(address, testing.synthetic_cache("attack", 1, 256 * KIB))
            assert "pdorch" not in str(refused.value)  # the refusal tells nothing more
            await _nothing_adopted(receiver, "attack")
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())
    (line,) = _refusals(caplog)
    assert f"pdorch-{identity} at 127.0.0.1:" in line
    assert "may not send KV" in line


@pytest.mark.parametrize("identity", ["prefill", "orchestrator"])
def test_a_sender_sends_kv_only_to_a_decode_identity(
    pki: Path, identity: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "transport")

    async def run() -> None:
        # An impostor receiver with a valid certificate, taking KV from anyone.
        tls = dataclasses.replace(load_dir(pki, identity), senders=lambda cert: True)
        receiver = make_receiver("tcp", SETTINGS, tls=tls)
        address = await receiver.start()
        sender = make_sender("tcp", SETTINGS, tls=load_dir(pki, "prefill"))
        try:
            with pytest.raises(errors.PeerRejectedError, match=f"pdorch-{identity}"):
                await sender.send(address, testing.synthetic_cache("leak", 1, 256 * KIB))
            await _nothing_adopted(receiver, "leak")
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())
    assert any("may not receive KV" in line for line in _refusals(caplog))


def test_a_connection_beyond_the_cap_is_told_so_over_tls(pki: Path) -> None:
    """At the connection cap, with every link moving KV, a TLS sender learns it is out of
    room (`BudgetExceededError`, retryable) — not a broken handshake (the receiver used to
    answer in plaintext, before TLS, which a TLS sender read as a permanent refusal)."""
    settings = dataclasses.replace(SETTINGS, max_connections_per_host=2, max_connections=2)

    async def run() -> None:
        receiver = make_receiver("tcp", settings, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        sender = make_sender("tcp", settings, tls=load_dir(pki, "prefill"))
        caches = [testing.synthetic_cache(f"cap-{i}", 1, 64 * KIB) for i in range(3)]
        try:
            transfers = [await sender.open(address, c.header) for c in caches[:2]]
            with pytest.raises(errors.BudgetExceededError) as refused:
                await sender.open(address, caches[2].header)
            assert refused.value.retryable
            await testing.finish_then_refill(sender, receiver, address, transfers, caches)
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())


# ------------------------------------------------------------------ refusals disclose nothing


def test_a_refusal_to_an_unauthenticated_peer_discloses_nothing(pki: Path) -> None:
    model = wire.ModelSpec("secret-model-fp", n_layers=4, kv_heads=1, head_dim=12345)

    async def refusal(tls: bool) -> str:
        receiver = make_receiver(
            "tcp", SETTINGS, model, tls=load_dir(pki, "decode") if tls else None
        )
        address = await receiver.start()
        sender = make_sender("tcp", SETTINGS, tls=load_dir(pki, "prefill") if tls else None)
        try:
            with pytest.raises(errors.HeaderRejectedError) as refused:
                await sender.send(address, testing.synthetic_cache("probe", 1, 64 * KIB))
            await _nothing_adopted(receiver, "probe")
            return str(refused.value)
        finally:
            await sender.close()
            await receiver.close()

    plain = asyncio.run(refusal(tls=False))
    assert "secret-model-fp" not in plain
    assert "12345" not in plain
    assert "does not match this receiver" in plain
    # An authenticated prefill worker gets the details (its operator needs them).
    assert "secret-model-fp" in asyncio.run(refusal(tls=True))


# ------------------------------------------------------------------ UCX: one-time tokens


async def _inject(receiver: KvReceiver, tags: list[int]) -> None:
    """An attacker's UCX data plane sends a message of junk under each tag to the
    receiver's UCX worker (it learnt the address elsewhere: TLS keeps HELLO from it).

    4 KiB: an eager message, gone from the attacker at once whether it matches or not (tag
    matching ignores sizes: a shorter message matches a receive its tag names, and lands)."""
    attacker = UcxDataPlane()
    await attacker.start()
    target = Peer(b"", receiver.data_address)
    junk = memoryview(np.full(4 * KIB, 0xEE, dtype=np.uint8))
    for tag in tags:
        send = asyncio.ensure_future(attacker.send(target, tag, [junk]))
        done, _ = await asyncio.wait([send], timeout=2.0)
        assert done, "an eager UCX send did not complete"
        send.result()
    attacker.fail_channel(target)
    await attacker.close()


async def _logged(caplog: pytest.LogCaptureFixture, text: str, count: int) -> None:
    """Wait (the receiver sweeps unmatched messages about once a second) for ``count``
    log lines containing ``text``."""
    deadline = asyncio.get_running_loop().time() + 10
    while sum(text in r.getMessage() for r in caplog.records) < count:
        assert asyncio.get_running_loop().time() < deadline, f"no {count} x {text!r} logged"
        await asyncio.sleep(0.05)


@pytest.mark.ucx
@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
def test_ucx_payloads_without_the_announced_token_land_nowhere(
    pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "transport")

    async def run() -> None:
        receiver = make_receiver("ucx", SETTINGS, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        sender = make_sender("ucx", SETTINGS, tls=load_dir(pki, "prefill"))
        cache = testing.synthetic_cache("legit", 1, 64 * KIB, n_layers=2)
        try:
            transfer = await sender.open(address, cache.header)
            token = transfer.token
            assert receiver.tokens.state(token) == "live"
            # Unannounced tokens: a fresh one (a sender's own choice) and neighbours of the
            # live one (another transfer's).
            forged = [control.new_token(), token ^ (1 << 16), token ^ (1 << 40)]
            await _inject(receiver, [control.layer_tag(t, 0) for t in forged])
            # Refused (taken off UCX's queue and dropped), one line each.
            await _logged(caplog, "which no transfer announced", len(forged))
            for i, (k, v) in enumerate(cache.layers):
                await transfer.send_layer(i, k, v)
            await transfer.finish()
            got = await receiver.take("legit", 1, 5)
            assert testing.digest(got) == testing.digest(cache)  # no junk landed in it
            got.release()
            assert receiver.tokens.state(token) == "spent"

            # Replay: the spent token again, then the next transfer of the same size.
            await _inject(receiver, [control.layer_tag(token, 0)])
            await _logged(caplog, f"under a spent transfer token {token:#x}", 1)
            nxt = testing.synthetic_cache("legit", 2, 64 * KIB, n_layers=2, seed=7)
            transfer = await sender.open(address, nxt.header)
            assert transfer.token != token  # one-time: never issued again
            for i, (k, v) in enumerate(nxt.layers):
                await transfer.send_layer(i, k, v)
            await transfer.finish()
            got = await receiver.take("legit", 2, 5)
            assert testing.digest(got) == testing.digest(nxt)
            got.release()
            assert receiver.inbox.bytes_in_use == 0
            assert receiver.inbox.held() == []
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())


@pytest.mark.ucx
@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
def test_a_payload_replayed_into_a_live_token_is_refused(pki: Path) -> None:
    """Someone who learnt a live token (it travels only under TLS) and beats the sender to
    it: the bytes land in that transfer's own reservation only, and fail its checksums —
    the transfer is refused and nothing is adopted."""

    async def run() -> None:
        receiver = make_receiver("ucx", SETTINGS, tls=load_dir(pki, "decode"))
        address = await receiver.start()
        sender = make_sender("ucx", SETTINGS, tls=load_dir(pki, "prefill"))
        cache = testing.synthetic_cache("victim", 1, 64 * KIB, n_layers=2)
        try:
            transfer = await sender.open(address, cache.header)
            await _inject(receiver, [control.layer_tag(transfer.token, 0)])
            for i, (k, v) in enumerate(cache.layers):
                await transfer.send_layer(i, k, v)
            with pytest.raises(errors.TransportError):
                await transfer.finish()
            with pytest.raises(errors.TransportError):
                await receiver.take("victim", 1, 5)
            assert receiver.inbox.bytes_in_use == 0
            # The receiver lingers a moment after its refusal, then spends the token.
            deadline = asyncio.get_running_loop().time() + 5
            while receiver.tokens.state(transfer.token) != "spent":
                assert asyncio.get_running_loop().time() < deadline, "token still live"
                await asyncio.sleep(0.05)
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(run())


# ------------------------------------------------------------------ configuration


def test_load_dir_names_the_missing_file(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(errors.TlsConfigError, match=r"pdorch-nobody\.pem is missing"):
        load_dir(pki, "nobody")
    (tmp_path / "ca.pem").write_text("not a certificate")
    for name in ("pdorch-prefill.pem", "pdorch-prefill.key"):
        (tmp_path / name).write_bytes((pki / name).read_bytes())
    with pytest.raises(errors.TlsConfigError, match="cannot load prefill's certificate"):
        load_dir(tmp_path, "prefill")


def test_a_context_that_does_not_verify_the_peer_is_refused(pki: Path) -> None:
    ctx = client_context(pki / "ca.pem", pki / "pdorch-prefill.pem", pki / "pdorch-prefill.key")
    ctx.verify_mode = ssl.CERT_NONE
    with pytest.raises(ValueError, match="require the peer's certificate"):
        LinkTls(client=ctx)


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("pdorch-prefill", True),
        ("pdorch-worker", True),
        ("pdorch-prefill.prefill-3", True),  # an instance, named for logs
        ("pdorch-prefillx", False),
        ("pdorch-decode", False),
        ("pdorch-orchestrator", False),
        ("prefill", False),
        (None, False),
    ],
)
def test_who_may_send_kv(name: str | None, allowed: bool) -> None:
    cert = {"subject": ((("commonName", name),),)} if name else {}
    assert LinkTls().senders(cert) is allowed


def test_each_variant_runs_on_its_loop(event_loop_kind: str) -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__.partition(".")[0]

    assert asyncio.run(loop_module()) == event_loop_kind
