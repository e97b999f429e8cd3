"""Chaos scenarios: YAML files → validated, frozen dataclasses; faults planned from a seed.

Pure: parsing and planning do no I/O beyond reading the file they are given. A scenario says
what cluster to start, what workload to run, which faults to inject (at fixed times, or drawn
at random from the seed) and which invariants the checker enforces::

    name: decode-kill
    description: a decode worker is killed mid-stream and comes back
    cluster: {prefill: 2, decode: 2, orchestrators: 2, transport: auto, model: tiny,
              engine: reference}
    workload: {requests: 8, concurrency: 8, prompt_words: [4, 24], output_tokens: [400, 800]}
    faults:
      - {at: 1.0, kind: kill, target: "decode:busiest", heal_after: 2.0}
    random_faults:
      - {count: 1, kinds: [kill, stop], targets: ["prefill:random"], between: [0.5, 3.0]}
    duration_s: 60
    quiet_s: 5
    invariants: [no_lost, no_duplicates, no_gaps, outputs_match, no_leaks]

Process fault kinds: ``kill`` (SIGKILL; ``heal_after`` restarts it), ``stop`` (SIGSTOP;
``heal_after`` sends SIGCONT), ``continue`` (SIGCONT, for a stop without a heal),
``restart`` (kill, then start again after ``heal_after``, 0.5 s by default). Link kinds:
``delay`` (params.delay_ms), ``bandwidth`` (params.bytes_per_s), ``drop``, ``corrupt``
(params.probability).

``engine: sim`` runs every worker simulated with a prefix cache (``pdorch worker --sim
llama-3-8b@L4 --sim-prefix-cache``, one process each; model ``tiny``, unused): with a
workload whose prompts share an opening (``shared_prefix_words``), KV-aware routing and
suffix-only KV transfer are then at work under the faults. Process faults only (no
injector, no proxies in front of simulated workers).

``transport``: ``auto`` (``ucx`` where ucxx imports, else ``tcp``) or a ``pdorch worker
--transport`` choice (``ucx``, ``ucx-read``, ``tcp``); `with_transport` (``pdorch chaos run
--transport``) runs a scenario on another. KV-link faults (``link:kv``) on ``tcp`` go through
a fault proxy on the link; on the UCX backends, whose payloads do not travel on that link,
through the prefill workers' KV fault injector (the transport's fault-injecting wrapper).

``engine: vllm`` runs every worker on vLLM (``--engine vllm``; model ``smollm2``; the
command runs from the vllm extra's environment). KV-link faults then need ``transport: tcp``
(a proxy on the link): over UCX the KV leaves from inside vLLM's processes, where the
transport's fault-injecting wrapper is not installed.

A fault may wait for a request *phase* instead of trusting the clock alone:
``when: {state: decoding, tokens: 3}`` fires a worker fault, at ``at`` or later, as soon as a
request of this run is in that state on a worker of the target's role (with at least
``tokens`` output tokens journalled, for at least ``after_s`` seconds), and aims it at that
request's worker (a named target must be the one).
States: ``prefilling`` (for vLLM workers: computing *and pushing* its KV, one call),
``sending`` (a KV transfer in flight: its header accepted, the layers before ``layer`` — 1 by
default — sent, the rest not: the prefill workers' KV fault injector holds layer ``layer`` of
each transfer at a gate, up to `GATE_HOLD_S`, until the fault fires; a decode target is the
transfer's receiver; reference engine only), ``transferring`` (the KV sent and verified, the
Decode call not yet streaming), ``decoding``. ``when: {streams: N}`` (any target, with or
without a state) waits until at least N of this run's streams are active (a token received,
not ended). ``within_s`` (30) bounds the wait; a trigger not met by then is reported as the
fault's error — it fails the run's verdict — and the fault is not injected. Faults run in
file order of their times, each after the previous one.

Honest reports: every fault is recorded with its planned time and the time it was executed;
one executed more than ``late_bound_s`` (0.5 s) after its time (or its trigger) is *late*,
and late faults and faults that could not be injected fail the verdict.

The cluster can be given extra flags, per role: ``cluster: {prefill_flags: [--kv-hold, "2"],
decode_flags: [--metrics-port, "920{index}"], orchestrator_flags: [...]}`` (``{index}`` is the
process's index in its role); ``keep_up_s`` keeps the cluster up that long after the runs
(to read its metrics or logs).

Targets: ``prefill`` / ``decode`` with a selector (``:busiest`` the worker serving the most
of this run's streams, ``:random``, or a worker name such as ``decode-1``), ``pool:prefill``,
``pool:decode``, ``orchestrator`` (``:busiest`` / ``:random`` / ``orchestrator-0``), ``redis``,
``redis:primary`` (see below), and links for network faults: ``link:kv``, ``link:worker``
(orchestrator → worker gRPC), ``link:client`` (client → orchestrator gRPC).

A Redis Cluster instead of one redis-server: ``cluster: {redis_cluster: {primaries: 3,
replicas: 1, node_timeout_ms: 2000}}`` — the runner starts it itself (`orchestrator.store.
ha_servers.LocalRedisCluster`) and the whole fleet uses it. Its fault target is
``redis:primary``: the primary holding the most of this run's live request records (the
lowest port on a tie), SIGKILLed (``kill``, or ``restart``); the cluster promotes its replica
once ``node_timeout_ms`` has passed. The fault's record names the primary, its replica and
the records it held (the affected streams: their requests' keys all sit in one slot), and,
once seen, the promotion; ``heal_after`` starts the killed node again (after the promotion),
where it rejoins as a replica of its successor. pdorch does not ``WAIT`` for replication, so
writes acknowledged by the primary and not yet copied die with it: the checker reports what
that cost.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from orchestrator.core.spec import RequestLimits
from orchestrator.errors import PdorchError
from transport.backend_names import BACKENDS, needs_ucx


class ScenarioError(PdorchError):
    """A scenario file is missing, malformed or asks for something impossible."""


PROCESS_KINDS = frozenset({"kill", "stop", "continue", "restart"})
LINK_KINDS = frozenset({"delay", "bandwidth", "drop", "corrupt"})
KINDS = PROCESS_KINDS | LINK_KINDS
ROLES = ("prefill", "decode")
LINKS = ("kv", "worker", "client")
REDIS_PRIMARY = "redis:primary"
"""A Redis Cluster primary (the one holding the most live request records)."""
INVARIANTS = frozenset({"no_lost", "no_duplicates", "no_gaps", "outputs_match", "no_leaks"})
MODEL_CONTEXT: dict[tuple[str, str], int] = {
    ("tiny", "reference"): 8192,
    ("smollm2", "reference"): 8192,
    ("smollm2", "vllm"): 2048,
    ("tiny", "sim"): 8192,
}
"""(model, engine) → the context a request's prompt and output share: the models'
``max_position_embeddings`` (`orchestrator.workers.model_files`), vLLM's ``max_model_len``
(`orchestrator.workers.vllm.engine.VllmSettings`); a test checks they still agree."""
PROMPT_TOKENS_PER_WORD = 16
"""A generous bound on a workload word's tokens (the tiny model's tokenizer is byte-level:
the longest workload word and its space are under 16 bytes)."""
PROMPT_OVERHEAD_TOKENS = 64
"""The chat template's tokens around the prompt, with room to spare."""
OWN_FLAGS = frozenset({
    "--role", "--redis", "--model", "--transport", "--worker-id", "--port", "--kv-port",
    "--engine", "--kv-fault", "--kv-fault-file", "--advertise", "--kv-advertise",
    "--replica-id", "--heartbeat-ttl", "--http-port",
})  # fmt: skip
"""Flags the local cluster sets itself: a scenario's extra flags may not override them."""
GATE_HOLD_S = 1.0
"""How long a ``sending`` trigger's gate holds a layer: the runner sees the hold within
~20 ms (more under load) and fires; the gate is opened right after, but layers already
waiting finish their hold, so the held transfer's recovery includes up to this much."""
LINK_PARAMS: dict[str, tuple[str, ...]] = {
    "delay": ("delay_ms",),
    "bandwidth": ("bytes_per_s",),
    "drop": (),
    "corrupt": ("probability",),
}


