"""The pure bookkeeping of the vLLM worker (no vLLM needed): step shares, block pool room,
vLLM deltas → TokenChunks with the reference engine's conventions."""

from __future__ import annotations

import pytest

from orchestrator.api import common_pb2
from orchestrator.bench.engine_batching import Sample, summarize
from orchestrator.workers.vllm.accounting import BlockPool, ChunkStream, StepLedger


def _detok(ids: object) -> str:
    return "".join(chr(97 + int(i) % 26) for i in ids)  # type: ignore[attr-defined]


def test_step_ledger_charges_each_request_its_share_of_the_steps_it_was_in() -> None:
    ledger = StepLedger()
    a = ledger.mark()
    ledger.step(0.1, 1)  # a alone
    b = ledger.mark()
    ledger.step(0.2, 2)  # a and b
    ledger.step(0.0, 2)  # an empty report changes nothing
    ledger.step(0.3, 0)
    assert ledger.mark() - a == pytest.approx(0.1 + 0.1)
    assert ledger.mark() - b == pytest.approx(0.1)
    assert ledger.busy_s == pytest.approx(0.3)
    assert ledger.steps == 2


def test_block_pool_room_is_free_blocks_times_block_size_times_bytes_per_token() -> None:
    pool = BlockPool(blocks=182, block_size=128, bytes_per_token=46080, usage=0.0)
    assert pool.capacity_bytes == 182 * 128 * 46080
    assert pool.used_bytes == 0
    busy = BlockPool(182, 128, 46080, usage=3 / 182)
    assert (busy.used_blocks, busy.free_blocks) == (3, 179)
    assert busy.used_bytes == 3 * 128 * 46080
    assert BlockPool(10, 16, 4, usage=1.7).used_blocks == 10  # clamped


def test_chunks_count_from_first_index_and_stop_at_eos_unstreamed() -> None:
    s = ChunkStream(_detok, first_index=0, max_tokens=10, eos=[99])
    first = s.push([1], None, 5.0)
    assert [(c.index, list(c.token_ids), c.text, c.compute_ms) for c in first] == [
        (0, [1], "b", 5.0)
    ]
    end = s.push([2, 99], "stop", 3.0)
    assert [(c.index, list(c.token_ids), c.finish_reason) for c in end] == [
        (1, [2], common_pb2.FINISH_REASON_UNSPECIFIED),
        (2, [], common_pb2.FINISH_REASON_EOS),
    ]
    assert (end[0].compute_ms, end[1].compute_ms) == (3.0, 0.0)  # charged once
    assert s.finished
    assert s.push([3], None, 1.0) == []


def test_chunks_end_at_the_request_limit_counting_prior_tokens() -> None:
    s = ChunkStream(_detok, first_index=3, max_tokens=5, eos=[], prior=[0, 1, 2])
    chunks = s.push([7, 8, 9], None, 1.0)  # vLLM may overshoot a limit it was not told
    assert [(c.index, list(c.token_ids)) for c in chunks] == [(3, [7, 8]), (5, [])]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_a_chunk_says_where_each_tokens_text_ends() -> None:
    s = ChunkStream(lambda ids: "".join("xy"[int(i) % 2] * int(i) for i in ids), first_index=0,
                    max_tokens=10, eos=[])  # fmt: skip
    (chunk,) = s.push([1, 2, 3], None, 1.0)
    assert (chunk.text, list(chunk.text_ends)) == ("yxxyyy", [1, 3, 6])


def test_vllm_length_and_stop_without_a_token_and_abort() -> None:
    s = ChunkStream(_detok, first_index=0, max_tokens=10, eos=[])
    (end,) = s.push([], "length", 2.0)
    assert (end.index, end.finish_reason, end.compute_ms) == (
        0,
        common_pb2.FINISH_REASON_LENGTH,
        2.0,
    )
    stopped = ChunkStream(_detok, first_index=0, max_tokens=10, eos=[])
    assert stopped.push([4], "stop", 0.0)[-1].finish_reason == common_pb2.FINISH_REASON_EOS
    aborted = ChunkStream(_detok, first_index=0, max_tokens=10, eos=[])
    with pytest.raises(ValueError, match="abort"):
        aborted.push([], "abort", 0.0)


def test_engine_bench_summary_takes_medians_and_engine_time_per_token() -> None:
    samples = [Sample(10.0, 2.0, 5, 4.0), Sample(30.0, None, 1, 1.0), Sample(20.0, 4.0, 4, 4.0)]
    level = summarize(4, samples, wall_s=2.0)
    assert (level.requests, level.ttft_ms, level.tpot_ms) == (3, 20.0, 3.0)
    assert level.engine_ms_per_token == pytest.approx(9.0 / 10)
    assert level.tokens_per_s == pytest.approx(5.0)


def test_a_busy_engines_step_lasts_at_least_the_interval_between_reports() -> None:
    """vLLM's async scheduling (CUDA's default) times only the wait for a step already
    running (0.045 ms measured on an H200 for ~30 ms steps): while the engine stays busy,
    the interval between step reports is the step's time."""
    ledger = StepLedger()
    a = ledger.mark()
    ledger.step(0.00005, 2, at_s=10.0, running_after=2)  # first report: nothing before it
    ledger.step(0.00005, 2, at_s=10.030, running_after=2)
    ledger.step(0.00004, 2, at_s=10.060, running_after=0)  # both end in this step
    assert ledger.mark() - a == pytest.approx(0.00005 / 2 + 0.030 / 2 + 0.030 / 2)
    # idle time before the next request's first step is not charged to it
    b = ledger.mark()
    ledger.step(0.004, 1, at_s=15.0, running_after=1)
    assert ledger.mark() - b == pytest.approx(0.004)
    # on the CPU backend vLLM's own figure is the longer one and stands
    c = ledger.mark()
    ledger.step(0.050, 1, at_s=15.020, running_after=1)
    assert ledger.mark() - c == pytest.approx(0.050)
