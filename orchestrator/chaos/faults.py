"""Executes planned faults on a local cluster: signals, restarts, link faults.

Process faults are signals to real processes (SIGKILL, SIGSTOP/SIGCONT) and restarts through
`LocalCluster`. Link faults go to the fault proxies on TCP paths, or — for the KV link over
UCX, where no TCP proxy can sit — to the transport's fault-injecting wrapper inside every
prefill worker (started with ``--kv-fault …,armed=0``; SIGUSR1 arms it, SIGUSR2 disarms).

Each fault is recorded with the request streams it hit: those served at that moment by the
worker, pool or replica it targets (read from the request records in Redis, and from which
replica each client is attached to), or every active stream for Redis and link faults.
A worker fault with a trigger (``when``) first polls this run's request records until one is
in the asked phase on a worker of the target's role, and is aimed at that worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from collections.abc import Mapping

from orchestrator.chaos.history import FaultRecord, History
from orchestrator.chaos.proxy import FaultProxy
from orchestrator.chaos.scenario import PlannedFault, Trigger
from orchestrator.cluster import LocalCluster
from orchestrator.core.records import RequestRecord
from orchestrator.core.state import State
from orchestrator.errors import PdorchError
from orchestrator.store.redis_store import RedisStore

log = logging.getLogger(__name__)

_USING_PREFILL = frozenset({State.PREFILLING, State.TRANSFERRING})
_USING_DECODE = frozenset({State.TRANSFERRING, State.DECODING})
_TRIGGER_POLL_S = 0.05
"""How often a trigger reads the run's request records (a few GETs each time)."""


