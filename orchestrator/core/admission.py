"""Admission: whether a request is taken at all, and whether it is worth disaggregating. Pure.

**Early rejection.** A request is refused at once with `OverloadedError` (gRPC
``RESOURCE_EXHAUSTED``, HTTP 429) and a retry-after hint, instead of being queued to time out,
when:

* this replica already drives ``max_inflight`` requests;
* every prefill worker's queue (requests this replica placed there and not yet prefilled)
  holds ``max_queue`` requests — the queues are bounded;
* the TTFT it can expect misses the SLO: for each prefill worker,
  ``(queued prompt tokens + its prompt) / measured prefill rate + expected KV transfer``,
  and the best worker's estimate is above ``ttft_slo_s``. A request whose own prefill alone
  misses the SLO on an *empty* queue is still admitted (waiting cannot help it; refusing
  would refuse it forever); the estimate is recorded either way.

Before the rates are measured (`orchestrator.core.rates`) there is no estimate and only the
bounds apply. Per-tenant limits (requests in flight per tenant, across replicas) are
enforced atomically by the store when the request is created.

**Conditional disaggregation.** A prefill of ``n`` tokens run locally on the decode worker
costs ``n / r_local`` seconds — to this request *and* to each of the ``A`` sequences the
worker is decoding, which stall meanwhile. Sending it to the prefill pool costs this request
``n / r_prefill + fixed + n * kv_bytes_per_token * per_byte`` (the measured transfer line)
and nobody else anything. The request runs aggregated when::

    (1 + A) * n / r_local  <=  n / r_prefill + fixed + n * b * per_byte

i.e. short prompts, where the transfer's fixed cost dominates. ``r_local`` is the prefill
pool's measured rate scaled by the two GPU kinds' relative peak throughput. The decision and
its reason are recorded on the request. A fixed token threshold can be configured instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from orchestrator.core.rates import TransferModel
from orchestrator.errors import ConfigError, OverloadedError

AUTO_CAP_TOKENS = 1024
""""auto" never keeps a prompt longer than this on a decode worker, whatever the rates say
(the rates are estimates; long local prefills are what disaggregation exists to avoid)."""


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    ttft_slo_s: float = 0.0
    """Refuse requests whose estimated TTFT exceeds this (0: no SLO check)."""
    max_queue: int = 256
    """Requests one prefill worker may have waiting from this replica."""
    max_inflight: int = 0
    """Requests this replica drives at once (0: no limit)."""
    tenant_limits: Mapping[str, int] = field(default_factory=dict)
    """Tenant -> requests in flight at most, all replicas together."""
    default_tenant_limit: int = 0
    """For tenants not listed (0: no limit)."""
    aggregate_below: int | None = 0
    """Conditional disaggregation: None is "auto" (the rule above); N > 0 runs prompts
    shorter than N tokens aggregated on a decode worker; 0 always disaggregates."""

    def __post_init__(self) -> None:
        if self.ttft_slo_s < 0 or self.max_queue < 1 or self.max_inflight < 0:
            raise ConfigError("admission", "ttft_slo_s >= 0, max_queue >= 1, max_inflight >= 0")
        if self.default_tenant_limit < 0 or any(v < 1 for v in self.tenant_limits.values()):
            raise ConfigError("tenant-limit", "must be >= 1 (the default: >= 0, 0 for none)")
        if self.aggregate_below is not None and self.aggregate_below < 0:
            raise ConfigError("aggregate-below", "must be >= 0 or auto")

    def tenant_limit(self, tenant: str) -> int:
        """The tenant's limit of requests in flight (0: none)."""
        return self.tenant_limits.get(tenant, self.default_tenant_limit)


def parse_tenant_limits(items: Sequence[str]) -> dict[str, int]:
    """``["acme=8", "beta=2"]`` -> ``{"acme": 8, "beta": 2}`` (ConfigError on bad items)."""
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError("tenant-limit", f"{item!r}: expected TENANT=N")
        try:
            limit = int(value)
        except ValueError:
            raise ConfigError("tenant-limit", f"{item!r}: {value!r} is not an integer") from None
        if limit < 1:
            raise ConfigError("tenant-limit", f"{item!r}: must be >= 1")
        out[name.strip()] = limit
    return out