TRANSPORTS = ("auto", *BACKENDS)
"""A scenario's ``cluster.transport`` choices."""


@dataclass(frozen=True, slots=True)
class RedisClusterSpec:
    """A Redis Cluster the runner starts for the fleet (instead of one redis-server)."""

    primaries: int = 3
    replicas: int = 1
    """Replicas of each primary (at least 1 for a ``redis:primary`` fault's failover)."""
    node_timeout_ms: int = 2000
    """``cluster-node-timeout``: a primary unreachable this long is failed over; short, so
    a run sees the promotion, long enough that a loaded 2-core machine does not fail one over
    by mistake."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    prefill: int = 2
    decode: int = 2
    orchestrators: int = 2
    transport: str = "auto"
    """``auto`` (UCX where ucxx imports, else TCP) or one of `TRANSPORTS`."""
    model: str = "tiny"
    engine: str = "reference"
    """The workers' engine (``pdorch worker --engine``): reference, or vllm; or sim
    (simulated workers with a prefix cache)."""
    redis_aof: bool = True
    heartbeat_ttl_s: float = 3.0
    prefill_flags: tuple[str, ...] = ()
    decode_flags: tuple[str, ...] = ()
    orchestrator_flags: tuple[str, ...] = ()
    """Extra flags for each process of a role (``{index}``: the process's index)."""
    redis_cluster: RedisClusterSpec | None = None
    """None: one redis-server of the cluster's own (``redis_aof`` applies to it)."""


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 8
    concurrency: int = 8
    prompt_words: tuple[int, int] = (4, 24)
    output_tokens: tuple[int, int] = (200, 400)
    shared_prefix_words: int = 0
    """Words every prompt opens with (one fixed text, like a system prompt): what prefix
    caches, KV-aware routing and suffix-only transfer act on."""
    sampled_share: float = 0.25
    """Share of requests sampled at temperature 0.8 with a fixed seed (the rest greedy): the
    sampling draw for token i depends only on (seed, i), so failover must not change them."""
    request_timeout_s: float = 120.0
    client: str = "generate"
    """How the clients call: ``generate``, one ``Generate`` call per request; ``generate-many``,
    every request of a client on one ``GenerateMany`` call per replica (a broken call breaks
    all of them: each resumes on the next replica)."""


CLIENTS = ("generate", "generate-many")
"""A workload's ``client`` choices."""

TRIGGER_STATES: dict[str, tuple[str, ...]] = {
    "prefill": ("prefilling", "sending"),
    "decode": ("sending", "transferring", "decoding"),
}
"""Request states a worker fault can wait for, by the target's role (the worker the record
names for that role is serving the request in that state)."""


@dataclass(frozen=True, slots=True)
class Trigger:
    """Fire a fault once a request is in ``state`` on a worker of its target's role, and/or
    once ``streams`` of this run's streams are active."""

    state: str = ""
    """"": no phase (``streams`` alone)."""
    tokens: int = 0
    """...with at least this many output tokens journalled."""
    after_s: float = 0.0
    """...and in that state for at least this long (as the polls saw it): e.g. a prefill's
    KV push under way, past its header, on a slowed link."""
    within_s: float = 30.0
    """The longest wait after the fault's time; unmet, the fault is reported, not injected."""
    streams: int = 0
    """...while at least this many of this run's streams are active (a token received, the
    request not ended)."""
    layer: int = 1
    """``sending``: the layer held at the gate (the layers before it are sent)."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    target: str
    at: float | None = None
    between: tuple[float, float] | None = None
    heal_after: float | None = None
    """Seconds until the fault is undone (restart / continue / link healed); None: never for
    kill and stop, 0.5 s for restart, the run's end for link faults."""
    params: Mapping[str, float] = field(default_factory=dict)
    after_healed: bool = False
    """Wait, before this fault, until every earlier fault has healed (so that e.g. a pool is
    back in service before the other pool goes): ``at`` is then the earliest time."""
    when: Trigger | None = None


@dataclass(frozen=True, slots=True)
class RandomFaults:
    count: int
    kinds: tuple[str, ...]
    targets: tuple[str, ...]
    between: tuple[float, float]
    heal_after: float | None = None
    params: Mapping[str, float] = field(default_factory=dict)


MIN_LATE_BOUND_S = 0.01
"""The smallest ``late_bound_s`` (the loop's own scheduling is finer than nothing)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    cluster: ClusterSpec
    workload: Workload
    faults: tuple[FaultSpec, ...]
    random_faults: tuple[RandomFaults, ...] = ()
    duration_s: float = 60.0
    quiet_s: float = 15.0
    """After the clients are done: the longest wait for every request to reach a terminal
    state (the wait ends as soon as they all have); what is still live then is lost."""
    invariants: frozenset[str] = INVARIANTS
    path: str = ""
    leak_wait_s: float | None = None
    """After the quiet period: the longest wait for every worker's KV gauges to return
    (`orchestrator.chaos.leaks`); None: the transport's hold lease (a received KV nobody
    claims is freed by it, by design) plus the heartbeat TTL."""
    late_bound_s: float = 0.5
    """A fault executed later than this after its time (or its trigger) is *late*
    (at least `MIN_LATE_BOUND_S`)."""
    keep_up_s: float = 0.0
    """After the runs: keep the cluster up this long (read its metrics, logs)."""

    def links(self) -> frozenset[str]:
        """The links a fault proxy must sit on (UCX KV faults use the transport's wrapper)."""
        targets = [f.target for f in self.faults] + [
            t for r in self.random_faults for t in r.targets
        ]
        return frozenset(t.split(":", 1)[1] for t in targets if t.startswith("link:"))


def kv_fault_spec(active: Iterable[tuple[str, Mapping[str, float]]], gate: int | None) -> str:
    """The in-worker KV fault injector's spec (`transport.testing.FaultInjector.parse`) for
    the KV-link faults active now — (kind, params) each, independent of one another — and a
    ``sending`` trigger's gate at layer ``gate`` (None: none)."""
    parts: dict[str, float] = {}
    for kind, params in active:
        if kind == "corrupt":
            parts["layer"], parts["corrupt"] = 1, 4099
            parts["p"] = max(parts.get("p", 0.0), params["probability"])
        elif kind == "delay":
            parts["lag"] = parts.get("lag", 0.0) + params["delay_ms"] / 1000
        elif kind == "bandwidth":
            rate = params["bytes_per_s"]
            parts["bw"] = min(parts.get("bw", rate), rate)
        elif kind == "drop":
            parts["drop"] = 1
    if gate is not None:
        parts["hold_layer"], parts["hold"] = gate, GATE_HOLD_S
    armed = 1 if parts else 0
    return ",".join([*(f"{k}={v:g}" for k, v in parts.items()), "seed=7", f"armed={armed}"])


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """A fault with its time fixed (seconds after the workload starts)."""

    at: float
    kind: str
    target: str
    heal_after: float | None
    params: Mapping[str, float]
    after_healed: bool = False
    when: Trigger | None = None

    def label(self) -> str:
        return f"{self.kind} {self.target}"


def plan(scenario: Scenario, seed: int) -> tuple[PlannedFault, ...]:
    """The run's faults in time order: fixed ones as written, random ones drawn from ``seed``."""
    rng = random.Random(seed)  # noqa: S311 - reproducible chaos, not secrets
    out: list[PlannedFault] = []
    for f in scenario.faults:
        at = f.at if f.at is not None else rng.uniform(*(f.between or (0.0, 0.0)))
        out.append(
            PlannedFault(
                round(at, 3), f.kind, f.target, f.heal_after, f.params, f.after_healed, f.when
            )
        )
    for r in scenario.random_faults:
        for _ in range(r.count):
            out.append(
                PlannedFault(
                    round(rng.uniform(*r.between), 3),
                    rng.choice(r.kinds),
                    rng.choice(r.targets),
                    r.heal_after,
                    r.params,
                )
            )
    return tuple(sorted(out, key=lambda p: p.at))


# ----------------------------------------------------------------------------- loading


def shipped() -> dict[str, Path]:
    """Scenario name → file, for the scenarios shipped inside the package."""
    folder = resources.files("orchestrator.chaos") / "scenarios"
    return {
        Path(entry.name).stem: Path(str(entry))
        for entry in folder.iterdir()
        if entry.name.endswith((".yaml", ".yml"))
    }


def load(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a YAML file by path."""
    path = Path(name_or_path)
    if not path.exists():
        found = shipped().get(name_or_path)
        if found is None:
            names = ", ".join(sorted(shipped()))
            raise ScenarioError(f"no scenario file or shipped scenario {name_or_path!r} ({names})")
        path = found
    import yaml  # noqa: PLC0415 - only the chaos tool needs YAML

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    return parse(data, str(path))


def parse(data: object, path: str = "<scenario>") -> Scenario:
    """Validate a scenario's YAML data; every error names the field."""
    d = _mapping(data, path)
    _known(d, path, {"name", "description", "cluster", "workload", "faults", "random_faults",
                     "duration_s", "quiet_s", "invariants", "leak_wait_s", "late_bound_s",
                     "keep_up_s"})  # fmt: skip
    cluster = _cluster(_mapping(d.get("cluster", {}), f"{path}: cluster"), f"{path}: cluster")
    workload = _workload(_mapping(d.get("workload", {}), f"{path}: workload"), f"{path}: workload")
    _check_output(workload, cluster, f"{path}: workload.output_tokens")
    faults = tuple(
        _fault(_mapping(f, f"{path}: faults[{i}]"), f"{path}: faults[{i}]", cluster)
        for i, f in enumerate(_list(d.get("faults", []), f"{path}: faults"))
    )
    randoms = tuple(
        _random(_mapping(r, f"{path}: random_faults[{i}]"), f"{path}: random_faults[{i}]", cluster)
        for i, r in enumerate(_list(d.get("random_faults", []), f"{path}: random_faults"))
    )
    if not faults and not randoms:
        raise ScenarioError(f"{path}: a scenario needs faults or random_faults")
    invariants = frozenset(str(x) for x in _list(d.get("invariants", sorted(INVARIANTS)), path))
    if unknown := invariants - INVARIANTS:
        raise ScenarioError(f"{path}: invariants: unknown {sorted(unknown)}")
    scenario = Scenario(
        name=_str(d.get("name", Path(path).stem), f"{path}: name"),
        description=_str(d.get("description", ""), f"{path}: description"),
        cluster=cluster,
        workload=workload,
        faults=faults,
        random_faults=randoms,
        duration_s=_number(d.get("duration_s", 60.0), f"{path}: duration_s", lo=1.0),
        quiet_s=_number(d.get("quiet_s", 15.0), f"{path}: quiet_s", lo=0.0),
        invariants=invariants,
        path=path,
        leak_wait_s=(
            None
            if d.get("leak_wait_s") is None
            else _number(d["leak_wait_s"], f"{path}: leak_wait_s", lo=0.0)
        ),
        late_bound_s=_number(
            d.get("late_bound_s", 0.5), f"{path}: late_bound_s", lo=MIN_LATE_BOUND_S
        ),
        keep_up_s=_number(d.get("keep_up_s", 0.0), f"{path}: keep_up_s", lo=0.0, hi=86400.0),
    )
    gated = any(f.when is not None and f.when.state == "sending" for f in faults)
    if cluster.engine == "vllm" and gated:
        raise ScenarioError(
            f"{path}: the trigger state sending needs engine reference (its gate is the "
            "workers' KV fault injector, which vLLM's processes don't have)"
        )
    if cluster.engine == "sim" and (gated or scenario.links()):
        raise ScenarioError(
            f"{path}: engine sim takes process faults only (no KV fault injector or proxies "
            "in front of simulated workers)"
        )
    _check_transport(scenario, path)
    for p in plan(scenario, 0):
        if p.at >= scenario.duration_s:
            raise ScenarioError(f"{path}: a fault at {p.at}s is after duration_s")
    return scenario


def _check_transport(scenario: Scenario, where: str) -> None:
    cluster = scenario.cluster
    if cluster.engine == "vllm" and needs_ucx(cluster.transport) and "kv" in scenario.links():
        raise ScenarioError(
            f"{where}: KV-link faults with engine vllm need transport tcp (over UCX the KV "
            "leaves from inside vLLM's processes, where no fault injector sits)"
        )


def with_transport(scenario: Scenario, transport: str) -> Scenario:
    """``scenario`` on its cluster with workers on ``transport`` (one of `TRANSPORTS`),
    checked as if its file said so."""
    if transport not in TRANSPORTS:
        raise ScenarioError(f"transport {transport!r}: choose from {', '.join(TRANSPORTS)}")
    out = replace(scenario, cluster=replace(scenario.cluster, transport=transport))
    _check_transport(out, f"{scenario.path or scenario.name} with transport {transport}")
    return out


def _cluster(d: Mapping[str, Any], where: str) -> ClusterSpec:
    _known(d, where, {"prefill", "decode", "orchestrators", "transport", "model", "engine",
                      "redis_aof", "heartbeat_ttl_s", "prefill_flags", "decode_flags",
                      "orchestrator_flags", "redis_cluster"})  # fmt: skip
    redis_cluster = None
    if "redis_cluster" in d:
        redis_cluster = _redis_cluster(
            _mapping(d["redis_cluster"], f"{where}.redis_cluster"), f"{where}.redis_cluster"
        )
    spec = ClusterSpec(
        prefill=_int(d.get("prefill", 2), f"{where}.prefill", lo=0, hi=16),
        decode=_int(d.get("decode", 2), f"{where}.decode", lo=0, hi=16),
        orchestrators=_int(d.get("orchestrators", 2), f"{where}.orchestrators", lo=1, hi=8),
        transport=_choice(d.get("transport", "auto"), f"{where}.transport", TRANSPORTS),
        model=_choice(d.get("model", "tiny"), f"{where}.model", ("tiny", "smollm2")),
        engine=_choice(
            d.get("engine", "reference"), f"{where}.engine", ("reference", "vllm", "sim")
        ),
        redis_aof=bool(d.get("redis_aof", True)),
        heartbeat_ttl_s=_number(d.get("heartbeat_ttl_s", 3.0), f"{where}.heartbeat_ttl_s", lo=0.3),
        prefill_flags=_flags(d.get("prefill_flags", []), f"{where}.prefill_flags"),
        decode_flags=_flags(d.get("decode_flags", []), f"{where}.decode_flags"),
        orchestrator_flags=_flags(d.get("orchestrator_flags", []), f"{where}.orchestrator_flags"),
        redis_cluster=redis_cluster,
    )
    if spec.prefill + spec.decode == 0:
        raise ScenarioError(f"{where}: needs at least one worker")
    if spec.engine == "vllm" and spec.model != "smollm2":
        raise ScenarioError(f"{where}: engine vllm serves model smollm2 only")
    if spec.engine == "sim" and spec.model != "tiny":
        raise ScenarioError(f"{where}: engine sim simulates its own model: leave model at tiny")
    return spec


def _redis_cluster(d: Mapping[str, Any], where: str) -> RedisClusterSpec:
    _known(d, where, {"primaries", "replicas", "node_timeout_ms"})
    return RedisClusterSpec(
        # redis-cli --cluster create (and so replicas) needs 3 primaries at least
        primaries=_int(d.get("primaries", 3), f"{where}.primaries", lo=3, hi=16),
        replicas=_int(d.get("replicas", 1), f"{where}.replicas", lo=0, hi=2),
        node_timeout_ms=_int(
            d.get("node_timeout_ms", 2000), f"{where}.node_timeout_ms", lo=500, hi=60_000
        ),
    )


def _flags(value: object, where: str) -> tuple[str, ...]:
    flags = tuple(_str(x, where) for x in _list(value, where))
    for flag in flags:
        if flag.split("=", 1)[0] in OWN_FLAGS:
            raise ScenarioError(f"{where}: {flag} is set by the local cluster itself")
    return flags


def _check_output(workload: Workload, cluster: ClusterSpec, where: str) -> None:
    """The longest output asked for, with the longest prompt, must fit the model's context and
    the orchestrator's max_tokens: else every request is refused (INVALID_ARGUMENT) at once."""
    hi = workload.output_tokens[1]
    cap = RequestLimits().max_tokens
    if hi > cap:
        raise ScenarioError(f"{where}: {hi} is above the orchestrator's max_tokens of {cap}")
    context = MODEL_CONTEXT[(cluster.model, cluster.engine)]
    words = workload.prompt_words[1] + workload.shared_prefix_words
    prompt = words * PROMPT_TOKENS_PER_WORD + PROMPT_OVERHEAD_TOKENS
    if hi + prompt > context:
        raise ScenarioError(
            f"{where}: {hi} output tokens and a prompt of up to {prompt} tokens exceed the "
            f"context of {context} tokens of model {cluster.model} on engine {cluster.engine}"
        )


def _workload(d: Mapping[str, Any], where: str) -> Workload:
    _known(d, where, {"requests", "concurrency", "prompt_words", "output_tokens",
                      "sampled_share", "request_timeout_s", "shared_prefix_words",
                      "client"})  # fmt: skip
    return Workload(
        requests=_int(d.get("requests", 8), f"{where}.requests", lo=1, hi=100_000),
        concurrency=_int(d.get("concurrency", 8), f"{where}.concurrency", lo=1, hi=4096),
        prompt_words=_range(d.get("prompt_words", [4, 24]), f"{where}.prompt_words", lo=1),
        output_tokens=_range(d.get("output_tokens", [200, 400]), f"{where}.output_tokens", lo=1),
        sampled_share=_number(d.get("sampled_share", 0.25), f"{where}.sampled_share", 0.0, 1.0),
        request_timeout_s=_number(d.get("request_timeout_s", 120), f"{where}.request_timeout_s", 1),
        shared_prefix_words=_int(
            d.get("shared_prefix_words", 0), f"{where}.shared_prefix_words", lo=0, hi=4096
        ),
        client=_choice(d.get("client", "generate"), f"{where}.client", CLIENTS),
    )


def _target(value: object, where: str, cluster: ClusterSpec) -> str:
    target = _str(value, where)
    head, _, sel = target.partition(":")
    ok = False
    if head in ROLES:
        count = cluster.prefill if head == "prefill" else cluster.decode
        names = {f"{head}-{i}" for i in range(count)}
        ok = count > 0 and (sel in {"", "busiest", "random"} or sel in names)
    elif head == "pool":
        ok = sel in ROLES
    elif head == "orchestrator":
        names = {f"orchestrator-{i}" for i in range(cluster.orchestrators)}
        ok = sel in {"", "busiest", "random"} or sel in names
    elif head == "redis":  # on a Redis Cluster, no one redis-server to fault: a primary
        rc = cluster.redis_cluster
        ok = sel == "" if rc is None else target == REDIS_PRIMARY and rc.replicas > 0
    elif head == "link":
        ok = sel in LINKS
    if not ok:
        raise ScenarioError(f"{where}: unknown target {target!r} for this cluster")
    return target


def _check_kind(kind: str, target: str, where: str) -> None:
    link = target.startswith("link:")
    if link != (kind in LINK_KINDS):
        raise ScenarioError(f"{where}: {kind!r} does not apply to target {target!r}")
    if target.startswith("redis") and kind in {"stop", "continue"}:
        raise ScenarioError(f"{where}: {target} can be killed or restarted, not stopped")


def _params(d: Mapping[str, Any], kinds: tuple[str, ...], where: str) -> dict[str, float]:
    raw = _mapping(d.get("params", {}), f"{where}.params")
    allowed = {p for k in kinds for p in LINK_PARAMS.get(k, ())}
    _known(raw, f"{where}.params", allowed)
    out = {k: _number(v, f"{where}.params.{k}", lo=0.0) for k, v in raw.items()}
    for kind in kinds:
        for needed in LINK_PARAMS.get(kind, ()):
            if needed not in out:
                raise ScenarioError(f"{where}.params: {kind} needs {needed}")
    if out.get("probability", 0.0) > 1.0:
        raise ScenarioError(f"{where}.params.probability: must be in [0, 1]")
    return out


def _fault(d: Mapping[str, Any], where: str, cluster: ClusterSpec) -> FaultSpec:
    _known(d, where, {"kind", "target", "at", "between", "heal_after", "params", "after_healed",
                      "when"})  # fmt: skip
    kind = _choice(d.get("kind"), f"{where}.kind", tuple(sorted(KINDS)))
    target = _target(d.get("target"), f"{where}.target", cluster)
    _check_kind(kind, target, where)
    when = None
    if "when" in d:
        when = _trigger(_mapping(d["when"], f"{where}.when"), f"{where}.when", target)
    at = d.get("at")
    between = _range(d["between"], f"{where}.between", lo=0.0) if "between" in d else None
    if (at is None) == (between is None):
        raise ScenarioError(f"{where}: give exactly one of at and between")
    heal = d.get("heal_after")
    return FaultSpec(
        kind=kind,
        target=target,
        at=None if at is None else _number(at, f"{where}.at", lo=0.0),
        between=between,
        heal_after=None if heal is None else _number(heal, f"{where}.heal_after", lo=0.0),
        params=_params(d, (kind,), where),
        after_healed=_bool(d.get("after_healed", False), f"{where}.after_healed"),
        when=when,
    )


def _trigger(d: Mapping[str, Any], where: str, target: str) -> Trigger:
    _known(d, where, {"state", "tokens", "after_s", "within_s", "streams", "layer"})
    role = target.partition(":")[0]
    state = ""
    if "state" in d:
        if role not in TRIGGER_STATES:
            raise ScenarioError(f"{where}: only prefill and decode worker faults wait for a state")
        state = _choice(d["state"], f"{where}.state", TRIGGER_STATES[role])
    elif "streams" not in d:
        raise ScenarioError(f"{where}: give a state, streams, or both")
    if state != "sending" and "layer" in d:
        raise ScenarioError(f"{where}.layer: only for state sending")
    if not state and ("tokens" in d or "after_s" in d):
        raise ScenarioError(f"{where}: tokens and after_s need a state")
    return Trigger(
        state=state,
        tokens=_int(d.get("tokens", 0), f"{where}.tokens", lo=0, hi=1_000_000),
        after_s=_number(d.get("after_s", 0.0), f"{where}.after_s", lo=0.0),
        within_s=_number(d.get("within_s", 30.0), f"{where}.within_s", lo=0.1),
        streams=_int(d.get("streams", 0), f"{where}.streams", lo=0, hi=100_000),
        layer=_int(d.get("layer", 1), f"{where}.layer", lo=0, hi=4096),
    )


def _random(d: Mapping[str, Any], where: str, cluster: ClusterSpec) -> RandomFaults:
    _known(d, where, {"count", "kinds", "targets", "between", "heal_after", "params"})
    kinds = tuple(
        _choice(k, f"{where}.kinds", tuple(sorted(KINDS)))
        for k in _list(d.get("kinds"), f"{where}.kinds")
    )
    targets = tuple(
        _target(t, f"{where}.targets", cluster) for t in _list(d.get("targets"), f"{where}.targets")
    )
    if not kinds or not targets:
        raise ScenarioError(f"{where}: kinds and targets must not be empty")
    for kind in kinds:
        for target in targets:
            _check_kind(kind, target, where)
    heal = d.get("heal_after")
    return RandomFaults(
        count=_int(d.get("count", 1), f"{where}.count", lo=1, hi=1000),
        kinds=kinds,
        targets=targets,
        between=_range(d.get("between"), f"{where}.between", lo=0.0),
        heal_after=None if heal is None else _number(heal, f"{where}.heal_after", lo=0.0),
        params=_params(d, kinds, where),
    )


# ----------------------------------------------------------------------------- field checks


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _known(d: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    if unknown := set(d) - allowed:
        raise ScenarioError(f"{where}: unknown field(s) {sorted(unknown)}")


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}: expected true or false")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ScenarioError(f"{where}: expected a string")
    return value


def _choice(value: object, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ScenarioError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _number(value: object, where: str, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScenarioError(f"{where}: expected a number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ScenarioError(f"{where}: {value} is out of range [{lo}, {hi}]")
    return float(value)


def _int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{where}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ScenarioError(f"{where}: {value} is out of range [{lo}, {hi}]")
    return value


def _range(value: object, where: str, lo: float) -> tuple[Any, Any]:
    items = _list(value, where)
    if len(items) != 2:
        raise ScenarioError(f"{where}: expected [low, high]")
    a, b = (_number(x, where, lo=lo) for x in items)
    if a > b:
        raise ScenarioError(f"{where}: low {a} is above high {b}")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return int(a), int(b)
    return a, b
