"""Per-request cost as the orchestrator records it, the Cost message, and the metrics."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import generate_latest

from orchestrator import errors
from orchestrator.api import convert
from orchestrator.control.clients import translated
from orchestrator.control.failover import CAUSES
from orchestrator.control.failover import cause as failover_cause
from orchestrator.control.legs import heartbeat_lost
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.run import Usage
from orchestrator.core.cost import PoolUsage, cost_fields
from orchestrator.core.hardware import CPU_HOST, DEFAULT_GPUS, PRICED_KINDS, get_gpu
from orchestrator.core.records import RequestRecord, WorkerInfo
from orchestrator.core.state import State
from orchestrator.workers.metrics import WorkerMetrics

H100, L4 = get_gpu(PRICED_KINDS, "H100"), get_gpu(PRICED_KINDS, "l4")


def test_cost_fields_by_hand() -> None:
    # 0.36 s on an H100 at $2.50/h = $0.00025; 7.2 s on an L4 at $0.70/h = $0.0014;
    # 2 GB at $0.01/GB = $0.02. Total $0.02165.
    got = cost_fields(
        [PoolUsage("prefill", H100, 0.36), PoolUsage("decode", L4, 7.2)],
        2_000_000_000,
        0.01,
        "team-a",
    )
    assert got["usd"] == pytest.approx(0.00025 + 0.0014 + 0.02)
    assert got["transfer_usd"] == pytest.approx(0.02)
    assert (got["prefill_gpu_s"], got["decode_gpu_s"], got["aggregated_gpu_s"]) == (0.36, 7.2, 0)
    assert (got["prefill_gpu"], got["decode_gpu"], got["tenant"]) == ("H100", "L4", "team-a")


def test_failed_attempts_add_up_in_their_pool() -> None:
    """A failover re-prefills: both prefills were paid for."""
    got = cost_fields(
        [PoolUsage("prefill", H100, 0.1), PoolUsage("prefill", H100, 0.1)], 0, 0.0, "t"
    )
    assert got["prefill_gpu_s"] == pytest.approx(0.2)
    assert got["usd"] == pytest.approx(0.2 * 2.50 / 3600)


def test_cpu_workers_are_priced_but_never_planned() -> None:
    assert get_gpu(PRICED_KINDS, "cpu") is CPU_HOST
    assert CPU_HOST.price_per_hour > 0
    assert "CPU" not in DEFAULT_GPUS


def test_cost_message_and_record_round_trip() -> None:
    fields = cost_fields([PoolUsage("aggregated", CPU_HOST, 3.6)], 0, 0.0, "default")
    msg = convert.cost_to_pb(fields)
    assert msg.usd == pytest.approx(3.6 * 0.10 / 3600)
    assert (msg.aggregated_gpu_s, msg.decode_gpu, msg.tenant) == (3.6, "CPU", "default")
    rec = RequestRecord("r", State.DONE, 1, "h", 1, 1, 0.0, tenant="default", cost=fields)
    back = RequestRecord.from_fields(rec.to_fields())
    assert (back.tenant, back.cost) == ("default", fields)
    assert convert.cost_to_pb({}).usd == 0.0  # a record from before costs existed


async def _call_error(phase: str) -> errors.WorkerError:
    """The WorkerError a failed worker call of ``phase`` raises (translated at the boundary)."""
    rpc = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "Stream removed", ""
    )
    try:
        async with translated("decode-0", phase):
            raise rpc
    except errors.WorkerError as exc:
        return exc
    raise AssertionError("not translated")


@pytest.mark.parametrize(
    ("phase", "cause"),
    [
        ("decode", "decode"),
        ("prefill", "prefill"),
        ("generate", "generate"),
        ("heartbeat", "heartbeat"),
        ("something else", "other"),
    ],
)
def test_failover_causes_are_a_bounded_set(phase: str, cause: str) -> None:
    """The cause is the failed phase, carried by the error's type — never read from text."""
    exc: errors.WorkerError
    if phase in ("decode", "prefill", "generate"):
        exc = asyncio.run(_call_error(phase))
    elif phase == "heartbeat":
        worker = WorkerInfo("decode-0", "decode", "a:1", "", "tcp", "m", "f", 8, 8, 1, 8)
        exc = heartbeat_lost(worker)
    else:
        exc = errors.WorkerError("decode-0", phase, retryable=True)
    assert failover_cause(exc) == cause
    assert cause in CAUSES


def test_control_metrics_count_what_finished() -> None:
    m = ControlMetrics()
    cost = cost_fields(
        [PoolUsage("prefill", H100, 0.5), PoolUsage("decode", L4, 2.0)], 10, 0.0, "team-b"
    )
    m.finished("done", "length", {"ttft_ms": 120.0, "tpot_ms": 20.0, "queue_ms": 3.0}, cost)
    m.failovers.labels("decode").inc()
    text = generate_latest(m.registry).decode()
    assert 'pdorch_requests_total{reason="length",state="done"} 1.0' in text
    assert "pdorch_ttft_seconds_count 1.0" in text
    assert 'pdorch_failovers_total{cause="decode"} 1.0' in text
    assert f'pdorch_cost_usd_total{{tenant="team-b"}} {cost["usd"]}' in text
    assert 'pdorch_gpu_seconds_total{gpu="L4",pool="decode"} 2.0' in text


def test_worker_gauges_read_the_worker_at_scrape_time() -> None:
    m = WorkerMetrics()
    held = [0]
    m.watch(lambda: held[0], lambda: 3)
    held[0] = 4096
    text = generate_latest(m.registry).decode()
    assert "pdorch_worker_kv_used_bytes 4096.0" in text
    assert "pdorch_worker_active_sequences 3.0" in text


def test_usage_prices_reused_tokens_at_the_prefill_workers_gpu() -> None:
    """What `Dispatch` records from a PrefillResponse's cached_tokens reaches the record:
    1800 tokens at 500 tokens/s on the H100 prefill worker = 3.6 s = $0.0025 not spent."""
    usage = Usage()
    usage.spent("prefill", "H100", 0.05)
    usage.reuse(1800, 500.0)
    usage.reuse(0, 500.0)  # a prefill that found nothing cached adds nothing
    usage.streaming("decode", "L4")
    usage.computed(3.6)
    got = usage.cost(PRICED_KINDS, 0.0, "team-a", "r1")
    assert got["prefill_reused_tokens"] == 1800
    assert got["reuse_saved_gpu_s"] == pytest.approx(3.6)
    assert got["reuse_saved_usd"] == pytest.approx(0.0025)
    assert got["usd"] == pytest.approx(0.05 * 2.50 / 3600 + 3.6 * 0.70 / 3600)
    none = Usage()
    none.spent("prefill", "H100", 0.05)
    assert none.cost(PRICED_KINDS, 0.0, "t", "r2")["reuse_saved_usd"] == 0.0
