"""Ownership across replicas: taking over requests whose owner died, and deadlines.

Every replica runs one reaper task. Each ``reap_interval_s`` it lists the live requests,
reads their lease holders in one round trip, and takes over (``take_over``: epoch + 1, the
lease now ours) every request whose owner's lease lapsed — a crashed or stalled replica, or
one that handed its requests off while draining. A request taken over is resumed from its
journal (`_resume`): its spec is rebuilt from the record, the journalled tokens are the
output so far, and the drive loop continues it; its clients follow the journal. KV the old
owner's attempt left on its decode worker (received, never adopted: the owner died between
prefill and decode) is released at once (`release_stale`), not after the worker's hold lease.

Every ``deadline_scan_s`` the reaper also fails (``expire``) any live request that sat in its
state past that state's deadline (`orchestrator.core.deadlines`), whoever drives it — the
backstop for a stuck request no lease can detect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from orchestrator import errors
from orchestrator.aio import cancel_and_wait
from orchestrator.control.failover import Failover
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.local import Local
from orchestrator.control.relay import Relay
from orchestrator.control.run import Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core.deadlines import overdue
from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo
from orchestrator.core.scheduler import Mode
from orchestrator.core.spec import RequestSpec
from orchestrator.core.state import Edge
from orchestrator.store.base import Store

log = logging.getLogger(__name__)


class Ownership:
    def __init__(
        self,
        store: Store,
        settings: ControlSettings,
        local: Local,
        failover: Failover,
        relay: Relay,
        legs: WorkerLegs,
        owner: str,
    ) -> None:
        self.store = store
        self.settings = settings
        self.local = local
        self.failover = failover
        self.relay = relay
        self.legs = legs
        self.owner = owner
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap(), name="pdorch-takeover-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)

    async def _reap(self) -> None:
        scanned = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            if time.monotonic() - scanned >= self.settings.deadline_scan_s:
                scanned = time.monotonic()
                try:
                    await self.enforce_deadlines()
                except errors.UnavailableError as exc:
                    log.warning("deadline scan skipped: %s", exc)
                except Exception:
                    log.exception("deadline scan failed")
            try:
                await self.take_over_lapsed()
            except errors.UnavailableError as exc:
                log.warning("takeover scan skipped: %s", exc)
            except Exception:
                log.exception("takeover scan failed")

    async def take_over_lapsed(self) -> None:
        """Take over every live request whose owner's lease lapsed, and resume it here."""
        rids = [rid for rid in await self.store.active() if not self.local.busy(rid)]
        # One read for all: only requests whose owner's lease lapsed are tried
        # (take_over checks again, atomically).
        holders = await self.store.lease_holders(rids)
        for rid, holder in zip(rids, holders, strict=True):
            if holder is not None:
                continue
            epoch = await self.store.take_over(rid, self.owner)
            if epoch is not None:
                self.local.spawn(self._resume(rid, epoch), f"pdorch-resume-{rid}")

    async def enforce_deadlines(self) -> None:
        """Fail every live request that sat in its state past the state's deadline, whoever
        drives it (one CAS per request: one that moved meanwhile is left alone)."""
        rids = await self.store.active()
        if not rids:
            return
        now = await self.store.now_ms()
        for rid, (state, epoch, updated) in (await self.store.progress(rids)).items():
            reason = overdue(state, float(updated), now, self.settings.deadlines)
            if reason is None:
                continue
            if await self.store.expire(rid, state, epoch, updated, reason):
                log.warning("request %s: failed by the reaper: %s", rid, reason)
                # Stuck here: stop it (its end is recorded already); its clients get why.
                self.local.stop_driving(rid, errors.RequestFailedError(f"request failed: {reason}"))

    async def _resume(self, rid: str, epoch: int) -> None:
        """Finish a request taken over from a dead replica, from its journal."""
        self.local.resuming.add(rid)
        try:
            record = await self.store.get(rid)
            if record is None or not record.prompt_ids:
                return
            workers = await self.store.workers()
            self.release_stale(record, epoch, workers)
            entries = await self.store.journal(rid)
            run = Run(RequestSpec.from_record(record), epoch, time.monotonic())
            run.output = [t for e in entries for t in e.token_ids]
            run.held = entries[-1].held if entries else ""  # not given out yet
            run.timings = dict(record.timings)
            log.warning(
                "request %s: taken over at epoch %d from token %d", rid, epoch, len(run.output)
            )
            finished = entries[-1].finish if entries else ""
            if finished or len(run.output) >= record.max_tokens:
                # The old owner journalled the request's end (a stop string, EOS) or every
                # token, then lost its lease before recording it: record it — generating
                # on would go past the end its clients were told.
                if run.held:  # every token in, its text held for a stop string: the end's
                    tail = JournalEntry(len(run.output), (), run.held, finish="length")
                    await self.store.append(rid, epoch, tail)
                    run.held = ""
                await self.relay.finish(run, Edge.FINISH, finished or "length", "")
                return
            async for _ in self.failover.drive(run, workers):
                pass  # clients follow the journal
        except errors.UnavailableError as exc:
            # Redis went away mid-takeover (e.g. still loading its AOF): give the lease back
            # so the next reaper pass — here or on a peer — retries now, not after its TTL.
            log.warning("request %s: resume interrupted: %s", rid, exc)
            with contextlib.suppress(errors.PdorchError):
                await self.store.release_lease(rid, self.owner)
        except (errors.PdorchError, asyncio.CancelledError) as exc:
            log.warning("request %s: resumed run ended: %r", rid, exc)
        finally:
            self.local.resuming.discard(rid)

    def release_stale(self, record: RequestRecord, epoch: int, workers: list[WorkerInfo]) -> None:
        """Tell the decode worker of the attempt taken over (at ``epoch`` - 1) to drop KV it
        holds for it and never adopted: freed now, not after its hold lease (30 s by
        default); the worker also refuses that epoch from now on, so a late transfer of the
        old attempt can't land. In the background: a dead worker costs the resume nothing."""
        if record.mode != Mode.DISAGGREGATED or not record.decode_worker:
            return
        rid = record.request_id
        for w in workers:
            if w.worker_id == record.decode_worker and w.role == "decode":
                log.info("request %s: releasing epoch %d's KV on %s", rid, epoch - 1, w.worker_id)
                self.local.spawn(
                    self.legs.release(w, rid, epoch - 1), f"pdorch-release-{rid}-{epoch - 1}"
                )
