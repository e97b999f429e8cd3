"""The gateway's `Backend` on the `control.Orchestrator` of this process (no extra hop)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from orchestrator.control.orchestrator import GenerateInput, Orchestrator, OutChunk


class OrchestratorBackend:
    def __init__(self, control: Orchestrator) -> None:
        self.control = control

    def generate(self, inp: GenerateInput) -> AsyncIterator[OutChunk]:
        return self.control.generate(inp)

    async def models(self) -> list[str]:
        """The models named in the live workers' heartbeats."""
        return sorted({w.model for w in await self.control.store.workers()})
