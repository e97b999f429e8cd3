"""Client-chosen strings (`orchestrator.core.idents`): the request-id and tenant rules, and
the bounded echo of a client's string in errors and logs. Pure."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator import errors
from orchestrator.core.idents import (
    ECHO_CHARS,
    MAX_REQUEST_ID_BYTES,
    MAX_TENANT_BYTES,
    check_request_id,
    check_tenant,
    id_problem,
    shown,
)
from transport import wire

SMILE = "\N{SLIGHTLY SMILING FACE}"  # 4 bytes of UTF-8


def test_the_id_limit_is_the_kv_headers_and_counts_bytes() -> None:
    assert MAX_REQUEST_ID_BYTES == wire.MAX_ID_BYTES
    assert id_problem("r" * MAX_REQUEST_ID_BYTES) is None
    assert id_problem(SMILE * (MAX_REQUEST_ID_BYTES // 4)) is None
    assert "bytes" in (id_problem(SMILE * 65) or "")  # 65 characters, 260 bytes
    assert id_problem("é" * (MAX_REQUEST_ID_BYTES // 2 + 1)) is not None
    # every id admitted fits the header a prefill worker sends
    kv = np.zeros((1, 2, 4), np.float32)
    header = wire.header_for(SMILE * 64, 1, "fp", wire.DType.FLOAT32, [(kv, kv)])
    assert wire.decode_header(wire.encode_header(header), 1 << 20).request_id == SMILE * 64


@pytest.mark.parametrize(
    "bad", ["", "a b", "a\tb", "a\x01", "a\x7f", "a\u200bb", "a\u2028", "\ud800", "x\n"]
)
def test_ids_are_printable_without_whitespace(bad: str) -> None:
    with pytest.raises(errors.InvalidRequestError) as err:
        check_request_id(bad, "idempotency-key")
    assert err.value.field == "idempotency-key"
    assert len(str(err.value)) < 200


@pytest.mark.parametrize("good", ["r1", "ключ-1", "a:b/c", SMILE, "x" * 256])
def test_ids_that_are_valid(good: str) -> None:
    check_request_id(good)


def test_tenants() -> None:
    assert check_tenant("  team a ", "user") == "team a"
    for bad in ("", "   ", "t" * (MAX_TENANT_BYTES + 1), "é" * 33, "a\x00", "\ud800"):
        with pytest.raises(errors.InvalidRequestError, match="tenant"):
            check_tenant(bad, "user")


def test_shown_bounds_what_an_error_repeats() -> None:
    assert shown("abc") == "'abc'"
    assert len(shown("x" * 1_000_000)) <= ECHO_CHARS + 5
    assert shown("a\x01\ud800") == repr("a\x01\ud800")  # escaped, printable
    assert len(shown([list(range(1000))] * 1000)) < 200
    assert len(shown({"k" * 10_000: 1})) < 200
    assert shown(10**5000) == "<int>"  # past str()'s digit limit
