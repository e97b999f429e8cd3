"""Suffix-only KV transfer, the orchestrator's side (issue 20 item 3), in process: the
Prefill asks it when the index says the decode worker holds a prefix, names that prefix by
its digest, and the record says what moved — the suffix, or the whole KV after a refusal."""

from __future__ import annotations

from dataclasses import replace

from orchestrator.control.orchestrator import GenerateInput
from orchestrator.core.prefix import block_digests, block_keys
from orchestrator.core.routing import RoutingPolicy
from tests.unit.control_fakes import KV_BYTES_PER_TOKEN, PREFIX_BLOCK, FakeWorker
from tests.unit.test_control_plane import FAST, collect, run, setup

PROMPT = tuple(range(10, 50))  # 40 tokens: 2 whole blocks and 8
HELD = tuple(block_keys(PROMPT, PREFIX_BLOCK))  # the decode worker's cache: both blocks


async def _one(prefill: FakeWorker, decode: FakeWorker, suffix: bool = True) -> tuple[str, int]:
    settings = replace(FAST, routing=RoutingPolicy(suffix_only=suffix))
    orch, _, _ = await setup(prefill, decode, settings=settings)
    chunks = await collect(orch.generate(GenerateInput("r1", token_ids=PROMPT, max_tokens=4)))
    record = chunks[-1].record
    assert record is not None
    return record.placement, record.kv_bytes


def test_the_decode_workers_prefix_is_left_out_and_named() -> None:
    async def main() -> None:
        p0, d0 = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode", prefix_keys=HELD)
        placement, kv_bytes = await _one(p0, d0)
        (req,) = p0.prefill_requests
        assert req.decode_prefix_tokens == 32
        assert req.decode_prefix_hash == block_digests(PROMPT, PREFIX_BLOCK)[1]
        assert "decode holds 32/40" in placement
        assert "KV suffix only: 8/40 tokens sent" in placement
        assert kv_bytes == 8 * KV_BYTES_PER_TOKEN

    run(main())


def test_a_refused_prefix_is_recorded_with_the_whole_kv() -> None:
    async def main() -> None:
        p0 = FakeWorker("p0", "prefill", decode_lacks_prefix=True)
        d0 = FakeWorker("d0", "decode", prefix_keys=HELD)
        placement, kv_bytes = await _one(p0, d0)
        assert "decode lacked the indexed 32-token prefix: whole KV sent" in placement
        assert kv_bytes == 40 * KV_BYTES_PER_TOKEN

    run(main())


def test_off_or_nothing_held_asks_nothing() -> None:
    async def main() -> None:
        p0, d0 = FakeWorker("p0", "prefill"), FakeWorker("d0", "decode", prefix_keys=HELD)
        placement, kv_bytes = await _one(p0, d0, suffix=False)
        assert p0.prefill_requests[0].decode_prefix_tokens == 0
        assert "suffix" not in placement
        assert kv_bytes == 40 * KV_BYTES_PER_TOKEN
        p1, d1 = FakeWorker("p1", "prefill"), FakeWorker("d1", "decode")
        placement, _ = await _one(p1, d1)
        assert p1.prefill_requests[0].decode_prefix_tokens == 0
        assert "suffix" not in placement

    run(main())
