"""Executes planned faults on a local cluster: signals, restarts, link faults.

Process faults are signals to real processes (SIGKILL, SIGSTOP/SIGCONT) and restarts through
`LocalCluster`. Link faults go to the fault proxies on TCP paths, or — for the KV link over
UCX, where no TCP proxy can sit — to the transport's fault-injecting wrapper inside every
worker: the runner writes the KV faults active now (each independent: healing one leaves
the others on) to the cluster's KV fault file and SIGUSR1 makes the workers re-read it.

Each fault is recorded with the request streams it hit: those served at that moment by the
worker, pool or replica it targets, or every active stream for Redis and link faults. The
request records come from a `RecordWatcher` that reads them all along, so a fault is never
held up by reads: it fires first, from the latest reading (its age is recorded). A fault
with a trigger (``when``) waits for its phase from the same readings — or, for ``sending``,
for a worker's KV fault injector to announce a layer held at its gate — and is aimed at the
worker of the request that fired it. Every fault's lateness (executed after it was due) is
recorded, and flagged over the scenario's bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from orchestrator.aio import cancel_and_wait
from orchestrator.chaos.history import FaultRecord, History
from orchestrator.chaos.pace import LoopPace
from orchestrator.chaos.proxy import FaultProxy
from orchestrator.chaos.redis_primary import PrimaryKill
from orchestrator.chaos.scenario import REDIS_PRIMARY, PlannedFault, Trigger, kv_fault_spec
from orchestrator.cluster import LocalCluster
from orchestrator.core.records import RequestRecord
from orchestrator.core.state import State
from orchestrator.errors import PdorchError
from orchestrator.store.ha_servers import LocalRedisCluster
from orchestrator.store.redis_store import RedisStore
from orchestrator.store.server import RedisServerError

log = logging.getLogger(__name__)

_USING_PREFILL = frozenset({State.PREFILLING, State.TRANSFERRING})
_USING_DECODE = frozenset({State.TRANSFERRING, State.DECODING})
_WATCH_POLL_S = 0.05
"""How often the watcher reads the run's active request records (one GET each)."""
_GATE_POLL_S = 0.02
"""How often a ``sending`` trigger looks for a gate's announcement (a local file)."""
_REAP_S = 10.0
"""A SIGKILLed process not reaped by then: the fault could not be injected (reported)."""
DROP_WINDOW_S = 0.2
"""A KV ``drop`` through the injector without ``heal_after``: transfers sending a layer in
this window fail (the TCP proxy's drop resets the connections open at that moment)."""


