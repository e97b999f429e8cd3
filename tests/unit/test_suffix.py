"""Suffix-only KV transfer, the pure parts (issue 20 item 3): what may be left out, the
simulated cache's check of a named prefix, the prefix KV it rebuilds, the record's note."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.prefix import block_digests, suffix_plan
from orchestrator.core.routing import suffix_note
from orchestrator.core.sampling import SamplingParams
from orchestrator.workers.sim_engine import SIM_BLOCK, SimEngine, SimPrefixCache, SimSpec

TOKENS = list(range(100, 100 + 5 * SIM_BLOCK + 3))  # 5 whole blocks and 3 tokens


@pytest.mark.parametrize(
    ("held", "tokens", "blocks"),
    [
        (5 * SIM_BLOCK, TOKENS, 5),
        (3 * SIM_BLOCK + 7, TOKENS, 3),  # whole blocks only
        (5 * SIM_BLOCK, TOKENS[: 5 * SIM_BLOCK], 4),  # at least one token is sent
        (0, TOKENS, 0),
        (SIM_BLOCK - 1, TOKENS, 0),
    ],
)
def test_suffix_plan_leaves_out_whole_held_blocks(
    held: int, tokens: list[int], blocks: int
) -> None:
    plan = suffix_plan(tokens, held, SIM_BLOCK)
    if not blocks:
        assert plan is None
        return
    assert plan is not None
    assert plan.tokens == blocks * SIM_BLOCK
    assert plan.digest == block_digests(tokens, SIM_BLOCK)[blocks - 1]


def test_suffix_plan_without_a_block_size_is_none() -> None:
    assert suffix_plan(TOKENS, 64, 0) is None


def test_the_cache_holds_a_prefix_only_back_to_block_0() -> None:
    cache = SimPrefixCache(capacity=4)
    cache.use(TOKENS)  # 5 blocks into 4: block 0 is evicted (least recently used)
    digests = block_digests(TOKENS, SIM_BLOCK)
    assert not cache.holds(5 * SIM_BLOCK, digests[4])  # its chain reaches the evicted block
    fresh = SimPrefixCache(capacity=16)
    fresh.use(TOKENS)
    assert fresh.holds(5 * SIM_BLOCK, digests[4])
    assert fresh.holds(2 * SIM_BLOCK, digests[1])
    assert not fresh.holds(3 * SIM_BLOCK, digests[1])  # the digest names a 2-block prefix
    assert not fresh.holds(2 * SIM_BLOCK + 1, digests[1])  # not whole blocks
    assert not fresh.holds(SIM_BLOCK, block_digests(list(range(7, 30)), SIM_BLOCK)[0])


def test_a_suffix_plus_the_cached_prefix_is_the_whole_kv() -> None:
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"), prefix_cache=True)
    whole = engine.prefill(TOKENS, SamplingParams()).kv
    n = 3 * SIM_BLOCK
    digest = block_digests(TOKENS, SIM_BLOCK)[2]
    assert engine.holds_prefix(n, digest)
    head = engine.prefix_kv(TOKENS[:n], digest)
    for (hk, hv), (k, v) in zip(head, whole, strict=True):
        assert np.array_equal(np.concatenate((hk, k[:, n:]), axis=1), k)
        assert np.array_equal(np.concatenate((hv, v[:, n:]), axis=1), v)
    with pytest.raises(ValueError, match="does not name"):
        engine.prefix_kv(TOKENS[1 : n + 1], digest)
    cold = SimEngine(SimSpec.parse("llama-3-8b@L4"), prefix_cache=True)
    assert not cold.holds_prefix(n, digest)
    with pytest.raises(ValueError, match="no longer cached"):
        cold.prefix_kv(TOKENS[:n], digest)
    without = SimEngine(SimSpec.parse("llama-3-8b@L4"))
    assert not without.holds_prefix(n, digest)
    with pytest.raises(ValueError, match="no prefix cache"):
        without.prefix_kv(TOKENS[:n], digest)


def test_the_records_note() -> None:
    assert suffix_note(176, 176, False, 218) == "KV suffix only: 42/218 tokens sent"
    assert suffix_note(176, 0, True, 218) == (
        "decode lacked the indexed 176-token prefix: whole KV sent"
    )
    assert "whole KV" in suffix_note(176, 0, False, 218)
