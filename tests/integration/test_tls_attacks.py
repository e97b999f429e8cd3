"""The certificate rows of the attack table (README: Security), tried against a real local
cluster running TLS (its throwaway CA, as every `LocalCluster` does): each attempt is
refused with a clear error, logged with the peer's identity where it has one, and writes
nothing.

    attempt                                              refused with
    a client certificate from another CA                 handshake failure (UNAVAILABLE)
    a worker's certificate calling the client API        PERMISSION_DENIED
    a client's (or a worker's) certificate calling a     PERMISSION_DENIED
      worker's Prefill / Decode / Generate directly
    plaintext to a TLS port (client API, worker, HTTPS)  handshake failure / connection closed
    KV offered to a decode worker's KV port in plain,    a transport error (TLS handshake),
      with another CA's certificate, or as a client      PeerRejectedError (identity)
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from orchestrator.api import orchestrator_pb2_grpc, worker_pb2, worker_pb2_grpc
from orchestrator.api.tls import Tls, secure_channel
from orchestrator.certs import make_tls_dir
from orchestrator.cluster import LocalCluster
from orchestrator.core.peers import WORKER_SERVER_NAME, Role
from orchestrator.ports import free_port
from orchestrator.rpc.client import channel
from orchestrator.store.keys import Keys
from tests.integration.conftest import request, wait_for
from transport import errors as terr
from transport.backends import make_sender
from transport.base import TransportSettings
from transport.security import LinkTls, load_dir
from transport.testing import synthetic_cache

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(model="tiny", transport="tcp", prefill_workers=1, decode_workers=1)
    with c:
        yield c


@pytest.fixture(scope="module")
def https_gateway(cluster: LocalCluster) -> str:
    """A second orchestrator whose gateway serves HTTPS (the local cluster's own gateways
    are plain HTTP on loopback): its base URL."""
    port = free_port()
    cluster.start_orchestrator(1, 0, "--http-port", str(port))
    return f"https://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA's directory: certificates with pdorch's names, signed by someone else."""
    return make_tls_dir(tmp_path_factory.mktemp("stranger"))


def record(cluster: LocalCluster, rid: str) -> dict[str, str]:
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        return dict(client.hgetall(Keys().request(rid)))  # type: ignore[arg-type]
    finally:
        client.close()


def worker_state(cluster: LocalCluster, name: str) -> tuple[int, int]:
    """A worker's (active sequences, KV bytes held) from its heartbeat."""
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        info = json.loads(str(client.get(Keys().worker(name))))
    finally:
        client.close()
    return int(info["active"]), int(info["kv_used_bytes"])


def settled_idle(cluster: LocalCluster, name: str) -> None:
    """The worker's heartbeat reaches (0 active, 0 KV held): a refused call left nothing. A
    heartbeat is up to a second old, so the first test's own request may still show."""
    wait_for(lambda: worker_state(cluster, name) == (0, 0), 10, f"{name} idle")


def log_of(cluster: LocalCluster, name: str) -> str:
    return (cluster.workdir / f"{name}.log").read_text(errors="replace")


def generate(address: str, tls: Tls | None, rid: str) -> grpc.aio.AioRpcError:
    async def call() -> None:
        async with channel(address, tls=tls) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            async for _ in stub.Generate(request("hi", request_id=rid), timeout=20):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        asyncio.run(call())
    return caught.value


def call_worker(address: str, ch_factory: object) -> dict[str, grpc.StatusCode]:
    """Prefill, Decode, DecodeMany, CallMany and Generate on a worker through
    ``ch_factory()``: each's code."""

    async def main() -> dict[str, grpc.StatusCode]:
        codes: dict[str, grpc.StatusCode] = {}
        async with ch_factory() as ch:  # type: ignore[operator]
            prefill = worker_pb2_grpc.PrefillServiceStub(ch)
            decode = worker_pb2_grpc.DecodeServiceStub(ch)
            general = worker_pb2_grpc.WorkerServiceStub(ch)
            calls = {
                "Prefill": lambda: prefill.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="evil-1", epoch=1, token_ids=[1, 2, 3], kv_target=address
                    ),
                    timeout=20,
                ),
                "Release": lambda: decode.Release(
                    worker_pb2.ReleaseRequest(request_id="evil-1", epoch=2**64 - 1), timeout=20
                ),
            }
            for name, make in calls.items():
                try:
                    await make()
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
            for name, stream in (
                (
                    "Decode",
                    lambda: decode.Decode(
                        worker_pb2.DecodeRequest(request_id="evil-1", epoch=1), timeout=20
                    ),
                ),
                # Opened without a command: grpc's asyncio client reports a write that
                # meets the server's refusal as INTERNAL, not the refusal (grpc/grpc#36066),
                # and the refusal comes before any command is read. A worker that served it
                # would leave the call open until its deadline (DEADLINE_EXCEEDED).
                ("DecodeMany", lambda: decode.DecodeMany(timeout=20)),
                ("CallMany", lambda: general.CallMany(timeout=20)),
                (
                    "Generate",
                    lambda: general.Generate(
                        worker_pb2.AggregatedRequest(
                            request_id="evil-2", epoch=1, token_ids=[1, 2, 3], max_tokens=4
                        ),
                        timeout=20,
                    ),
                ),
            ):
                try:
                    async for _ in stream():
                        pass
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
        return codes

    return asyncio.run(main())


def test_the_cluster_serves_its_own_client_over_tls(cluster: LocalCluster) -> None:
    async def call() -> list[int]:
        async with cluster.channel(cluster.orchestrator_addresses[0]) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            req = request("hello", request_id="tls-ok", max_tokens=4)
            return [t async for c in stub.Generate(req, timeout=60) for t in c.token_ids]

    assert len(asyncio.run(call())) == 4
    assert record(cluster, "tls-ok")["state"] == "done"


