"""The store's key layout (`orchestrator.store.keys`): no client-chosen name can name another
entity's key, and everything of one request (tenant, migration) shares one Redis Cluster hash slot.

Slots are computed with redis-py's `key_slot` (CRC16 of the hash tag, as Redis Cluster does).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from redis.crc import key_slot

from orchestrator.store.keys import Keys, decode, encode

KEYS = Keys()

PER_NAME: dict[str, Callable[[str], str]] = {
    "request": KEYS.request,
    "journal": KEYS.journal,
    "lease": KEYS.lease,
    "client": KEYS.client,
    "tenant_inflight": KEYS.tenant_inflight,
    "tenant_cost": KEYS.tenant_cost,
    "worker": KEYS.worker,
    "migration": KEYS.migration,
    "migration_rollbacks": KEYS.migration_rollbacks,
    "migration_window": KEYS.migration_window,
    "migration_samples": KEYS.migration_samples,
}
"""Every key built from a name, by kind."""

FIXED = {KEYS.active, KEYS.tenants, KEYS.workers}

REQUEST_KINDS = ("request", "journal", "lease", "client")

TRICKY = ("", "%", "%25", "{", "}", "{}", ":", "\ud800", "V:journal", "Z:owner", "T:live")
"""Names an encoding could get wrong: empty, escapes, braces, a lone surrogate, suffixes."""

# Any text, lone surrogates included (an id that got past validation by some other road).
names = st.text(st.characters(codec=None), max_size=40) | st.sampled_from(TRICKY)
kinds = st.sampled_from(sorted(PER_NAME))


def slot(key: str) -> int:
    return int(key_slot(key.encode("utf-8")))


@given(kinds, names, kinds, names)
@example("request", "V:journal", "journal", "V")
@example("request", "Z:owner", "lease", "Z")
@example("request", "X:client", "client", "X")
@example("tenant_cost", "T:inflight", "tenant_inflight", "T")
@example("request", "a}", "request", "a%7D")
def test_distinct_kind_and_name_give_distinct_keys(k1: str, n1: str, k2: str, n2: str) -> None:
    a, b = PER_NAME[k1](n1), PER_NAME[k2](n2)
    assert (a == b) == ((k1, n1) == (k2, n2))
    assert a not in FIXED


@given(names)
@example("")
@example("{V}")
@example("日本:🙂" * 20)
def test_every_key_of_a_request_shares_one_slot(name: str) -> None:
    assert len({slot(PER_NAME[k](name)) for k in REQUEST_KINDS}) == 1
    assert slot(KEYS.tenant_inflight(name)) == slot(KEYS.tenant_cost(name))
    assert len({slot(PER_NAME[k](name)) for k in PER_NAME if k.startswith("migration")}) == 1


@given(names)
def test_the_hash_tag_is_the_encoded_name(name: str) -> None:
    """Each key has exactly one ``{…}``, never empty (Redis would hash the whole key), and
    the encoded name inside holds no brace or colon."""
    for make in PER_NAME.values():
        key = make(name)
        assert key.count("{") == 1
        assert key.count("}") == 1
        inner = key[key.index("{") + 1 : key.index("}")]
        assert inner == encode(name)
        assert inner
        assert not set(inner) & set("{}:")
        assert decode(inner) == name


@given(names)
def test_a_record_key_gives_back_its_id(name: str) -> None:
    assert KEYS.request_id(KEYS.request(name)) == name
    for kind in ("journal", "lease", "client"):
        assert KEYS.request_id(PER_NAME[kind](name)) is None
    assert KEYS.request_id(KEYS.worker(name)) is None


def test_ordinary_ids_stay_readable() -> None:
    assert KEYS.request("req-1_a.b~c") == "pdorch:req:{req-1_a.b~c}"
    assert KEYS.journal("V:journal") == "pdorch:req:{V%3Ajournal}:journal"
    assert KEYS.tenant_cost("T:live") == "pdorch:tenant:{T%3Alive}:cost"


def test_fixed_keys_are_distinct_and_untagged() -> None:
    assert len(FIXED) == 3
    assert not any("{" in k for k in FIXED)


@pytest.mark.parametrize("prefix", ["{a}", "a{", "a}b"])
def test_a_prefix_with_a_brace_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="must not contain"):
        Keys(prefix)
