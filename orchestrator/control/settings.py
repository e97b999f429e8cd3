"""The control plane's settings: one frozen group, passed to every control module."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.core.admission import AdmissionPolicy
from orchestrator.core.deadlines import StateDeadlines
from orchestrator.core.hardware import PRICED_KINDS, GpuProfile
from orchestrator.core.kvdtype import KvPolicy
from orchestrator.core.routing import RoutingPolicy
from orchestrator.core.spec import RequestLimits


@dataclass(frozen=True, slots=True)
class ControlSettings:
    limits: RequestLimits = field(default_factory=RequestLimits)
    """What a request may ask for (`orchestrator.core.spec.RequestLimits`)."""
    fallback: str = "local"
    """When a pool is down: "local" runs aggregated on the other pool; "fail" refuses."""
    prefill_timeout_s: float = 120.0
    kv_timeout_s: float = 30.0
    token_timeout_s: float = 60.0
    """Longest silence from a decode stream before the request fails."""
    stream_flush_ms: float = 100.0
    """The coalescing window asked of workers' token streams (``flush_ms``): at most one
    chunk per stream per window, carrying the tokens produced meanwhile. Every message costs
    the orchestrator a gRPC read, a journal write and a relay whatever it holds, so this is
    what a token costs here; a token waits at most this long (the first never does). 0:
    every token in its own message."""
    decode_mux: bool = True
    """Read the decode streams of the requests on one decode worker from one ``DecodeMany``
    call (one message per batch of streams, `orchestrator.control.mux`) rather than one
    ``Decode`` call each. A worker without it is read the old way."""
    call_mux: bool = True
    """Send a worker this replica's ``Tokenize`` and ``Prefill`` calls as messages on one
    ``CallMany`` call (`orchestrator.control.calls`) rather than as unary calls: a message on
    an open call costs less than a call. A worker without it gets unary calls."""
    journal_gather_ms: float = 10.0
    """Under load, the least time between two journal writes (each one round trip for the
    chunks of every stream on this replica, `orchestrator.control.journal`): a chunk may
    wait this long for the next write — only while the previous one started less than this
    ago; a request's first token never waits for it. Fewer, larger writes: the store call
    costs the same whatever it carries. 0: write as soon as the previous write returned."""
    workers_cache_s: float = 0.25
    """How long a listing of the live workers is reused (0: list them for every request),
    by admission and by the watch on each call's worker — which takes "alive" from a
    listing this young and asks the store only about a worker missing from it
    (`orchestrator.control.directory`). Heartbeats change once a second; an attempt's own
    failures are not cached."""
    placement_sample: int = 64
    """Placement over a pool of more workers than this chooses among this many of them,
    drawn at random per request (and the holders of its prefix): its cost stops growing
    with the fleet (`orchestrator.core.fleet`). Pools of at most this many are scanned
    whole. 0: always scan every worker."""
    follow_poll_s: float = 0.05
    """How often a follower (resubmission, resume) polls the journal of a request."""
    watch_interval_s: float = 0.5
    """How often a wait on a worker checks that its heartbeat is still alive."""
    max_attempts: int = 4
    """Attempts in a row (the first plus failovers) that move a request on by no more than
    the one token a prefill samples, lasting at least 2 × ``retry_max_s``, before it fails;
    attempts that relay more start the count again, up to 4 × this in all
    (`orchestrator.control.failover`)."""
    retry_initial_s: float = 0.05
    retry_max_s: float = 1.0
    breaker_cooldown_s: float = 2.0
    """A worker whose call failed is skipped this long, then probed by one request."""
    reap_interval_s: float = 1.0
    """How often a replica looks for requests whose owner's lease expired."""
    deadlines: StateDeadlines = field(default_factory=StateDeadlines)
    """The backstop per state (`orchestrator.core.deadlines`): enforced by every replica."""
    deadline_scan_s: float = 5.0
    """How often a replica checks every live request against its state's deadline."""
    prices: Mapping[str, GpuProfile] = field(default_factory=lambda: dict(PRICED_KINDS))
    """GPU kind (a worker's --gpu-kind) -> its profile and price per hour."""
    transfer_usd_per_gb: float = 0.0
    """What moving a GB of KV between workers costs (0 inside a cluster)."""
    detach_grace_s: float = 10.0
    """A request whose client went away keeps running this long, so the client can reconnect
    (to any replica) and resume; with no client attached by then it is cancelled."""
    attach_refresh_s: float = 1.0
    """How often a client following a request from the journal says it is still there."""
    kv_dtype: KvPolicy = KvPolicy.AUTO
    """How the KV's wire dtype is chosen per prefill→decode pair (`orchestrator.core.kvdtype`)."""
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    """Early rejection (SLO, bounded queues, in-flight and tenant limits) and conditional
    disaggregation (`orchestrator.core.admission`)."""
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    """KV-cache-aware routing (`orchestrator.core.routing`): on by default; it changes no
    placement while no worker reports a prefix cache."""