def parse_aggregate_below(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ConfigError("aggregate-below", f"{text!r} is not 'auto' or a token count") from None
    if n < 0:
        raise ConfigError("aggregate-below", "must be >= 0")
    return n


@dataclass(frozen=True, slots=True)
class PrefillQueue:
    """One prefill worker as admission sees it."""

    worker_id: str
    requests: int
    """Requests placed there (by this replica) and not prefilled yet."""
    tokens: int
    """Their prompt tokens."""
    rate: float | None
    """Measured prefill tokens/s (None: not measured yet)."""


@dataclass(frozen=True, slots=True)
class Admitted:
    ttft_estimate_s: float | None
    """None when the rates are not measured yet (or no prefill pool)."""
    reason: str


def admit(
    prompt_tokens: int,
    queues: Sequence[PrefillQueue],
    transfer_s: float,
    policy: AdmissionPolicy,
    inflight: int,
) -> Admitted:
    """Admit a request of ``prompt_tokens`` or raise `OverloadedError` with a retry-after.

    ``queues``: the prefill workers that could take it (empty: no prefill pool, the request
    runs aggregated and only the in-flight bound applies). ``transfer_s``: the expected KV
    transfer time for this prompt (0 when not measured)."""
    if policy.max_inflight and inflight >= policy.max_inflight:
        raise OverloadedError(
            f"this orchestrator drives {inflight} requests (limit {policy.max_inflight})", 1.0
        )
    if not queues:
        return Admitted(None, "no prefill pool: no queue to estimate")
    open_ = [q for q in queues if q.requests < policy.max_queue]
    if not open_:
        drains = [q.tokens / q.rate for q in queues if q.rate]
        raise OverloadedError(
            f"every prefill queue is full ({policy.max_queue} requests each)",
            max(0.1, min(drains)) if drains else 1.0,
        )
    timed = [(q.tokens / q.rate, prompt_tokens / q.rate) for q in open_ if q.rate]
    if not timed:
        return Admitted(None, "prefill rate not measured yet")
    wait, own = min(timed, key=lambda t: t[0] + t[1])
    estimate = wait + own + transfer_s
    slo = policy.ttft_slo_s
    if slo and estimate > slo:
        if wait <= 0:
            return Admitted(estimate, f"estimated TTFT {estimate:.3f}s > SLO {slo}s even "
                                      "with an empty queue: admitted best-effort")  # fmt: skip
        raise OverloadedError(
            f"estimated TTFT {estimate:.3f}s exceeds the SLO of {slo}s "
            f"(queue {wait:.3f}s + prefill {own:.3f}s + transfer {transfer_s:.3f}s)",
            max(0.1, min(wait, estimate - slo)),
        )
    return Admitted(estimate, f"estimated TTFT {estimate:.3f}s")


@dataclass(frozen=True, slots=True)
class Decision:
    aggregate: bool
    reason: str


def disaggregate_or_not(
    prompt_tokens: int,
    policy_threshold: int | None,
    *,
    transfer: TransferModel | None,
    kv_bytes_per_token: int,
    prefill_rate: float | None,
    local_speedup: float,
    decode_active: int,
) -> Decision:
    """Whether a prompt runs aggregated on the decode worker (see the module docstring).

    ``local_speedup``: the decode worker's GPU kind's peak throughput over the prefill
    worker's (1.0 for the same kind). ``decode_active``: sequences the decode worker runs."""
    if policy_threshold is not None:
        if policy_threshold == 0:
            return Decision(False, "disaggregated (conditional disaggregation off)")
        short = prompt_tokens < policy_threshold
        sign = "<" if short else ">="
        return Decision(
            short,
            f"{'aggregated' if short else 'disaggregated'}: prompt {prompt_tokens} {sign} "
            f"{policy_threshold} tokens",
        )
    if prompt_tokens > AUTO_CAP_TOKENS:
        return Decision(False, f"disaggregated: prompt {prompt_tokens} > {AUTO_CAP_TOKENS}")
    if transfer is None or prefill_rate is None or local_speedup <= 0:
        return Decision(False, "disaggregated: rates not measured yet")
    n = prompt_tokens
    local = (1 + decode_active) * n / (prefill_rate * local_speedup)
    remote = n / prefill_rate + transfer.seconds(n * kv_bytes_per_token)
    verdict = "aggregated" if local <= remote else "disaggregated"
    return Decision(
        local <= remote,
        f"{verdict}: prompt {n} tokens; local prefill stalls {1 + decode_active} stream(s) "
        f"{local * 1000:.2f} ms in all vs {remote * 1000:.2f} ms via the prefill pool",
    )
