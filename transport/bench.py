"""`pdorch bench transport`: our KV transfer vs ``ucx_perftest -t tag_bw``, in one run.

The receiver runs in its own process (spawned: UCX objects must not cross a fork); this
process is the sender. Each iteration is one KV transfer of ``size`` bytes split into
``layers`` layers, timed from `open` to `finish` — i.e. until the receiver has verified
every layer's checksum and filed the KV, so checksumming both ends is inside the figure.
The reference, ``ucx_perftest`` (shipped in the ``libucx`` wheel), then runs between two
processes for the same message size and iteration count, and the ratio is ours/reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.testing import synthetic_cache

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_UNITS |= {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}


class BenchError(Exception):
    """The benchmark could not run (bad arguments, reference missing or failing)."""


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise BenchError(f"cannot parse size {text!r} (examples: 64MiB, 1GiB, 4096)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise BenchError("size must be positive")
    return size


@dataclass(frozen=True)
class BenchResult:
    backend: str
    size_bytes: int
    iters: int
    layers: int
    ours_gbps: float
    ucx_perftest_gbps: float | None
    ratio: float | None

    def human(self) -> str:
        ref = (
            f"ucx_perftest {self.ucx_perftest_gbps:.2f} GB/s, ratio {self.ratio:.2f}"
            if self.ucx_perftest_gbps and self.ratio is not None
            else "ucx_perftest unavailable"
        )
        return (
            f"{self.backend}: {self.size_bytes / (1 << 20):.1f} MiB x {self.iters} in "
            f"{self.layers} layers: ours {self.ours_gbps:.2f} GB/s, {ref}"
        )

    def json(self) -> str:
        d = asdict(self)
        return json.dumps({k: d[k] for k in _JSON_KEYS} | {"iters": self.iters})


_JSON_KEYS = ("backend", "size_bytes", "ours_gbps", "ucx_perftest_gbps", "ratio")


# ------------------------------------------------------------------------------- ours


async def _receiver_main(backend: str, settings: TransportSettings) -> None:
    receiver = make_receiver(backend, settings)
    print(_ADDRESS_PREFIX, await receiver.start(), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        rid = line.decode().strip()
        cache = await receiver.take(rid, 1, timeout_s=60)
        cache.release()  # as a decode worker does once it has adopted the KV
        print("ok", flush=True)
    await receiver.close()


class _Ours:
    """A receiver process plus a sender here; `round()` times ``iters`` transfers."""

    def __init__(
        self, backend: str, size: int, layers: int, settings: TransportSettings | None = None
    ) -> None:
        self.backend, self.size, self.layers = backend, size, layers
        self.settings = settings or TransportSettings()
        self.cache = synthetic_cache("bench", 1, size, n_layers=layers)
        self.sender = make_sender(backend, self.settings)
        self.count = 0

    async def __aenter__(self) -> _Ours:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "transport.bench",
            self.backend,
            json.dumps(asdict(self.settings)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        self.address = await _read_address(self.proc.stdout)
        await self.round(1)  # warm up: connections, endpoints, pooled buffers
        return self

    async def round(self, iters: int) -> float:
        """GB/s over ``iters`` transfers, each timed from open to verified."""
        proc = self.proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        total = 0.0
        for _ in range(iters):
            self.count += 1
            rid = f"bench-{self.count}"
            header = dataclasses.replace(self.cache.header, request_id=rid)
            started = time.perf_counter()
            async with await self.sender.open(self.address, header) as transfer:
                for n, (k, v) in enumerate(self.cache.layers):
                    await transfer.send_layer(n, k, v)
                await transfer.finish()
            total += time.perf_counter() - started
            proc.stdin.write(rid.encode() + b"\n")
            if (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() != b"ok":
                raise BenchError("benchmark receiver did not confirm a transfer")
        return self.cache.nbytes * iters / total / 1e9

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 10)
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


_ADDRESS_PREFIX = "pdorch-bench-receiver"


async def _read_address(stdout: asyncio.StreamReader) -> str:
    """The receiver's address line (native libraries may print other lines first)."""
    while line := await asyncio.wait_for(stdout.readline(), 60):
        word, _, address = line.decode().strip().partition(" ")
        if word == _ADDRESS_PREFIX:
            return address
    raise BenchError("benchmark receiver failed to start")


