"""A scripted `Backend` for the gateway's tests: no orchestrator, no processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from orchestrator import errors
from orchestrator.control.orchestrator import GenerateInput, OutChunk
from orchestrator.core.records import RequestRecord
from orchestrator.core.state import State

Item = OutChunk | errors.PdorchError | Exception


def chunks(words: Sequence[str], finish: str = "eos", prompt_tokens: int = 3) -> list[Item]:
    """One chunk (one token) per word, then the finish with a record."""
    out: list[Item] = [OutChunk("r", i, [100 + i], w) for i, w in enumerate(words)]
    rec = RequestRecord("r", State.DONE, 1, "h", prompt_tokens, 16, 0.0)
    out.append(OutChunk("r", len(words), [], "", finish, record=rec))
    return out


class FakeBackend:
    def __init__(
        self,
        script: Sequence[Item] = (),
        models: Sequence[str] | errors.PdorchError = ("tiny",),
        delay_s: float = 0.0,
    ) -> None:
        self.script = list(script) or chunks(["Hello", ",", " world"])
        self._models = models
        self.delay_s = delay_s
        self.inputs: list[GenerateInput] = []
        self.sent = 0
        self.closed = asyncio.Event()

    def generate(self, inp: GenerateInput) -> AsyncIterator[OutChunk]:
        self.inputs.append(inp)
        return self._run()

    async def _run(self) -> AsyncIterator[OutChunk]:
        try:
            for item in self.script:
                await asyncio.sleep(self.delay_s)
                if isinstance(item, Exception):
                    raise item
                self.sent += 1
                yield item
        finally:
            self.closed.set()

    async def models(self) -> list[str]:
        if isinstance(self._models, errors.PdorchError):
            raise self._models
        return list(self._models)
