"""`pdorch bench placement`: what admission and placement cost per request, by fleet size.

Every request is admitted (`Ledger.estimate`: its TTFT against every prefill queue) and
placed (`Ledger.place`: a pair of workers out of the whole listing) in the orchestrator's
event loop, over every live worker — the part of a request's fixed cost that grows with
the fleet. This runs the same `Ledger` the orchestrator uses, in this process, over a
synthetic fleet (half prefill, half decode workers, measured prefill rates, no breaker
held back, KV-aware routing on but no prefix cached) and reports the CPU time of one
estimate + place + release, per fleet size: scanning every worker (``placement_sample``
0) and as the orchestrator places by default (pools larger than ``placement_sample``
sampled, `orchestrator.core.fleet`), alternated in one run. Pure CPU: no Redis, no gRPC.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

from orchestrator.control.ledger import Ledger
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import WorkerInfo

__all__ = ["fleet", "format_result", "run_bench"]

PROMPT_TOKENS = 200
MAX_TOKENS = 16


def fleet(size: int) -> list[WorkerInfo]:
    """``size`` workers, alternately prefill and decode, all on the default transport."""
    workers = []
    for i in range(size):
        host = f"10.0.{i // 250}.{i % 250}"
        role = "prefill" if i % 2 == 0 else "decode"
        workers.append(
            WorkerInfo(
                worker_id=f"{role}-{i}",
                role=role,
                address=f"{host}:50061",
                kv_address=f"{host}:50071",
                transport="ucx",
                model="bench",
                fingerprint="bench",
                max_context=4096,
                vocab_size=32000,
                kv_bytes_per_token=4096,
                kv_capacity_bytes=8 << 30,
                active=i % 7,
            )
        )
    return workers


def _per_request_us(size: int, requests: int, sample: int) -> float:
    ledger = Ledger(dataclasses.replace(ControlSettings(), placement_sample=sample))
    ledger.rng.seed(size)
    workers = fleet(size)
    for w in workers:
        if w.role == "prefill":
            for _ in range(ledger.rates.min_samples):
                ledger.rates.prefill(w.worker_id, w.gpu_kind, 2000 + len(w.worker_id), 0.1)
    tokens = list(range(PROMPT_TOKENS))
    started = time.process_time()
    for _ in range(requests):
        ledger.estimate(workers, PROMPT_TOKENS, 10)
        booking = ledger.place(
            workers, need=PROMPT_TOKENS + MAX_TOKENS, prefill_tokens=PROMPT_TOKENS,
            excluded=set(), now=time.monotonic(), tokens=tokens,
        )  # fmt: skip
        ledger.release(booking)
    return (time.process_time() - started) / requests * 1e6


def _slope(rows: list[dict[str, Any]], key: str) -> float | None:
    if len(rows) < 2 or rows[-1]["workers"] == rows[0]["workers"]:
        return None
    rise = float(rows[-1][key]) - float(rows[0][key])
    return round(rise / (int(rows[-1]["workers"]) - int(rows[0]["workers"])), 2)


def run_bench(sizes: Sequence[int], requests: int, rounds: int = 2) -> dict[str, Any]:
    """Per size, the median of ``rounds`` alternated runs of each: every worker scanned,
    and sampled as by default (identical while no pool exceeds the sample)."""
    sample = ControlSettings().placement_sample
    rows = []
    for n in sizes:
        scan: list[float] = []
        sampled: list[float] = []
        for _ in range(rounds):
            scan.append(_per_request_us(n, requests, 0))
            sampled.append(_per_request_us(n, requests, sample))
        rows.append(
            {
                "workers": n,
                "us_per_request": round(statistics.median(scan), 1),
                "us_per_request_sampled": round(statistics.median(sampled), 1),
            }
        )
    return {
        "requests": requests,
        "sample": sample,
        "rows": rows,
        "us_per_worker": _slope(rows, "us_per_request"),
        "us_per_worker_sampled": _slope(rows, "us_per_request_sampled"),
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"admission + placement, CPU per request ({result['requests']} requests each): "
        f"every worker scanned | pools over {result['sample']} sampled (the default)"
    ]
    lines += [
        f"  {r['workers']:>6} workers  {r['us_per_request']:>9.1f} µs | "
        f"{r['us_per_request_sampled']:>9.1f} µs"
        for r in result["rows"]
    ]
    if result["us_per_worker"] is not None:
        lines.append(
            f"  ≈ {result['us_per_worker']} | {result['us_per_worker_sampled']} µs per worker "
            "per request"
        )
    return "\n".join(lines)
