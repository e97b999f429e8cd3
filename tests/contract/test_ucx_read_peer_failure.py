"""One-sided UCX reads have UCX's peer error handling: a read from a peer that was
SIGKILLed fails with an error from UCX itself, with no control link involved. And a channel
failed (`UcxDataPlane.fail_channel`: its transfer failed, or its link closed) issues no read
after: reads still queued for its reader thread fail, their buffers untouched.

Two processes of their own (this module, run with ``target`` or ``reader``): a target that
registers a buffer and says where it is, and a reader that reads it through a `UcxDataPlane`
configured for one-sided reads. Without peer error handling on the reader's endpoint,
libucx aborts the reader when its CMA read finds the target gone; with error handling on but
CMA not eligible (``CMA_MEMORY_INVALIDATE=n`` and rendezvous on: reads emulated over
``tcp/lo``), the first read does not finish in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from transport import errors
from transport.base import Peer
from transport.control import RemoteRegion
from transport.ucx import UcxConfig, UcxDataPlane, ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]

_SIZE = 4 << 20  # over the inline-read size: read in a thread, as large segments are
_ROOT = Path(__file__).resolve().parents[2]
_WAIT_S = 20.0


def _pattern() -> np.ndarray:
    return (np.arange(_SIZE) % 251).astype(np.uint8)


async def _target() -> None:
    plane = UcxDataPlane(UcxConfig(one_sided=True))
    address = await plane.start()
    buf = _pattern()
    rkey, _handle = plane.register(int(buf.ctypes.data), buf.nbytes)
    hello = {"address": address.hex(), "regions": [[int(buf.ctypes.data), buf.nbytes, rkey.hex()]]}
    print(json.dumps(hello), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the test kills this process


async def _connected(
    hello: dict[str, object],
) -> tuple[UcxDataPlane, Peer, list[RemoteRegion]]:
    plane = UcxDataPlane(UcxConfig(one_sided=True))
    await plane.start()
    peer = Peer(b"target", bytes.fromhex(str(hello["address"])))
    raw = hello["regions"]
    assert isinstance(raw, list)
    return plane, peer, [RemoteRegion(int(a), int(n), bytes.fromhex(k), 1) for a, n, k in raw]


async def _reader(hello: dict[str, object]) -> None:
    plane, peer, regions = await _connected(hello)
    into = np.zeros(_SIZE, dtype=np.uint8)
    await asyncio.wait_for(plane.read(peer, regions, memoryview(into)), 10)
    assert np.array_equal(into, _pattern())
    print("read", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the test killed the target
    killed = time.monotonic()
    try:
        for _ in range(200):
            await asyncio.wait_for(plane.read(peer, regions, memoryview(into)), 5)
            await asyncio.sleep(0.01)
    except errors.PeerLostError as exc:
        print(json.dumps({"lost_after_s": time.monotonic() - killed, "error": str(exc)}))
    else:
        print(json.dumps({"lost_after_s": None}))
    finally:
        await plane.close()


_QUEUED = 8
"""Reads queued at once on one channel when it is failed (4 MiB each: the reader thread is
still on the first ones when the channel fails)."""


async def _abandoner(hello: dict[str, object]) -> None:
    """Queue `_QUEUED` reads on one channel, fail the channel, and report each read's
    outcome and whether its buffer was written — checked again after a pause, in which a
    read issued late would have landed."""
    plane, peer, regions = await _connected(hello)
    try:
        first = np.zeros(_SIZE, dtype=np.uint8)
        await asyncio.wait_for(plane.read(peer, regions, memoryview(first)), 10)
        assert np.array_equal(first, _pattern())  # the channel's endpoint is up
        bufs = [np.zeros(_SIZE, dtype=np.uint8) for _ in range(_QUEUED)]
        reads = [asyncio.ensure_future(plane.read(peer, regions, memoryview(b))) for b in bufs]
        await asyncio.sleep(0)  # every read taken to the channel's queue
        plane.fail_channel(peer)
        results = await asyncio.wait_for(asyncio.gather(*reads, return_exceptions=True), 10)
        await asyncio.sleep(0.2)
        out = [
            {
                "error": None if r is None else type(r).__name__,
                "detail": str(r or ""),
                "written": bool(b.any()),
            }
            for r, b in zip(results, bufs, strict=True)
        ]
        print(json.dumps({"reads": out}), flush=True)
    finally:
        await plane.close()


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.contract.test_ucx_read_peer_failure", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=_ROOT,
        env=env,
    )


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout lines, read by a thread ("" once it closed): a hung process
    makes the test fail on a deadline instead of hanging it."""
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    assert stdout is not None

    def pump() -> None:
        for line in stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _line(proc: subprocess.Popen[str], lines: queue.Queue[str], prefix: str) -> str:
    """The next stdout line starting with ``prefix`` (UCX may print its own lines)."""
    deadline = time.monotonic() + _WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:
            raise AssertionError(f"process exited ({proc.wait()}) before {prefix!r}")
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} within {_WAIT_S} s")


def _reap(*procs: subprocess.Popen[str] | None) -> None:
    """Kill what still runs, wait for it and close its pipes."""
    for proc in procs:
        if proc is None:
            continue
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def test_a_read_from_a_killed_peer_fails_with_the_ucx_error() -> None:
    target = _spawn("target")
    reader = None
    try:
        hello = _line(target, _lines(target), "{")
        reader = _spawn("reader", hello)
        assert reader.stdin is not None
        out = _lines(reader)
        _line(reader, out, "read")  # a 4 MiB read completed: not emulated over tcp/lo
        os.kill(target.pid, signal.SIGKILL)
        target.wait(_WAIT_S)
        reader.stdin.write("killed\n")
        reader.stdin.flush()
        result = json.loads(_line(reader, out, "{"))
        assert reader.wait(_WAIT_S) == 0  # not aborted by libucx
        assert result["lost_after_s"] is not None, "reads from a dead peer kept succeeding"
        assert result["lost_after_s"] < 2.0, result
        assert "ucp_get_nbx failed" in result["error"], result
        print(f"UCX reported the killed peer after {result['lost_after_s'] * 1e3:.1f} ms")
    finally:
        _reap(target, reader)


@pytest.mark.slow
def test_a_failed_channel_issues_no_read_after() -> None:
    target = _spawn("target")
    reader = None
    try:
        hello = _line(target, _lines(target), "{")
        reader = _spawn("abandon", hello)
        reads = json.loads(_line(reader, _lines(reader), "{"))["reads"]
        assert reader.wait(_WAIT_S) == 0
        failed = [r for r in reads if r["error"] is not None]
        # The reader thread finishes the read it was issuing (a CMA copy runs inside the
        # call: at most the first one or two); every read still queued fails, unwritten.
        assert len(failed) >= _QUEUED - 2, reads
        for r in failed:
            assert r["error"] == "PeerLostError", r
            assert "abandoned" in r["detail"], r
            assert not r["written"], reads
        for r in reads:
            if r["error"] is None:
                assert r["written"], reads
    finally:
        _reap(target, reader)


if __name__ == "__main__":
    if sys.argv[1] == "target":
        asyncio.run(_target())
    elif sys.argv[1] == "abandon":
        asyncio.run(_abandoner(json.loads(sys.argv[2])))
    else:
        asyncio.run(_reader(json.loads(sys.argv[2])))