def test_a_client_certificate_from_another_ca_is_refused(
    cluster: LocalCluster, stranger: Path
) -> None:
    theirs = Tls.load(stranger, Role.CLIENT.identity)
    ours = cluster.credentials()
    assert ours is not None
    # They trust our CA (so they can verify our server) but their certificate is not ours.
    forged = Tls(theirs.files, ours.ca, theirs.cert, theirs.key)
    err = generate(cluster.orchestrator_addresses[0], forged, "stranger-1")
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert record(cluster, "stranger-1") == {}
    # an orchestrator certificate from another CA gets no further with a worker
    orch = Tls.load(stranger, Role.ORCHESTRATOR.identity)
    forged_orch = Tls(orch.files, ours.ca, orch.cert, orch.key)
    decode = cluster.expected["decode-0"]
    codes = call_worker(decode, lambda: secure_channel(decode, forged_orch, WORKER_SERVER_NAME))
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, codes
    settled_idle(cluster, "decode-0")


def test_a_worker_certificate_cannot_call_the_client_api(cluster: LocalCluster) -> None:
    worker = cluster.credentials(Role.DECODE)
    err = generate(cluster.orchestrator_addresses[0], worker, "as-worker-1")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'pdorch-decode' may not call the client API" in (err.details() or "")
    assert record(cluster, "as-worker-1") == {}
    assert "(certificate 'pdorch-decode')" in log_of(cluster, "orchestrator-0")


@pytest.mark.parametrize("role", [Role.CLIENT, Role.PREFILL])
def test_only_an_orchestrator_may_call_a_worker(cluster: LocalCluster, role: Role) -> None:
    """Prefill (with a kv_target of the caller's choosing), Decode, Release with the
    highest epoch, and Generate (tokens with no record), straight at the workers."""
    tls = cluster.credentials(role)
    assert tls is not None
    for name in ("prefill-0", "decode-0"):
        address = cluster.expected[name]
        codes = call_worker(address, lambda a=address: secure_channel(a, tls, WORKER_SERVER_NAME))
        assert set(codes.values()) == {grpc.StatusCode.PERMISSION_DENIED}, (name, codes)
        line = f"(certificate '{role.identity}'): certificate '{role.identity}' may not call"
        assert line in log_of(cluster, name)
        settled_idle(cluster, name)  # nothing ran, no KV held


def test_plaintext_to_a_tls_port_is_refused(cluster: LocalCluster) -> None:
    err = generate(cluster.orchestrator_addresses[0], None, "plain-1")
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert record(cluster, "plain-1") == {}
    decode = cluster.expected["decode-0"]
    codes = call_worker(decode, lambda: grpc.aio.insecure_channel(decode))
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, codes
    settled_idle(cluster, "decode-0")


def test_the_gateway_serves_https_and_refuses_plain_http(
    cluster: LocalCluster, https_gateway: str, stranger: Path
) -> None:
    client = cluster.credentials()
    assert client is not None
    cert, key, ca = client.ssl_files()
    with_cert = ssl.create_default_context(cafile=ca)
    with_cert.load_cert_chain(cert, key)
    assert httpx.get(f"{https_gateway}/health", verify=with_cert, timeout=10).status_code == 200
    without = ssl.create_default_context(cafile=ca)  # the cluster requires client certificates
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{https_gateway}/health", verify=without, timeout=10)
    plain = https_gateway.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/health", timeout=10)
    theirs = ssl.create_default_context(cafile=ca)
    theirs.load_cert_chain(stranger / "pdorch-client.pem", stranger / "pdorch-client.key")
    with pytest.raises(httpx.HTTPError):
        httpx.post(
            f"{https_gateway}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            headers={"x-request-id": "stranger-http-1"},
            verify=theirs,
            timeout=10,
        )
    assert record(cluster, "stranger-http-1") == {}


def kv_address_of(cluster: LocalCluster, name: str) -> str:
    client = redis.Redis(port=cluster.redis_port, decode_responses=True)
    try:
        return str(json.loads(str(client.get(Keys().worker(name))))["kv_address"])
    finally:
        client.close()


def offer_kv(address: str, tls: LinkTls | None) -> BaseException:
    """Offer a synthetic KV to a decode worker's KV port as a sender with ``tls``: the error."""

    async def main() -> BaseException:
        sender = make_sender("tcp", TransportSettings(connect_timeout_s=5.0), tls=tls)
        await sender.start()
        try:
            await sender.send(address, synthetic_cache("evil-kv", 1, 1 << 16))
        except terr.TransportError as exc:
            return exc
        finally:
            await sender.close()
        raise AssertionError("the decode worker accepted KV from an unauthenticated peer")

    return asyncio.run(main())


def test_kv_from_a_peer_without_a_prefill_identity_is_refused(
    cluster: LocalCluster, stranger: Path
) -> None:
    """The KV rows: a decode worker's KV port (its TCP control link, mutual TLS from the
    cluster's CA) refuses plaintext, another CA's prefill certificate and the cluster's own
    client certificate; nothing is held, and the identity refusal names the peer."""
    address = kv_address_of(cluster, "decode-0")
    plain = offer_kv(address, None)
    foreign = offer_kv(address, load_dir(stranger, Role.PREFILL.identity))
    client = offer_kv(address, load_dir(cluster.tls_dir, Role.CLIENT.identity))
    for refused in (plain, foreign, client):
        assert isinstance(refused, terr.TransportError), refused
    assert isinstance(client, terr.PeerRejectedError), client
    settled_idle(cluster, "decode-0")
    assert Role.CLIENT.identity in log_of(cluster, "decode-0")
