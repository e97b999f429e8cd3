"""The prefix index (`orchestrator.core.prefix`): block hashes, events, snapshots, matches.

Property tests check the index against a brute-force model: a worker's match is the length
of the longest run of a sequence's blocks, from block 0, whose keys the worker holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core.prefix import (
    Cleared,
    PrefixIndex,
    Removed,
    Stored,
    block_digests,
    block_keys,
    decode_keys,
    encode_keys,
    iter_block_keys,
    key_of,
    root_digest,
)
from orchestrator.errors import ConfigError

B = 4


def test_root_digest_is_sha256_of_cbor_text() -> None:
    # cbor("0") = 0x61 '0'; cbor("vllm-none-hash") = 0x6e + 14 bytes
    assert root_digest("0") == hashlib.sha256(b"\x61" + b"0").digest()
    assert root_digest() == hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()


def test_block_digest_is_sha256_of_cbor_triple() -> None:
    parent = root_digest()
    # [parent(32 bytes), [1, 2, 30, 300], null]
    body = b"\x83" + b"\x58\x20" + parent + b"\x84" + b"\x01\x02\x18\x1e\x19\x01\x2c" + b"\xf6"
    assert block_digests([1, 2, 30, 300], 4) == [hashlib.sha256(body).digest()]


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_digests(list(range(11)), 4)) == 2
    assert block_digests([1, 2, 3], 4) == []


def test_chaining_names_the_whole_prefix() -> None:
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], B)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], B)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different prefix


def test_continuing_from_a_parent_equals_hashing_at_once() -> None:
    ids = list(range(20))
    whole = block_digests(ids, B)
    assert block_digests(ids[8:], B, parent=whole[1]) == whole[2:]


def test_seed_changes_every_hash() -> None:
    assert block_keys([1, 2, 3, 4], B, seed="0") != block_keys([1, 2, 3, 4], B, seed="1")


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        block_digests([1, 2], 0)
    with pytest.raises(ConfigError):
        block_digests([-1, 2, 3, 4], B)


def test_key_is_the_low_64_bits() -> None:
    d = bytes(range(32))
    assert key_of(d) == int.from_bytes(d[-8:], "big")


@given(st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_keys_roundtrip_through_the_heartbeat_payload(keys: list[int]) -> None:
    assert decode_keys(encode_keys(keys)) == tuple(keys)


@pytest.mark.parametrize("bad", ["!!!", "AAAA"])  # not base64 / 3 bytes
def test_malformed_payload_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError):
        decode_keys(bad)


# --------------------------------------------------------------------------- index


def test_longest_prefix_per_worker() -> None:
    ids = list(range(16))  # 4 blocks
    keys = block_keys(ids, B)
    idx = PrefixIndex()
    idx.replace("w1", B, keys[:3])
    idx.replace("w2", B, keys[:1])
    idx.replace("w3", B, keys[1:])  # lacks block 0: holds nothing usable
    got = idx.match({B: keys})
    assert {w: m.blocks for w, m in got.items()} == {"w1": 3, "w2": 1}
    assert got["w1"].tokens == 12


def test_a_gap_ends_the_match() -> None:
    keys = block_keys(list(range(16)), B)
    idx = PrefixIndex()
    idx.replace("w", B, [keys[0], keys[1], keys[3]])
    assert idx.match({B: keys})["w"].blocks == 2


def test_events_store_remove_clear() -> None:
    keys = block_keys(list(range(16)), B)
    idx = PrefixIndex()
    idx.apply("w", B, [Stored(tuple(keys))])
    assert idx.match({B: keys})["w"].blocks == 4
    idx.apply("w", B, [Removed((keys[2],))])
    assert idx.match({B: keys})["w"].blocks == 2
    idx.apply("w", B, [Cleared()])
    assert idx.match({B: keys}) == {}
    assert len(idx) == 0


def test_workers_of_another_block_size_do_not_match() -> None:
    keys4 = block_keys(list(range(16)), 4)
    idx = PrefixIndex()
    idx.replace("w", 8, keys4)  # same keys, wrong size (cannot happen honestly)
    assert idx.match({4: keys4}) == {}


def test_sync_rebuilds_from_snapshots_and_drops_silent_workers() -> None:
    keys = block_keys(list(range(16)), B)
    idx = PrefixIndex()
    idx.sync({"w1": (B, encode_keys(keys)), "w2": (B, encode_keys(keys[:2]))})
    assert {w: m.blocks for w, m in idx.match({B: keys}).items()} == {"w1": 4, "w2": 2}
    idx.sync({"w2": (B, encode_keys(keys[:1]))})  # w1's heartbeat expired; w2 evicted one
    assert {w: m.blocks for w, m in idx.match({B: keys}).items()} == {"w2": 1}
    assert idx.workers() == {"w2"}


def test_sync_with_a_malformed_payload_holds_nothing() -> None:
    keys = block_keys(list(range(8)), B)
    idx = PrefixIndex()
    idx.sync({"w": (B, encode_keys(keys))})
    idx.sync({"w": (B, "not base64!")})
    assert idx.match({B: keys}) == {}


def test_drop_forgets_everything_of_a_worker_only() -> None:
    keys = block_keys(list(range(8)), B)
    idx = PrefixIndex()
    idx.replace("a", B, keys)
    idx.replace("b", B, keys)
    idx.drop("a")
    assert set(idx.match({B: keys})) == {"b"}
    assert idx.held("a") == frozenset()


# ------------------------------------------------------------------ properties

_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear", "snapshot", "drop"]),
        st.sampled_from(["w1", "w2", "w3"]),
        st.lists(st.integers(0, 9), max_size=6),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(_ops, st.lists(st.integers(0, 9), min_size=1, max_size=8))
def test_index_agrees_with_a_brute_force_model(
    ops: list[tuple[str, str, list[int]]], seq: list[int]
) -> None:
    """Keys are small ints here: the index is agnostic to what they hash."""
    idx = PrefixIndex()
    model: dict[str, set[int]] = {}
    for op, w, keys in ops:
        if op == "store":
            idx.apply(w, B, [Stored(tuple(keys))])
            model.setdefault(w, set()).update(keys)
        elif op == "remove":
            idx.apply(w, B, [Removed(tuple(keys))])
            model.setdefault(w, set()).difference_update(keys)
        elif op == "clear":
            idx.apply(w, B, [Cleared()])
            model[w] = set()
        elif op == "snapshot":
            idx.replace(w, B, keys)
            model[w] = set(keys)
        else:
            idx.drop(w)
            model.pop(w, None)
    expected = {}
    for w, held in model.items():
        n = 0
        while n < len(seq) and seq[n] in held:
            n += 1
        if n:
            expected[w] = n
    assert {w: m.blocks for w, m in idx.match({B: seq}).items()} == expected
    for w, held in model.items():
        assert idx.held(w) == held
    assert len(idx) == len(set().union(set(), *model.values()))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 50_000), max_size=40),
    st.lists(st.integers(0, 50_000), max_size=40),
)
def test_shared_prefix_gives_shared_leading_keys(a: list[int], b: list[int]) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ka, kb = block_keys(a, B), block_keys(b, B)
    shared = 0
    while shared < min(len(ka), len(kb)) and ka[shared] == kb[shared]:
        shared += 1
    assert shared == min(common // B, len(ka), len(kb))


def test_a_lookup_stops_hashing_at_the_first_block_nobody_holds() -> None:
    ids = list(range(64))  # 16 blocks
    keys = block_keys(ids, B)
    idx = PrefixIndex()
    idx.replace("w", B, keys[:2])
    read: list[int] = []

    def counted() -> Iterator[int]:
        for k in iter_block_keys(ids, B):
            read.append(k)
            yield k

    assert idx.match({B: counted()})["w"].blocks == 2
    assert read == keys[:3]  # blocks 0, 1 held; block 2 ends it


def test_iter_block_keys_equals_block_keys() -> None:
    ids = list(range(1000, 1077))
    assert list(iter_block_keys(ids, 16)) == block_keys(ids, 16)
