"""The control plane's facade: one object the fronts (rpc, gateway, cli) call.

`Orchestrator` wires the modules that each do one job and delegates to them:

    sessions   generate / follow / cancel / get: client calls, detach grace  (sessions.py)
    intake     validate, tokenize, admit, create idempotently                 (intake.py)
    failover   the drive loop: attempts, reassignment, retryability          (failover.py)
    dispatch   one attempt's worker legs and their transitions              (dispatch.py)
    relay      tokens to the client, journalled first; the request's end     (relay.py, journal.py)
    legs       the calls to workers, watched by heartbeat                    (legs.py)
    ledger     load, queues, rates, breakers; placement and admission        (ledger.py)
    directory  the live workers, one listing shared by admission and watches (directory.py)
    ownership  takeover and deadline reapers, resume from the journal        (ownership.py)
    leases     leases on the requests driven here                            (leases.py)

It also re-exports the names the fronts use (`GenerateInput`, `OutChunk`, `ControlSettings`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Collection

from orchestrator.control.clients import WorkerClients
from orchestrator.control.directory import WorkerDirectory
from orchestrator.control.dispatch import Dispatch
from orchestrator.control.failover import Failover
from orchestrator.control.intake import Intake
from orchestrator.control.journal import JournalWriter
from orchestrator.control.leases import LeaseKeeper
from orchestrator.control.ledger import Ledger
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.local import Local
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.ownership import Ownership
from orchestrator.control.relay import Relay
from orchestrator.control.run import OutChunk
from orchestrator.control.sessions import Sessions, Sink
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import RequestRecord
from orchestrator.core.spec import GenerateInput
from orchestrator.core.state import State
from orchestrator.store.base import Store

__all__ = ["ControlSettings", "GenerateInput", "Orchestrator", "OutChunk", "Sink"]


class Orchestrator:
    def __init__(
        self,
        store: Store,
        clients: WorkerClients,
        settings: ControlSettings,
        owner: str,
        metrics: ControlMetrics | None = None,
    ) -> None:
        self.store = store
        self.clients = clients
        self.settings = settings
        self.owner = owner
        self.metrics = metrics
        self.local = Local()
        self.ledger = Ledger(settings)
        self.directory = WorkerDirectory(store, settings.workers_cache_s)
        self.legs = WorkerLegs(clients, settings, self.directory.alive)
        writer = JournalWriter(store, store.settings.outage_s, settings.journal_gather_ms / 1000)
        self.relay = Relay(store, settings, writer, metrics)
        self.leases = LeaseKeeper(store, self.local, owner)
        dispatch = Dispatch(store, self.legs, self.ledger, settings, metrics)
        self.failover = Failover(
            store, settings, self.ledger, dispatch, self.relay, self.leases, self.local, metrics
        )
        self.ownership = Ownership(
            store, settings, self.local, self.failover, self.relay, self.legs, owner
        )
        intake = Intake(store, settings, self.legs, self.ledger, metrics, owner, self.directory)
        self.sessions = Sessions(store, settings, intake, self.failover, self.local, metrics)

    def generate(
        self, inp: GenerateInput, sink: Sink | None = None
    ) -> AsyncGenerator[OutChunk, None]:
        return self.sessions.generate(inp, sink)

    def follow(self, rid: str, start: int = 0) -> AsyncGenerator[OutChunk, None]:
        """Stream a request this call does not drive, from its journal (resubmit, resume)."""
        return self.sessions.follow(rid, start)

    async def cancel(self, rid: str, tenants: Collection[str] | None = None) -> State:
        """Cancel ``rid``; with ``tenants`` (the caller's), another tenant's is NotFound."""
        return await self.sessions.cancel(rid, tenants)

    async def get(self, rid: str, tenants: Collection[str] | None = None) -> RequestRecord:
        """The record of ``rid``; with ``tenants`` (the caller's), another tenant's is
        NotFound, answered as an unknown id is."""
        return await self.sessions.get(rid, tenants)

    async def start(self) -> None:
        """Start the reaper that takes over requests whose owner's lease expired."""
        self.ownership.start()

    async def stop(self) -> None:
        """Stop reaping and hand every request this replica drives to the others (their
        leases are released, so a peer takes each over at once, epoch + 1)."""
        self.local.stopping = True
        await self.ownership.stop()
        await self.local.stop()
        await self.leases.stop()  # hand-offs above keep their leases till done
        await self.relay.writer.close()  # last: the runs above settle their journals