class FaultExecutor:
    def __init__(
        self,
        cluster: LocalCluster,
        store: RedisStore,
        history: History,
        proxies: Mapping[str, Mapping[str, FaultProxy]],
        *,
        kv_injector: bool,
        now: object,
        seed: int,
    ) -> None:
        self.cluster = cluster
        self.store = store
        self.history = history
        self.proxies = proxies
        self.kv_injector = kv_injector
        self._now = now
        self._rng = random.Random(seed)  # noqa: S311 - reproducible chaos, not secrets
        self._heals: set[asyncio.Task[None]] = set()

    def now(self) -> float:
        return float(self._now())  # type: ignore[operator]

    # ------------------------------------------------------------------------ targets

    def _alive(self, prefix: str) -> list[str]:
        return sorted(
            name
            for name, proc in self.cluster.procs.items()
            if name.startswith(prefix) and proc.popen.poll() is None
        )

    async def _records(self) -> dict[str, RequestRecord]:
        """Records of this run's active requests (empty if the store can't be read now)."""
        active = self.history.active_at(self.now())

        async def get(rid: str) -> tuple[str, RequestRecord | None]:
            try:
                return rid, await asyncio.wait_for(self.store.get(rid), 1.0)
            except (PdorchError, TimeoutError):
                return rid, None

        pairs = await asyncio.gather(*(get(rid) for rid in sorted(active)))
        return {rid: rec for rid, rec in pairs if rec is not None and not rec.state.terminal}

    def _pick(self, role: str, selector: str, load: Mapping[str, int]) -> str | None:
        alive = self._alive(f"{role}-")
        if selector not in {"", "busiest", "random"}:
            return selector if selector in alive else None
        if not alive:
            return None
        if selector == "random":
            return self._rng.choice(alive)
        return max(alive, key=lambda n: (load.get(n, 0), -alive.index(n)))

    def _attached(self, replica_address: str) -> set[str]:
        """Active requests whose client's latest attempt went to this replica."""
        last: dict[str, str] = {}
        for op in self.history.ops:
            if op.type == "invoke":
                last[op.request] = op.orchestrator
        active = self.history.active_at(self.now())
        return {rid for rid, a in last.items() if a == replica_address and rid in active}

    # ------------------------------------------------------------------------ faults

    async def _triggered(
        self, role: str, selector: str, when: Trigger
    ) -> tuple[dict[str, RequestRecord], str, str] | None:
        """Poll until a request is in ``when.state`` on a worker of ``role`` (the named one,
        for a named selector): (the records then, that worker, a description), or None."""
        deadline = time.monotonic() + when.within_s
        since: dict[str, float] = {}
        """Request id -> when the polls first saw it in the state (and still do)."""
        while True:
            records = await self._records()
            now = time.monotonic()
            seen = {rid for rid, r in records.items() if str(r.state) == when.state}
            since = {rid: since.get(rid, now) for rid in seen}
            for rid, r in sorted(records.items()):
                worker = r.prefill_worker if role == "prefill" else r.decode_worker
                named = selector in {"", "busiest", "random"} or worker == selector
                if (
                    rid in seen
                    and now - since[rid] >= when.after_s
                    and r.output_tokens >= when.tokens
                    and worker
                    and named
                    and worker in self._alive(f"{role}-")
                ):
                    why = f"{rid} {when.state} on {worker} ({r.output_tokens} tokens)"
                    return records, worker, why
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(_TRIGGER_POLL_S)

    async def inject(self, fault: PlannedFault) -> FaultRecord:
        head, _, sel = fault.target.partition(":")
        chosen = trigger = ""
        if fault.when is not None and head in {"prefill", "decode"}:
            fired = await self._triggered(head, sel, fault.when)
            if fired is None:
                record = FaultRecord(self.now(), fault.kind, fault.target, "", (),
                                     wall_at=time.time())  # fmt: skip
                record.error = (
                    f"trigger not met within {fault.when.within_s}s: no request "
                    f"{fault.when.state} on a {head} worker"
                )
                self.history.faults.append(record)
                return record
            records, chosen, trigger = fired
        else:
            records = await self._records()
        record = FaultRecord(self.now(), fault.kind, fault.target, "", (), wall_at=time.time())
        record.trigger = trigger
        self.history.faults.append(record)
        try:
            await self._apply(fault, record, records, chosen)
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            log.exception("fault %s failed", fault.label())
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    async def _apply(
        self,
        fault: PlannedFault,
        record: FaultRecord,
        records: dict[str, RequestRecord],
        chosen: str,
    ) -> None:
        """Resolve the target (``chosen``: the worker a trigger picked), note the streams it
        hits, and inject."""
        head, _, sel = fault.target.partition(":")
        at = record.at
        if head in {"prefill", "decode"}:
            using = _USING_PREFILL if head == "prefill" else _USING_DECODE
            load: dict[str, int] = {}
            for r in records.values():
                w = r.prefill_worker if head == "prefill" else r.decode_worker
                if r.state in using and w:
                    load[w] = load.get(w, 0) + 1
            name = chosen or self._pick(head, sel, load)
            if name is None:
                record.resolved = f"no live {head} worker"
                return
            record.resolved = name
            record.affected = self._served_by(records, {name})
            await self._process(fault, [name])
            await self._note_journals(record)
        elif head == "pool":
            names = self._alive(f"{sel}-")
            record.resolved = ",".join(names) or f"{sel} pool already down"
            record.affected = self._served_by(records, set(names))
            await self._process(fault, names)
            await self._note_journals(record)
        elif head == "orchestrator":
            owners: dict[str, int] = {}
            for r in records.values():
                owners[r.owner] = owners.get(r.owner, 0) + 1
            name = self._pick("orchestrator", sel, owners)
            if name is None:
                record.resolved = "no live orchestrator"
                return
            record.resolved = name
            index = int(name.rsplit("-", 1)[1])
            owned = {rid for rid, r in records.items() if r.owner == name}
            attached = self._attached(self.cluster.orchestrator_addresses[index])
            record.affected = tuple(sorted(owned | attached))
            await self._process(fault, [name])
            # No journal mark: tokens the dead replica journalled but never relayed
            # reach the client from the journal after its reconnect; that *is* the
            # stream's recovery.
        elif head == "redis":
            record.resolved = "redis"
            record.affected = tuple(sorted(self.history.active_at(at)))
            await self._process(fault, ["redis"])
        else:
            record.resolved = f"link {sel}"
            record.affected = tuple(sorted(self.history.active_at(at)))
            self._link(fault, sel, on=True)
            if fault.kind != "drop":
                self._schedule(record, fault.heal_after, lambda: self._link(fault, sel, False))

    async def _note_journals(self, record: FaultRecord) -> None:
        """Once the fault took effect, how many tokens each affected request had journalled
        (the checker's recovery starts at the next one). Unknown where the store can't be
        read at once: the checker then counts the first token after the fault, as before."""
        now = await self._records()
        record.journalled = {rid: now[rid].output_tokens for rid in record.affected if rid in now}

    def _served_by(self, records: Mapping[str, RequestRecord], names: set[str]) -> tuple[str, ...]:
        hit = {
            rid
            for rid, r in records.items()
            if (r.state in _USING_PREFILL and r.prefill_worker in names)
            or (r.state in _USING_DECODE and r.decode_worker in names)
        }
        return tuple(sorted(hit))

    async def _process(self, fault: PlannedFault, names: list[str]) -> None:
        procs = [self.cluster.procs[n] for n in names]
        if fault.kind in {"kill", "restart"}:
            for p in procs:
                p.signal(signal.SIGKILL)
            for p in procs:
                await asyncio.to_thread(p.popen.wait, 10)
            heal = fault.heal_after if fault.heal_after is not None else 0.5
            if fault.kind == "restart" or fault.heal_after is not None:
                record = self.history.faults[-1]
                self._schedule(record, heal, lambda: None, restart=names)
        elif fault.kind == "continue":
            for p in procs:
                p.signal(signal.SIGCONT)
        elif fault.kind == "stop":
            for p in procs:
                p.signal(signal.SIGSTOP)
            if fault.heal_after is not None:
                record = self.history.faults[-1]

                def cont() -> None:
                    for p in procs:
                        p.signal(signal.SIGCONT)

                self._schedule(record, fault.heal_after, cont)

    def _link(self, fault: PlannedFault, link: str, on: bool) -> None:
        if link == "kv" and self.kv_injector:
            for name in self._alive("prefill-") + self._alive("decode-"):
                self.cluster.procs[name].signal(signal.SIGUSR1 if on else signal.SIGUSR2)
            return
        for proxy in self.proxies.get(link, {}).values():
            if not on:
                proxy.faults.clear()
            elif fault.kind == "delay":
                proxy.faults.delay_s = fault.params["delay_ms"] / 1000
            elif fault.kind == "bandwidth":
                proxy.faults.bytes_per_s = fault.params["bytes_per_s"]
            elif fault.kind == "corrupt":
                proxy.faults.corrupt_p = fault.params["probability"]
            elif fault.kind == "drop":
                proxy.drop()

    # ------------------------------------------------------------------------ healing

    def _schedule(
        self,
        record: FaultRecord,
        after: float | None,
        action: object,
        restart: list[str] | None = None,
    ) -> None:
        if after is None:
            return

        async def heal() -> None:
            await asyncio.sleep(after)
            if restart:
                await asyncio.to_thread(self._restart, restart)
            else:
                action()  # type: ignore[operator]
            record.healed_at = self.now()

        task = asyncio.create_task(heal(), name=f"pdorch-chaos-heal-{record.label()}")
        self._heals.add(task)
        task.add_done_callback(self._heals.discard)

    def _restart(self, names: list[str]) -> None:
        """Start the processes again; healed means back in service (Redis answers, the
        replica serves, the workers' heartbeats are in Redis)."""
        workers = []
        for name in names:
            if name == "redis":
                self.cluster.start_redis(self.cluster.redis_aof)
            elif name.startswith("orchestrator-"):
                self.cluster.start_orchestrator(int(name.rsplit("-", 1)[1]))
            else:
                role, index = name.rsplit("-", 1)
                self.cluster.start_worker(role, int(index))
                workers.append(name)
        if workers:
            self.cluster.wait_registered(workers, self.cluster.ready_timeout_s)

    async def settle(self) -> None:
        """Wait for every scheduled heal (they are short) — or cancel them on shutdown."""
        if self._heals:
            await asyncio.gather(*self._heals, return_exceptions=True)

    async def cancel(self) -> None:
        for task in list(self._heals):
            task.cancel()
        for task in list(self._heals):
            with contextlib.suppress(asyncio.CancelledError):
                await task
