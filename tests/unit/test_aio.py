"""`cancel_and_wait` against the asyncio race it exists for, reproduced for real."""

from __future__ import annotations

import asyncio
import sys

import pytest

from orchestrator.aio import cancel_and_wait


async def _racing_loop() -> tuple[asyncio.Task[None], list[int]]:
    """A task looping over a send that completes in the very iteration its cancel lands —
    what redis-py's ``asyncio.wait_for(send)`` meets when a loop is cancelled."""
    sent = asyncio.get_running_loop().create_future()
    ticks: list[int] = []

    async def loop() -> None:
        await asyncio.wait_for(sent, 10)
        while True:
            ticks.append(len(ticks))
            await asyncio.sleep(0.01)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # it now awaits inside wait_for
    sent.set_result(None)  # the send completes...
    task.cancel()  # ...as the cancel lands, in the same iteration
    return task, ticks


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython gh-86296 is fixed in 3.12")
def test_python_3_11_wait_for_loses_a_cancel_landing_as_it_completes() -> None:
    async def main() -> None:
        task, ticks = await _racing_loop()
        await asyncio.sleep(0.1)
        assert not task.done()  # the cancel was dropped: the loop runs on
        assert ticks
        await cancel_and_wait(task)

    asyncio.run(main())


def test_cancel_and_wait_ends_a_task_whose_first_cancel_was_lost() -> None:
    async def main() -> None:
        task, _ = await _racing_loop()
        await asyncio.wait_for(cancel_and_wait(task, retry_s=0.05), 2)
        assert task.cancelled()

    asyncio.run(main())


def test_cancel_and_wait_reraises_what_the_task_failed_with() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def main() -> None:
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="boom"):
            await cancel_and_wait(task)

    asyncio.run(main())
