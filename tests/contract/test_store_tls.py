"""The store over TLS (``rediss://``): the contract suite against a redis-server serving TLS
only to its clients, with certificates from a throwaway CA made by the ``cryptography``
package, and an ACL user holding only the orchestrator's rules.

Skipped, with the reason, where ``cryptography`` is not installed (it is in the ``test``
extra) or redis-server was built without TLS.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import ipaddress
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.ports import free_port
from orchestrator.store.keys import encode
from orchestrator.store.redis_store import RedisStore, StoreSettings
from orchestrator.store.server import RedisServer, RedisServerError
from orchestrator.store.url import with_password
from tests.contract import test_store as suite
from tests.contract.test_store_acl import PASSWORDS, PREFIX, _config

x509 = pytest.importorskip("cryptography.x509", reason="the test extra's cryptography")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ADMIN = secrets.token_hex(16)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca_and_server(folder: Path) -> tuple[Path, Path, Path]:
    """(CA cert, server cert, server key) for 127.0.0.1, written as PEM under ``folder``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("pdorch test CA"))
        .issuer_name(_name("pdorch test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("redis"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (folder / "ca.pem", folder / "redis.pem", folder / "redis-key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem(key))
    paths[2].chmod(0o600)
    return paths


class TlsServer:
    def __init__(self, server: RedisServer, tls_port: int, ca: Path) -> None:
        self.server = server
        self.tls_port = tls_port
        self.ca = ca

    def url(self, role: str) -> str:
        base = f"rediss://{role}@127.0.0.1:{self.tls_port}/0?ssl_ca_certs={self.ca}"
        return with_password(base, PASSWORDS[role])


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    folder = tmp_path_factory.mktemp("redis-tls")
    ca, cert, key = make_ca_and_server(folder)
    tls_port = free_port()
    config = [
        *_config(),
        f"tls-port {tls_port}",
        f"tls-cert-file {cert}",
        f"tls-key-file {key}",
        f"tls-ca-cert-file {ca}",
        "tls-auth-clients no",
    ]
    # The plain port stays on loopback for the launcher's readiness probe (admin only).
    server = RedisServer(folder, config=config, password=None)
    server.config = (*server.config, f"requirepass {ADMIN}")
    server.password = ADMIN
    try:
        server.start()
    except RedisServerError as exc:
        if "TLS" in str(exc) and "not" in str(exc).lower():
            pytest.skip(f"redis-server built without TLS: {exc}")
        raise
    try:
        yield TlsServer(server, tls_port, ca)
    finally:
        server.kill()


@pytest.fixture
def settings(tls: TlsServer, request: pytest.FixtureRequest) -> StoreSettings:
    return StoreSettings(
        url=tls.url("orchestrator"),
        prefix=f"{PREFIX}:{encode(request.node.name)}",
        socket_timeout_s=suite.HEALTHY_TIMEOUT_S,
        connect_timeout_s=suite.HEALTHY_TIMEOUT_S,  # a TLS handshake on a loaded machine
        record_ttl_s=600,
    )


@pytest.fixture
def backend(settings: StoreSettings) -> suite.Backend:
    return suite.Backend(settings)


for _name_, _test in vars(suite).items():
    if _name_.startswith("test_") and "backend" in inspect.signature(_test).parameters:
        globals()[_name_] = _test


def test_the_tls_port_speaks_only_tls_and_checks_the_ca(tls: TlsServer, tmp_path: Path) -> None:
    plain = redis.Redis(port=tls.tls_port, socket_timeout=2)
    try:
        with pytest.raises(redis.ConnectionError):
            plain.ping()
    finally:
        plain.close()
    other_ca, _, _ = make_ca_and_server(tmp_path)  # a CA that did not sign the server's cert
    url = tls.url("orchestrator").replace(str(tls.ca), str(other_ca))
    store = RedisStore(StoreSettings(url=url, prefix=PREFIX, connect_timeout_s=2))

    async def scenario() -> None:
        try:
            from orchestrator import errors  # noqa: PLC0415

            with pytest.raises(errors.UnavailableError):
                await store.ping()
        finally:
            await store.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    good = redis.Redis.from_url(tls.url("orchestrator"), socket_timeout=2)
    try:
        assert good.ping()
        assert good.connection_pool.connection_class is redis.SSLConnection
    finally:
        good.close()
