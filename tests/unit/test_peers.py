"""The identity policy (pure) and the throwaway CA's files."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from orchestrator.certs import make_tls_dir
from orchestrator.core.peers import (
    ORCHESTRATOR_SERVER_NAME,
    WORKER_SERVER_NAME,
    Role,
    Surface,
    TlsFiles,
    check_peer,
    role_of,
)
from orchestrator.errors import PermissionDeniedError


@pytest.mark.parametrize(
    ("name", "role"),
    [
        ("pdorch-orchestrator", Role.ORCHESTRATOR),
        ("pdorch-decode.decode-3", Role.DECODE),
        ("pdorch-worker", Role.WORKER),
        ("pdorch-client.ci", Role.CLIENT),
        ("pdorch-admin", None),
        ("orchestrator", None),
        ("pdorch-", None),
        ("", None),
        (None, None),
    ],
)
def test_role_of(name: str | None, role: Role | None) -> None:
    assert role_of(name) == role


@pytest.mark.parametrize(
    ("surface", "allowed"),
    [
        (Surface.WORKER_API, {Role.ORCHESTRATOR}),
        (Surface.CLIENT_API, {Role.CLIENT}),
        (Surface.KV, {Role.PREFILL, Role.WORKER}),
    ],
)
def test_who_may_call_what(surface: Surface, allowed: set[Role]) -> None:
    for role in Role:
        if role in allowed:
            assert check_peer(surface, f"{role.identity}.x") == role
        else:
            with pytest.raises(PermissionDeniedError, match=role.identity):
                check_peer(surface, role.identity)
    with pytest.raises(PermissionDeniedError, match="without a pdorch identity"):
        check_peer(surface, None)


def test_a_tls_directory(tmp_path: Path) -> None:
    out = make_tls_dir(tmp_path / "tls", hosts=["10.0.0.7", "pdorch.example"])
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for role in Role:
        files = TlsFiles(out, role.identity)
        assert stat.S_IMODE(Path(files.key).stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate(Path(files.cert).read_bytes())
        cert.verify_directly_issued_by(ca)
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        assert role_of(str(cn)) == role
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = set(san.get_values_for_type(x509.DNSName))
        ips = {str(i) for i in san.get_values_for_type(x509.IPAddress)}
        assert {"localhost", "pdorch.example", role.identity} <= dns
        assert ips == {"127.0.0.1", "10.0.0.7"}
        is_worker = role in (Role.PREFILL, Role.DECODE, Role.WORKER)
        assert (WORKER_SERVER_NAME in dns) == is_worker
        assert (ORCHESTRATOR_SERVER_NAME in dns) == (role == Role.ORCHESTRATOR)
    assert not list(out.glob("ca.key"))  # the CA's key is not kept


def test_pdorch_certs_makes_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli import main  # noqa: PLC0415

    assert main(["certs", str(tmp_path / "d"), "--host", "10.1.2.3"]) == 0
    assert "--tls-dir" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(
        ["ca.pem", *(f"{r.identity}.{ext}" for r in Role for ext in ("pem", "key"))]
    )


def test_a_stream_torn_down_under_a_call_is_a_link_fault() -> None:
    """Over TLS a corrupted record ends the call UNKNOWN "Stream removed" (gRPC core's
    words); a worker's own failure is UNKNOWN "Unexpected ..." and stays final."""
    import grpc  # noqa: PLC0415

    from orchestrator.api.protocol import link_broke  # noqa: PLC0415

    unknown = grpc.StatusCode.UNKNOWN
    assert link_broke(unknown, "Stream removed (Unwrap failed (TSI_DATA_CORRUPTED))")
    assert not link_broke(unknown, "Unexpected <class 'RuntimeError'>: boom")
    assert not link_broke(unknown, None)
    assert not link_broke(grpc.StatusCode.INVALID_ARGUMENT, "Stream removed")


def test_plaintext_is_said_loudly(caplog: pytest.LogCaptureFixture) -> None:
    import argparse  # noqa: PLC0415

    from orchestrator.cli.common import server_tls_dir  # noqa: PLC0415

    assert server_tls_dir(argparse.Namespace(tls_dir="/x", insecure=False), "w") == "/x"
    assert caplog.records == []
    assert server_tls_dir(argparse.Namespace(tls_dir="/x", insecure=True), "w") == ""
    assert server_tls_dir(argparse.Namespace(tls_dir="", insecure=False), "w") == ""
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("WARNING", "NO TLS: --insecure: w serves plaintext, for debugging only (anyone on the "
         "network can read and forge its traffic; README: Security)"),
        ("WARNING", "NO TLS: no --tls-dir: w serves plaintext (anyone on the network can read "
         "and forge its traffic; README: Security)"),
    ]  # fmt: skip


def test_a_tls_directory_missing_a_file_is_a_config_error(tmp_path: Path) -> None:
    from orchestrator.api.tls import Tls, load_worker  # noqa: PLC0415
    from orchestrator.errors import ConfigError  # noqa: PLC0415

    make_tls_dir(tmp_path, roles=[Role.WORKER])
    assert load_worker(tmp_path, "decode").identity == "pdorch-worker"  # the both-roles one
    with pytest.raises(ConfigError, match=r"--tls-dir: .*pdorch-client\.pem: No such file"):
        Tls.load(tmp_path, Role.CLIENT.identity)
    assert "BEGIN" not in repr(load_worker(tmp_path, "prefill"))  # no key in a repr