def _held_at(marker: Path) -> float | None:
    """When a worker's KV fault injector last held a layer at its gate (wall clock; a tiny
    local file the worker writes), or None."""
    try:
        return float(marker.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class RecordWatcher:
    """Reads this run's active request records all along; `latest` is the last reading."""

    def __init__(self, store: RedisStore, history: History, now: object) -> None:
        self.store = store
        self.history = history
        self._now = now
        self.records: dict[str, RequestRecord] = {}
        self.taken_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._fresh = asyncio.Event()

    def now(self) -> float:
        return float(self._now())  # type: ignore[operator]

    async def read(self) -> dict[str, RequestRecord]:
        """Records of this run's active requests (empty if the store can't be read now)."""
        active = self.history.active_at(self.now())

        async def get(rid: str) -> tuple[str, RequestRecord | None]:
            try:
                return rid, await asyncio.wait_for(self.store.get(rid), 1.0)
            except (PdorchError, TimeoutError):
                return rid, None

        pairs = await asyncio.gather(*(get(rid) for rid in sorted(active)))
        return {rid: rec for rid, rec in pairs if rec is not None and not rec.state.terminal}

    async def _loop(self) -> None:
        while True:
            started = self.now()
            self.records = await self.read()
            self.taken_at = started
            self._fresh.set()
            await asyncio.sleep(_WATCH_POLL_S)  # polling the store; no notifications

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="pdorch-chaos-record-watcher")

    async def next(self) -> dict[str, RequestRecord]:
        """The next reading (for triggers, which wait anyway)."""
        self.start()
        self._fresh.clear()
        await self._fresh.wait()
        return self.records

    def latest(self) -> tuple[dict[str, RequestRecord], float | None]:
        """The last reading and its age in seconds (None: none yet)."""
        self.start()
        age = None if self.taken_at is None else round(self.now() - self.taken_at, 4)
        return self.records, age

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None


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
        late_bound_s: float = 0.5,
        kv_file: Path | None = None,
        redis_cluster: LocalRedisCluster | None = None,
    ) -> None:
        """``kv_injector``: KV-link faults go to the workers' injector (else to the proxies);
        ``kv_file``: the workers' KV fault file (None: no injector in the workers, e.g. vLLM);
        ``redis_cluster``: the Redis Cluster the runner started (``redis:primary`` faults)."""
        self.cluster = cluster
        self.redis_cluster = redis_cluster
        self.store = store
        self.history = history
        self.proxies = proxies
        self.kv_injector = kv_injector
        self.kv_file = kv_file
        self.late_bound_s = late_bound_s
        self._now = now
        self._rng = random.Random(seed)  # noqa: S311 - reproducible chaos, not secrets
        self._heals: set[asyncio.Task[None]] = set()
        self.watcher = RecordWatcher(store, history, now)
        self.pace = LoopPace(self.now)
        """The runner's loop and CPU time, sampled: why a late fault was late."""
        self._kv_active: dict[int, tuple[str, Mapping[str, float]]] = {}
        """KV-link faults on now through the injector (by fault record id)."""
        self._gate: int | None = None
        self._fired_by = ""
        """The request whose held transfer fired a ``sending`` trigger (it is hit even
        before its record names a worker in a state `_served_by` counts)."""
        self._restarting: set[str] = set()
        """Processes being started again (no signal until their handlers are installed)."""

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
        return await self.watcher.read()

    def _pick(self, role: str, selector: str, load: Mapping[str, int]) -> str | None:
        """The target among the live processes of ``role``; chosen (busiest, random) never
        one a heal is starting again — it serves nothing yet, and a signal mid-start fails
        its heal. A named one is returned as it is (`_process` refuses it if so)."""
        alive = self._alive(f"{role}-")
        if selector not in {"", "busiest", "random"}:
            return selector if selector in alive else None
        alive = [n for n in alive if n not in self._restarting]
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

    def _streams(self) -> int:
        """This run's active streams: a token received, the request not ended."""
        streaming: set[str] = set()
        for op in self.history.ops:
            if op.type == "chunk" and op.tokens:
                streaming.add(op.request)
            elif op.type in {"ok", "fail"}:
                streaming.discard(op.request)
        return len(streaming)

    async def _triggered(
        self, role: str, selector: str, when: Trigger
    ) -> tuple[str, str, float] | None:
        """Wait for the trigger: (the worker it picked — "" for none —, a description, the
        time it was seen), or None if not met within ``when.within_s``."""
        if when.state == "sending":
            return await self._gated(role, selector, when)
        deadline = time.monotonic() + when.within_s
        since: dict[str, float] = {}
        """Request id -> when the readings first saw it in the state (and still do)."""
        while True:
            records = await self.watcher.next() if when.state else {}
            now = time.monotonic()
            enough = self._streams() >= when.streams
            if enough and not when.state:
                return "", f"{self._streams()} streams active", self.now()
            seen = {rid for rid, r in records.items() if str(r.state) == when.state}
            since = {rid: since.get(rid, now) for rid in seen}
            for rid, r in sorted(records.items()):
                worker = r.prefill_worker if role == "prefill" else r.decode_worker
                named = selector in {"", "busiest", "random"} or worker == selector
                if (
                    enough
                    and rid in seen
                    and now - since[rid] >= when.after_s
                    and r.output_tokens >= when.tokens
                    and worker
                    and named
                    and worker in self._alive(f"{role}-")
                ):
                    why = f"{rid} {when.state} on {worker} ({r.output_tokens} tokens)"
                    return worker, why, self.now()
            if time.monotonic() > deadline:
                return None
            if not when.state:
                await asyncio.sleep(_WATCH_POLL_S)  # the client history: no store reads

    async def _gated(
        self, role: str, selector: str, when: Trigger
    ) -> tuple[str, str, float] | None:
        """``sending``: hold layer ``when.layer`` of every KV transfer at the prefill
        workers' gate, and wait until one announces a held layer (of a transfer to the named
        worker, for a named selector)."""
        if self.kv_file is None:
            raise PdorchError("the trigger state sending needs the workers' KV fault injector")
        armed_wall = time.time()
        self._gate = when.layer
        self._write_kv()
        deadline = time.monotonic() + when.within_s
        try:
            while time.monotonic() <= deadline:
                enough = self._streams() >= when.streams
                for sender in self._alive("prefill-") if enough else []:
                    held_wall = _held_at(Path(f"{self.kv_file}.held.{sender}"))
                    if held_wall is None or held_wall < armed_wall:
                        continue
                    seen = self.now() - max(0.0, time.time() - held_wall)
                    records, _ = self.watcher.latest()
                    if role == "decode":  # the receiver is in the record: read it now
                        records = await self._records()
                        seen = self.now()
                    picked = self._gate_target(role, selector, sender, records)
                    if picked is not None:
                        worker, rid = picked
                        self._fired_by = rid
                        why = f"{rid or '?'} sending {sender} -> layer {when.layer} held"
                        return worker, why, seen
                await asyncio.sleep(_GATE_POLL_S)  # a local file; no notifications
            return None
        finally:
            self._gate = None  # opened once the fault fired (or the wait is over)

    def _gate_target(
        self, role: str, selector: str, sender: str, records: Mapping[str, RequestRecord]
    ) -> tuple[str, str] | None:
        """The worker to hit for a transfer held at ``sender``'s gate, and the request (from
        ``records``: one prefilling on ``sender``; "" if the reading has none)."""
        mine = sorted(
            (rid, r)
            for rid, r in records.items()
            if r.state == State.PREFILLING and r.prefill_worker == sender
        )
        if role == "prefill":
            if selector not in {"", "busiest", "random"} and sender != selector:
                return None
            return sender, mine[0][0] if mine else ""
        for rid, r in mine:
            named = selector in {"", "busiest", "random"} or r.decode_worker == selector
            if r.decode_worker and named and r.decode_worker in self._alive("decode-"):
                return r.decode_worker, rid
        return None

    async def inject(self, fault: PlannedFault, due: float | None = None) -> FaultRecord:
        """Execute ``fault`` (due at ``due``: its time, or later when it waited for heals)."""
        head, _, sel = fault.target.partition(":")
        due = fault.at if due is None else due
        chosen = trigger = ""
        if fault.when is not None:
            problem = ""
            try:
                fired = await self._triggered(head, sel, fault.when)
            except (PdorchError, OSError) as exc:  # e.g. the gate's file can't be written
                fired, problem = None, f"trigger failed: {type(exc).__name__}: {exc}"
            if fired is None:
                if fault.when.state == "sending":
                    with contextlib.suppress(OSError):
                        self._write_kv()  # the gate opens
                record = FaultRecord(self.now(), fault.kind, fault.target, "", (),
                                     wall_at=time.time(), planned_at=fault.at)  # fmt: skip
                record.error = problem or f"trigger not met within {fault.when.within_s}s: " + (
                    f"no request {fault.when.state} on a {head} worker"
                    if fault.when.state
                    else f"fewer than {fault.when.streams} streams active"
                )
                self.history.faults.append(record)
                return record
            chosen, trigger, due = fired
        records, age = self.watcher.latest()
        record = FaultRecord(self.now(), fault.kind, fault.target, "", (), wall_at=time.time(),
                             planned_at=fault.at, records_age_s=age)  # fmt: skip
        record.late_s = round(max(0.0, record.at - due), 4)
        record.late = record.late_s > self.late_bound_s
        if record.late:
            record.late_cpu_share = self.pace.cpu_share(due)
        record.trigger = trigger
        self.history.faults.append(record)
        try:
            await self._apply(fault, record, records, chosen)
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            log.exception("fault %s failed", fault.label())
            record.error = f"{type(exc).__name__}: {exc}"
        else:
            if self._fired_by:
                record.affected = tuple(sorted({*record.affected, self._fired_by}))
            # A reading is up to a poll old: a stream its client saw end before the fault
            # was not hit by it.
            live = self.history.active_at(record.at)
            record.affected = tuple(rid for rid in record.affected if rid in live)
        finally:
            self._fired_by = ""
            if fault.when is not None and fault.when.state == "sending":
                self._write_kv()  # the gate opens
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
            await self._note_journals(record, {name})
        elif head == "pool":
            names = self._alive(f"{sel}-")
            record.resolved = ",".join(names) or f"{sel} pool already down"
            record.affected = self._served_by(records, set(names))
            await self._process(fault, names)
            await self._note_journals(record, set(names))
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
            await self._redis(fault, record)
        else:
            record.resolved = f"link {sel}"
            record.affected = tuple(sorted(self.history.active_at(at)))
            key = id(record)
            self._link(fault, sel, key, on=True)
            heal = fault.heal_after
            if fault.kind == "drop" and sel == "kv" and self.kv_injector:
                heal = DROP_WINDOW_S if heal is None else heal
            elif fault.kind == "drop":
                heal = None  # the proxy's drop is one reset of the connections open now
            self._schedule(record, heal, lambda: self._link(fault, sel, key, on=False))

    async def _redis(self, fault: PlannedFault, record: FaultRecord) -> None:
        """The cluster's redis-server (every active stream is hit), or a Redis Cluster's
        primary (`_primary`)."""
        if fault.target == REDIS_PRIMARY:
            await self._primary(fault, record)
            return
        record.resolved = "redis"
        record.affected = tuple(sorted(self.history.active_at(record.at)))
        await self._process(fault, ["redis"])

    async def _primary(self, fault: PlannedFault, record: FaultRecord) -> None:
        """``redis:primary``: SIGKILL the primary holding the most live records (the affected
        streams: those whose records it held), then follow the promotion of its replica and,
        with a heal, start it again as a replica (healed: rejoined and synced)."""
        if self.redis_cluster is None:
            raise PdorchError("redis:primary needs a Redis Cluster started by the runner")
        kill = PrimaryKill(self.redis_cluster)
        live = self.history.active_at(record.at)
        killed = await asyncio.to_thread(kill.kill, live)
        record.resolved = killed.describe(len(live))
        record.affected = killed.affected

        async def follow() -> None:
            try:
                await kill.promoted(killed)
            except RedisServerError as exc:  # reported in the history, not fatal to the run
                record.outcome = f"no promotion: {type(exc).__name__}: {exc}"
                record.error = record.outcome
                return
            record.promoted_at = self.now()
            record.outcome = (
                f"replica :{killed.replica.port if killed.replica else '?'} promoted "
                f"{record.promoted_at - record.at:.2f} s after the kill"
            )
            if fault.kind == "restart" or fault.heal_after is not None:
                heal = fault.heal_after if fault.heal_after is not None else 0.5
                await asyncio.sleep(max(0.0, record.at + heal - self.now()))
                try:
                    await kill.rejoin()
                except Exception as exc:  # noqa: BLE001 - not healed: the verdict says it
                    _not_healed(record, exc)
                    return
                record.healed_at = self.now()

        task = asyncio.create_task(follow(), name=f"pdorch-chaos-failover-{record.label()}")
        self._heals.add(task)
        task.add_done_callback(self._heals.discard)

    async def _note_journals(self, record: FaultRecord, names: set[str]) -> None:
        """Once the fault took effect: the streams it hit, from a reading taken now as well
        (the one it fired from may be a poll old, and a failover takes longer than a read),
        and how many tokens each had journalled (the checker's recovery starts at the next
        one). Unknown where the store can't be read at once: the checker then counts the
        first token after the fault, as before."""
        now = await self._records()
        record.affected = tuple(sorted({*record.affected, *self._served_by(now, names)}))
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
        if starting := sorted(set(names) & self._restarting):
            # Signalled mid-start it would die (or stall) before it serves, and fail the
            # heal: the plan cannot be carried out as written (the verdict says so).
            raise PdorchError(
                f"{', '.join(starting)} being started again by an earlier fault's heal "
                "(a fault on it should wait: after_healed)"
            )
        procs = [self.cluster.procs[n] for n in names]
        if fault.kind in {"kill", "restart"}:
            for p in procs:
                p.signal(signal.SIGKILL)
            for name, p in zip(names, procs, strict=True):
                try:
                    await asyncio.to_thread(p.popen.wait, _REAP_S)
                except subprocess.TimeoutExpired:
                    raise PdorchError(
                        f"{name} (pid {p.popen.pid}) not reaped within {_REAP_S:g} s of SIGKILL"
                    ) from None
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

    def _link(self, fault: PlannedFault, link: str, key: int, on: bool) -> None:
        """Switch one link fault on or off (``key``: its record; the others stay as they are)."""
        if link == "kv" and self.kv_injector:
            if on:
                self._kv_active[key] = (fault.kind, fault.params)
            else:
                self._kv_active.pop(key, None)
            self._write_kv()
            return
        for proxy in self.proxies.get(link, {}).values():
            if not on:
                if fault.kind == "delay":
                    proxy.faults.delay_s = 0.0
                elif fault.kind == "bandwidth":
                    proxy.faults.bytes_per_s = 0.0
                elif fault.kind == "corrupt":
                    proxy.faults.corrupt_p = 0.0
            elif fault.kind == "delay":
                proxy.faults.delay_s = fault.params["delay_ms"] / 1000
            elif fault.kind == "bandwidth":
                proxy.faults.bytes_per_s = fault.params["bytes_per_s"]
            elif fault.kind == "corrupt":
                proxy.faults.corrupt_p = fault.params["probability"]
            elif fault.kind == "drop":
                proxy.drop()

    def _write_kv(self) -> None:
        """The workers' KV fault file := the KV faults on now (and a trigger's gate); SIGUSR1
        makes every running worker re-read it (a worker starting reads it itself)."""
        if self.kv_file is None:
            return
        self.kv_file.write_text(kv_fault_spec(self._kv_active.values(), self._gate))
        for name in self._alive("prefill-") + self._alive("decode-"):
            if name not in self._restarting:  # (one still importing would die of it)
                self.cluster.procs[name].signal(signal.SIGUSR1)

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
            try:
                if restart:
                    await asyncio.to_thread(self._restart, restart)
                else:
                    action()  # type: ignore[operator]
            except Exception as exc:  # noqa: BLE001 - the run's verdict says it, not a crash
                _not_healed(record, exc)
                return
            record.healed_at = self.now()

        task = asyncio.create_task(heal(), name=f"pdorch-chaos-heal-{record.label()}")
        self._heals.add(task)
        task.add_done_callback(self._heals.discard)

    def _restart(self, names: list[str]) -> None:
        """Start the processes again; healed means back in service (Redis answers, the
        replica serves, the workers' heartbeats are in Redis)."""
        self._restarting.update(names)
        try:
            self._start_again(names)
        finally:
            self._restarting.difference_update(names)

    def _start_again(self, names: list[str]) -> None:
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

    def start(self) -> None:
        """Read the request records and sample the loop's pace all along."""
        self.watcher.start()
        self.pace.start()

    async def cancel(self) -> None:
        """Stop the sampler, the watcher and the heals in flight — each of them whatever
        the others do (the watcher's stop re-raises what failed its task)."""
        await self.pace.stop()
        try:
            await self.watcher.stop()
        finally:
            for task in list(self._heals):
                task.cancel()
            for task in list(self._heals):
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def _not_healed(record: FaultRecord, exc: Exception) -> None:
    """A heal that failed: said on its fault, so the run's verdict counts it (`fault_errors`:
    the run did not carry out its plan) instead of an exception nobody retrieves."""
    log.warning("heal of fault %s failed: %r", record.label(), exc)
    record.error = f"heal failed: {type(exc).__name__}: {exc}"
