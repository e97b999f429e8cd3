"""A throwaway certificate authority: one CA and a key and certificate per pdorch identity.

`make_tls_dir(directory)` writes, with the `cryptography` package (nothing hand-rolled):

    <dir>/ca.pem                  the CA's certificate (what every peer is verified against)
    <dir>/<identity>.pem          an identity's certificate, signed by the CA
    <dir>/<identity>.key          its private key (PKCS#8 PEM, unencrypted, mode 0600)

for the identities of `orchestrator.core.peers.Role` (``pdorch-orchestrator``,
``pdorch-prefill``, ``pdorch-decode``, ``pdorch-worker``, ``pdorch-client``). Each certificate's
subject common name is its identity (the role the policy checks); its SANs are DNS
``localhost``, the identity's server names (`peers.server_names`) and IP ``127.0.0.1``, plus
any ``hosts`` given; it serves as both TLS server and client. The CA's own key is not kept:
nothing can be signed into this directory's trust after it is made.

Local clusters (`orchestrator.cluster.LocalCluster`: `pdorch up`, `demo`, `chaos`, the tests)
make one at start in their work directory; `pdorch certs DIR` makes one for a hand-run
deployment. Keys are EC P-256 (an RSA key takes tens of milliseconds to make; P-256, well
under one), certificates last `VALIDITY` — throwaway means it: a deployment's CA is its own
(cert-manager, README: Security).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from orchestrator.core.peers import (
    CA_FILE,
    LOCAL_ADDRESSES,
    LOCAL_NAMES,
    Role,
    TlsFiles,
    server_names,
)

VALIDITY = datetime.timedelta(days=30)
_BACKDATE = datetime.timedelta(minutes=5)
"""Certificates start a little in the past: a peer whose clock lags is not refused."""
KEY_MODE = 0o600


_CA_USAGE = x509.KeyUsage(
    digital_signature=False,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdorch (throwaway CA)"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file readable by its owner only (never briefly wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_MODE)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _san(names: Iterable[str], hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    dns: list[str] = []
    ips: list[str] = []
    for host in (*names, *LOCAL_NAMES, *LOCAL_ADDRESSES, *hosts):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            dns.append(host)
        else:
            ips.append(host)
    entries: list[x509.GeneralName] = [x509.DNSName(d) for d in dict.fromkeys(dns)]
    entries += [x509.IPAddress(ipaddress.ip_address(i)) for i in dict.fromkeys(ips)]
    return x509.SubjectAlternativeName(entries)


def make_tls_dir(
    directory: str | os.PathLike[str],
    roles: Iterable[Role] = tuple(Role),
    hosts: Sequence[str] = (),
) -> Path:
    """Make a CA and a certificate for each of ``roles`` in ``directory`` (created if need
    be; existing files of the same names are replaced). ``hosts``: further DNS names or IP
    addresses every certificate carries (a machine's address, to be reached off loopback).
    Returns the directory."""
    out = Path(directory)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = _key()
    ca_name = _name("pdorch throwaway CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    (out / CA_FILE).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    issuer = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    for role in roles:
        files = TlsFiles(out, role.identity)
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(role.identity))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(server_names(role), hosts), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(issuer, critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        Path(files.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(
            Path(files.key),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
    return out
