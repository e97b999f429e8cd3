"""`orchestrator.store.pipelining.wire`: script arguments encoded as redis-py would."""

from __future__ import annotations

import pytest
from redis._parsers.encoders import Encoder

from orchestrator.store.pipelining import wire


def test_arguments_are_the_bytes_redis_py_would_send() -> None:
    encoder = Encoder("utf-8", "strict", decode_responses=True)  # the store's client's
    values = ["abc", "é ∑ 🎉", "", 5, -3, 10**20, 2.5, 0.1, 1e-9, b"\x00raw"]
    assert wire(values) == [encoder.encode(v) for v in values]


@pytest.mark.parametrize("bad", [True, None, [1], {"a": 1}])
def test_anything_else_is_refused_as_redis_py_refuses_it(bad: object) -> None:
    with pytest.raises(TypeError, match="text, bytes or a number"):
        wire([bad])