def perftest_binary() -> tuple[Path, dict[str, str]] | None:
    """``ucx_perftest`` from the libucx wheel, with the library path it needs."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{root / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    return binary, env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_perftest(size: int, iters: int, timeout_s: float = 120.0) -> float | None:
    """GB/s reported by ucx_perftest tag_bw between two local processes (None if missing)."""
    found = perftest_binary()
    if found is None:
        return None
    binary, env = found
    port = _free_port()
    common = ["-t", "tag_bw", "-s", str(size), "-n", str(iters), "-p", str(port)]
    server = subprocess.Popen(
        [str(binary), *common], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            client = subprocess.run(
                [str(binary), "127.0.0.1", *common],
                env=env,
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
            if client.returncode == 0 or time.monotonic() > deadline - 1:
                break
            if server.poll() is not None:
                raise BenchError(f"ucx_perftest server exited: {client.stderr[-500:]}")
            time.sleep(0.2)  # server not listening yet: retry shortly
        match = re.search(r"^Final:\s+(.*)$", client.stdout, re.MULTILINE)
        if client.returncode != 0 or match is None:
            raise BenchError(f"ucx_perftest failed: {client.stderr[-500:]}")
        # Final: iters, overhead p50/avg/overall (us), bandwidth avg/overall (MiB/s), msg rate
        overall_mib_s = float(match.group(1).split()[5])
        return overall_mib_s * (1 << 20) / 1e9
    finally:
        server.kill()
        server.wait()


async def _interleaved(
    backend: str, size: int, iters: int, layers: int, rounds: int
) -> tuple[list[float], list[float]]:
    ours: list[float] = []
    ref: list[float] = []
    async with _Ours(backend, size, layers) as session:
        for _ in range(rounds):
            ours.append(await session.round(iters))
            got = await asyncio.to_thread(measure_perftest, size, iters)
            if got is not None:
                ref.append(got)
    return ours, ref


def run(backend: str, size: int, iters: int, layers: int = 32, rounds: int = 5) -> BenchResult:
    """Alternate ours and the reference ``rounds`` times; compare the medians (noisy host)."""
    if iters < 1 or layers < 1 or rounds < 1:
        raise BenchError("--iters, --layers and --rounds must be at least 1")
    ours, ref = asyncio.run(_interleaved(backend, size, iters, layers, rounds))
    ours_gbps = statistics.median(ours)
    ref_gbps = statistics.median(ref) if ref else None
    return BenchResult(
        backend=backend,
        size_bytes=size,
        iters=iters,
        layers=layers,
        ours_gbps=round(ours_gbps, 3),
        ucx_perftest_gbps=round(ref_gbps, 3) if ref_gbps else None,
        ratio=round(ours_gbps / ref_gbps, 3) if ref_gbps else None,
    )


async def _finite_check_cost(
    backend: str, size: int, iters: int, layers: int, rounds: int
) -> tuple[list[float], list[float]]:
    """GB/s with the receiver's NaN/inf check on and off, alternating round by round."""
    on: list[float] = []
    off: list[float] = []
    checked = _Ours(backend, size, layers, TransportSettings(check_finite=True))
    unchecked = _Ours(backend, size, layers, TransportSettings(check_finite=False))
    async with checked, unchecked:
        for _ in range(rounds):
            on.append(await checked.round(iters))
            off.append(await unchecked.round(iters))
    return on, off


def finite_check_cost(
    backend: str, size: int, iters: int, layers: int = 32, rounds: int = 5
) -> tuple[float, float]:
    """Median GB/s with the finite check on, and off (two receivers, measured side by side:
    the README's figures come from here)."""
    on, off = asyncio.run(_finite_check_cost(backend, size, iters, layers, rounds))
    return statistics.median(on), statistics.median(off)


if __name__ == "__main__":
    asyncio.run(_receiver_main(sys.argv[1], TransportSettings(**json.loads(sys.argv[2]))))
