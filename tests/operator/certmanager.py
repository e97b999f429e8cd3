"""The part of cert-manager's ``cert-manager.io/v1`` Certificate schema that pdorch renders.

kubernetes-validate knows only built-in kinds. This is written from cert-manager's v1 API
reference (https://cert-manager.io/docs/reference/api-docs/#cert-manager.io/v1.Certificate),
closed (an unknown or misspelled field fails) and limited to the fields the operator sets;
the enums are cert-manager's. Checked by hand against cert-manager 1.x, not generated from
its CRD, so it can lag a new cert-manager release (a new optional field does not matter: we
don't render it).
"""

from __future__ import annotations

from typing import Any

import jsonschema

# cert-manager's KeyUsage values.
_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
]  # fmt: skip

_STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1}}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

CERTIFICATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                # cert-manager copies the name into label values: at most 63 characters.
                "name": {"type": "string", "maxLength": 63},
                "namespace": {"type": "string"},
                "labels": _STRING_MAP,
                "ownerReferences": {"type": "array"},
            },
        },
        "spec": {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "additionalProperties": False,
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "secretTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"labels": _STRING_MAP, "annotations": _STRING_MAP},
                },
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": _STRINGS,
                "usages": {"type": "array", "items": {"enum": _USAGES}},
                "duration": {"type": "string"},
                "renewBefore": {"type": "string"},
                "privateKey": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    },
                },
                "issuerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "kind": {"type": "string"},
                        "group": {"type": "string"},
                    },
                },
            },
        },
    },
}


def validate_certificate(obj: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(CERTIFICATE_SCHEMA).validate(obj)
