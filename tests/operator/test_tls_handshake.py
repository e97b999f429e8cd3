"""What the rendered TLS amounts to, end to end without a cluster: certificates issued exactly
as the rendered Certificates ask (a throwaway CA standing in for cert-manager), each pod's
volume laid out file by file as the kubelet would from its `items`, then real TLS handshakes
(Python's ssl, in memory) between those directories: the runtime's checks pass with what a
pod gets, and fail where they should."""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.operator.conftest import MINIMAL_SPEC, TLS_CERT_MANAGER, rendered, spec_with

_EKU = {
    "server auth": ExtendedKeyUsageOID.SERVER_AUTH,
    "client auth": ExtendedKeyUsageOID.CLIENT_AUTH,
}
_NOW = datetime.datetime.now(datetime.UTC)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _issue(
    subject_cn: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    dns_names: Sequence[str] = (),
    usages: Sequence[str] = (),
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_NOW - datetime.timedelta(minutes=5))
        .not_valid_after(_NOW + datetime.timedelta(hours=1))
    )
    if issuer is None:  # the CA
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
        signer = key
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), False
        )
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([_EKU[u] for u in usages if u in _EKU]), False
        )
        signer = issuer[1]
    return builder.sign(signer, hashes.SHA256())


def _secrets_from_certificates(objs: dict[tuple[str, str], Any]) -> dict[str, dict[str, bytes]]:
    """What cert-manager would write: each Certificate's Secret (tls.crt, tls.key, ca.crt)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("test-ca", ca_key, None)
    out = {}
    for (kind, _), cert in objs.items():
        if kind != "Certificate":
            continue
        spec = cert["spec"]
        assert spec["privateKey"]["algorithm"] == "ECDSA"
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = _issue(
            spec["commonName"], key, (ca, ca_key), dns_names=spec["dnsNames"], usages=spec["usages"]
        )
        out[spec["secretName"]] = {
            "tls.crt": _pem(leaf),
            "tls.key": key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,  # spec.privateKey.encoding
                serialization.NoEncryption(),
            ),
            "ca.crt": _pem(ca),
        }
    return out


def _materialize(pod: dict[str, Any], secrets: dict[str, dict[str, bytes]], root: Path) -> Path:
    """The pod's TLS volume as the kubelet lays it out: each item's key at its path."""
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    directory = root / mount["mountPath"].strip("/")
    directory.mkdir(parents=True)
    for source in volume["projected"]["sources"]:
        data = secrets[source["secret"]["name"]]
        for item in source["secret"]["items"]:
            (directory / item["path"]).write_bytes(data[item["key"]])
    return directory


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    """Each component's TLS directory, as its pod gets it, from one CA."""
    objs = rendered(spec_with(MINIMAL_SPEC, "tls", TLS_CERT_MANAGER))
    secrets = _secrets_from_certificates(objs)
    return {
        c: _materialize(
            objs["Deployment", f"llama-{c}"]["spec"]["template"]["spec"], secrets, tmp_path / c
        )
        for c in ("orchestrator", "prefill", "decode")
    }


def _handshake(
    server_dir: Path, server_id: str, client_dir: Path, client_id: str, name: str
) -> str:
    """Mutual TLS as the runtime does it: the server requires a client certificate from the
    CA, the client checks the server against `name`. The client's common name, as the
    server sees it."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(server_dir / f"{server_id}.pem", server_dir / f"{server_id}.key")
    server.load_verify_locations(server_dir / "ca.pem")
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(client_dir / f"{client_id}.pem", client_dir / f"{client_id}.key")
    client.load_verify_locations(client_dir / "ca.pem")
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(10):
        for side, obj in (("c", c), ("s", s)):
            if not done[side]:
                try:
                    obj.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            break
    peer = s.getpeercert()
    assert peer is not None
    return str(dict(x[0] for x in peer["subject"])["commonName"])


def test_an_orchestrator_calls_a_worker_with_what_its_pod_holds(dirs: dict[str, Path]) -> None:
    for worker in ("prefill", "decode"):
        # Workers are checked as "a worker", whatever address they are dialled at.
        cn = _handshake(
            dirs[worker],
            f"pdorch-{worker}",
            dirs["orchestrator"],
            "pdorch-orchestrator",
            "pdorch-worker",
        )
        assert cn == "pdorch-orchestrator"


def test_prefill_sends_kv_to_decode_as_itself(dirs: dict[str, Path]) -> None:
    cn = _handshake(
        dirs["decode"], "pdorch-decode", dirs["prefill"], "pdorch-prefill", "pdorch-worker"
    )
    assert cn == "pdorch-prefill"


def test_clients_reach_the_orchestrators_by_their_service_name(dirs: dict[str, Path]) -> None:
    for name in ("pdorch-orchestrator", "llama", "llama.ml.svc.cluster.local"):
        _handshake(
            dirs["orchestrator"], "pdorch-orchestrator", dirs["prefill"], "pdorch-prefill", name
        )


def test_a_worker_does_not_pass_for_an_orchestrator(dirs: dict[str, Path]) -> None:
    """A worker's certificate does not carry the orchestrators' names."""
    for name in ("pdorch-orchestrator", "llama"):
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(
                dirs["prefill"], "pdorch-prefill", dirs["orchestrator"], "pdorch-orchestrator", name
            )


def test_a_pod_holds_no_other_component_key(dirs: dict[str, Path]) -> None:
    for component, directory in dirs.items():
        files = sorted(p.name for p in directory.iterdir())
        assert files == sorted(["ca.pem", f"pdorch-{component}.pem", f"pdorch-{component}.key"])
