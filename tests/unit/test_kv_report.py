"""A worker's prefix-cache report from its engine's block events (`workers.kv_report`)."""

from __future__ import annotations

from orchestrator.core.prefix import PrefixIndex, block_digests, block_keys, decode_keys
from orchestrator.workers.kv_report import HeldBlocks

B = 4


def test_stores_rehash_into_pdorch_keys_whatever_the_engine_hash() -> None:
    ids = list(range(12))
    held = HeldBlocks(B)
    held.stored(["e0", "e1"], None, ids[:8])  # the engine's own hashes: opaque
    held.stored(["e2"], "e1", ids[8:12])  # continues after e1
    assert held.keys() == block_keys(ids, B)


def test_unknown_parent_is_skipped_not_guessed() -> None:
    held = HeldBlocks(B)
    held.stored(["e5"], "never-seen", [1, 2, 3, 4])
    assert held.keys() == []
    assert held.skipped == 1


def test_removed_and_cleared() -> None:
    ids = list(range(12))
    held = HeldBlocks(B)
    held.stored(["a", "b", "c"], None, ids)
    held.removed(["c"])
    assert held.keys() == block_keys(ids, B)[:2]
    held.cleared()
    assert held.keys() == []


def test_a_sequence_gap_clears_the_report() -> None:
    held = HeldBlocks(B)
    held.sequence(0)
    held.stored(["a"], None, [1, 2, 3, 4])
    held.sequence(1)
    assert len(held) == 1
    held.sequence(3)  # batch 2 lost: it may have evicted "a"
    assert len(held) == 0
    assert held.gaps == 1


def test_report_is_bounded_to_the_newest() -> None:
    held = HeldBlocks(B)
    held.stored(["a"], None, [1, 2, 3, 4])
    held.stored(["b"], None, [5, 6, 7, 8])
    held.stored(["a"], None, [1, 2, 3, 4])  # stored again: newest now
    assert decode_keys(held.report(1)) == tuple(block_keys([1, 2, 3, 4], B))
    assert held.report(0) == ""


def test_a_block_of_another_size_is_ignored() -> None:
    held = HeldBlocks(B)
    held.stored(["a"], None, [1, 2, 3, 4, 5, 6, 7, 8])
    assert held.keys() == []


def test_report_feeds_the_index_end_to_end() -> None:
    turn1 = list(range(100, 140))  # 10 blocks
    turn2 = [*turn1, *range(500, 520)]  # turn 1 + 5 more blocks
    held = HeldBlocks(B)
    held.stored([f"e{i}" for i in range(10)], None, turn1)
    idx = PrefixIndex()
    idx.sync({"d1": (B, held.report(4096))})
    match = idx.match({B: block_keys(turn2, B)})
    assert match["d1"].tokens == 40


def test_holds_names_blocks_by_pdorch_digest_until_evicted() -> None:
    """What the vLLM decode connector checks a suffix-only KV's prefix against."""
    ids = list(range(12))
    d = block_digests(ids, B)
    held = HeldBlocks(B)
    held.stored(["a", "b", "c"], None, ids)
    assert all(held.holds(x) for x in d)
    held.removed(["c"])
    assert (held.holds(d[1]), held.holds(d[2])) == (True, False)
    held.cleared()
    assert not held.holds(d[0])
