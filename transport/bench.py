"""`pdorch bench transport`: our KV transfer vs NIXL and ``ucx_perftest -t tag_bw``, in one run.

The receiver runs in its own process (spawned: UCX objects must not cross a fork); this
process is the sender. Each iteration is one KV transfer of ``size`` bytes split into
``layers`` layers, timed around `KvSender.send` — until the receiver has verified
every layer's checksum and filed the KV, so checksumming both ends is inside the figure.
The references then run for the same size and iteration count, alternating round by round:
NIXL (`transport.nixl_ref`, when installed: READ and WRITE, one buffer and 32 descriptors)
and ``ucx_perftest`` (shipped in the ``libucx`` wheel) between two processes. With a TLS
directory (`transport.security.load_dir`'s layout, ``prefill`` and ``decode`` identities),
ours also runs with mutual TLS on the control link (``ours-tls``), alternating with plain.
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from transport import control, nixl_ref, security, wire
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.errors import TlsConfigError, TransportError
from transport.security import LinkTls
from transport.testing import apart_in_arena as testing_apart
from transport.testing import paged as testing_paged
from transport.testing import synthetic_cache
from transport.ucx import UcxConfig

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
    """One size: median GB/s of each variant measured, alternating, in the same run."""

    backend: str
    size_bytes: int
    iters: int
    layers: int
    gbps: dict[str, float]
    """Variant → median GB/s (4 significant digits: a 4 KiB transfer is ~0.005 GB/s; its
    latency in µs is what `human` shows). ``ours``: the default path, one contiguous KV;
    ``ours-tls``: the same with mutual TLS on the control link (``--tls-dir``); ``ours-32``:
    32 layers apart in one allocation, as NIXL's 32 descriptors slice one buffer (a block
    list: `testing.apart_in_arena`); ``ours-read``: UCX one-sided reads
    (transport v2, opt-in), ``ours-read-32`` the same of 32 layers apart;
    ``nixl-write``/``nixl-read`` (``-32``: 32 descriptors); ``ucx_perftest``: ``-t
    tag_bw``; ``copy`` and ``xxh3``: one copy and one hash pass of the same bytes in this
    process (`memory_speeds`), what a transfer's memory traffic is made of."""

    def ratio(self, variant: str, reference: str) -> float | None:
        a, b = self.gbps.get(variant), self.gbps.get(reference)
        return round(a / b, 2) if a and b else None

    @property
    def best_nixl(self) -> float | None:
        got = [v for k, v in self.gbps.items() if k.startswith("nixl")]
        return max(got) if got else None

    def human(self) -> str:
        mib = self.size_bytes / (1 << 20)
        parts = [
            f"{name} {g:.2f} GB/s ({self.size_bytes / g / 1e3:.0f} µs)"
            for name, g in self.gbps.items()
        ]
        line = f"{self.backend}: {mib:g} MiB x {self.iters} in {self.layers} layers: "
        best, ours = self.best_nixl, self.gbps.get("ours")
        tail = f"; ours/best NIXL {ours / best:.2f}" if best and ours else ""
        return line + ", ".join(parts) + tail

    def json(self) -> str:
        return json.dumps(asdict(self))


# ------------------------------------------------------------------------------- ours


async def _receiver_main(
    backend: str, settings: TransportSettings, tls: LinkTls | None = None
) -> None:
    receiver = make_receiver(backend, settings, tls=tls)
    print(_ADDRESS_PREFIX, await receiver.start(), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        rid = line.decode().strip()
        try:
            cache = await receiver.take(rid, 1, timeout_s=60)
        except TransportError as exc:
            print(_REPLY_PREFIX, f"{type(exc).__name__}: {exc}", flush=True)
            continue
        cache.release()  # as a decode worker does once it has adopted the KV
        print(_REPLY_PREFIX, "ok", flush=True)
    await receiver.close()


class _Ours:
    """A receiver process plus a sender here; `round()` times ``iters`` transfers."""

    def __init__(
        self,
        backend: str,
        size: int,
        layers: int,
        settings: TransportSettings | None = None,
        *,
        apart: bool = False,
        ucx: UcxConfig | None = None,
        tls_dir: str | None = None,
    ) -> None:
        self.backend, self.size, self.layers = backend, size, layers
        self.tls_dir = tls_dir
        self.settings = settings or TransportSettings()
        self.cache = synthetic_cache("bench", 1, size, n_layers=layers)
        if apart:  # a page between layers: a block list, not one region
            self.cache = testing_apart(self.cache)
        tls = None if tls_dir is None else security.load_dir(tls_dir, "prefill")
        self.sender = make_sender(backend, self.settings, ucx, tls)
        self.count = 0

    async def __aenter__(self) -> _Ours:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "transport.bench",
            self.backend,
            json.dumps(asdict(self.settings)),
            *([] if self.tls_dir is None else [self.tls_dir, "decode"]),
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
            started = time.perf_counter()
            await self.send(rid)
            total += time.perf_counter() - started
            proc.stdin.write(rid.encode() + b"\n")
            if (reply := await _read_reply(proc.stdout)) != "ok":
                raise BenchError(f"benchmark receiver did not confirm a transfer: {reply}")
        return self.cache.nbytes * iters / total / 1e9

    async def send(self, rid: str) -> None:
        """One transfer, as a prefill worker sends its KV: the whole of it at once."""
        header = dataclasses.replace(self.cache.header, request_id=rid)
        await self.sender.send(self.address, dataclasses.replace(self.cache, header=header))

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 10)
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


class _Paged(_Ours):
    """Ours as vLLM's connector sends (`ours-read-paged`): layer by layer as the forward
    produces them, a segment each, each K and V in pieces of `PAGED_PIECE_BYTES`
    scattered over a cache registered once (`Registry.register_region`)."""

    def __init__(self, size: int, layers: int) -> None:
        per_layer = TransportSettings(segment_bytes=control.MIN_SEGMENT_BYTES)  # the connector's
        super().__init__(UCX_READ, size, layers, per_layer)
        self.paged = testing_paged(self.cache, PAGED_PIECE_BYTES)
        self.region: object = None

    async def send(self, rid: str) -> None:
        sender = self.sender
        if self.region is None:
            await sender.start()
            pool = self.paged.pool
            self.region = sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        header = dataclasses.replace(self.paged.header, request_id=rid)
        async with await sender.open(self.address, header) as transfer:
            for i, (k, v) in enumerate(self.paged.layers):
                await transfer.send_layer(i, k, v)
            await transfer.finish()


PAGED_PIECE_BYTES = 32 << 10
"""`ours-read-paged`'s piece: one head of one 128-token block of SmolLM2-135M's fp32 KV in
vLLM's CPU cache (128 tokens × 64 dims × 4 bytes)."""

_ADDRESS_PREFIX = "pdorch-bench-receiver"
_REPLY_PREFIX = "pdorch-bench-reply"


async def _read_reply(stdout: asyncio.StreamReader) -> str:
    """The receiver's reply line (native libraries may print other lines first)."""
    while line := await asyncio.wait_for(stdout.readline(), 60):
        word, _, reply = line.decode().strip().partition(" ")
        if word == _REPLY_PREFIX:
            return reply
    return "the receiver exited"


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


VARIANTS = (
    "ours",
    "ours-tls",
    "ours-32",
    "ours-read",
    "ours-read-32",
    "ours-read-paged",
    "nixl",
    "ucx_perftest",
    "memory",
)
"""What `run`'s ``only`` may name: ours' variants, and the references (``nixl``: its four
modes; ``memory``: ``copy`` and ``xxh3``)."""


def _variants(only: Sequence[str] | None) -> frozenset[str]:
    if only is None:
        return frozenset(VARIANTS)
    unknown = sorted(set(only) - set(VARIANTS))
    if unknown or not only:
        raise BenchError(
            f"--only names {', '.join(unknown) or 'nothing'}; choose from {', '.join(VARIANTS)}"
        )
    return frozenset(only)


async def _interleaved(
    backend: str,
    size: int,
    iters: int,
    layers: int,
    rounds: int,
    nixl: bool,
    tls_dir: str | None = None,
    only: frozenset[str] = frozenset(VARIANTS),
) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {}
    makers: dict[str, Callable[[], _Ours]] = {"ours": lambda: _Ours(backend, size, layers)}
    if tls_dir is not None:  # right after plain ours, round by round
        makers["ours-tls"] = lambda: _Ours(backend, size, layers, tls_dir=tls_dir)
    makers["ours-32"] = lambda: _Ours(backend, size, 32, apart=True)
    if backend == "ucx":
        makers["ours-read"] = lambda: _Ours(UCX_READ, size, layers)
        makers["ours-read-32"] = lambda: _Ours(UCX_READ, size, 32, apart=True)
        makers["ours-read-paged"] = lambda: _Paged(size, 32)
    ours = {name: make() for name, make in makers.items() if name in only}
    with_nixl = nixl and "nixl" in only
    nixl_modes = [("WRITE", 1), ("READ", 1), ("WRITE", 32), ("READ", 32)] if with_nixl else []
    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)  # pages in
    async with contextlib.AsyncExitStack() as stack:
        for session in ours.values():
            await stack.enter_async_context(session)
        for _ in range(rounds):
            for name, session in ours.items():
                got.setdefault(name, []).append(await session.round(iters))
            for op, descs in nixl_modes:
                name = f"nixl-{op.lower()}" + ("-32" if descs > 1 else "")
                try:
                    seconds = await asyncio.to_thread(nixl_ref.measure, size, iters, op, descs)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    raise BenchError(str(exc)) from exc
                got.setdefault(name, []).append(size / seconds / 1e9)
            if "ucx_perftest" in only:
                ref = await asyncio.to_thread(measure_perftest, size, iters)
                if ref is not None:
                    got.setdefault("ucx_perftest", []).append(ref)
            if "memory" in only:
                copy, xxh3 = memory_speeds(src, dst, iters)
                got.setdefault("copy", []).append(copy)
                got.setdefault("xxh3", []).append(xxh3)
    return got


def memory_speeds(src: np.ndarray, dst: np.ndarray, iters: int) -> tuple[float, float]:
    """GB/s of copying ``src`` into ``dst`` and of one checksum pass (`wire.checksum`) over
    ``src``, ``iters`` times each, in this process on one core. Every transfer makes one copy
    (the CMA read, or the socket's) and two hash passes (sender and receiver): where those
    bytes leave the cache, the memory's bandwidth bounds the transfer (README, "Transport
    performance")."""
    if src.nbytes != dst.nbytes or not src.nbytes:
        raise BenchError("memory_speeds needs two buffers of the same, non-zero size")
    started = time.perf_counter()
    for _ in range(iters):
        np.copyto(dst, src)
    copied = time.perf_counter() - started
    view = src.reshape(-1).view(np.uint8).data
    started = time.perf_counter()
    for _ in range(iters):
        wire.checksum(view)
    hashed = time.perf_counter() - started
    return src.nbytes * iters / copied / 1e9, src.nbytes * iters / hashed / 1e9


def medians(got: dict[str, list[float]]) -> dict[str, float]:
    """Median GB/s per variant, to 4 significant digits (a 4 KiB transfer's ~0.005 GB/s
    must not round to 0: its latency is the fixed cost this benchmark shows)."""
    return {k: float(f"{statistics.median(v):.4g}") for k, v in got.items()}


def run(
    backend: str,
    size: int,
    iters: int,
    layers: int = 32,
    rounds: int = 5,
    nixl: bool | None = None,
    tls_dir: str | None = None,
    only: Sequence[str] | None = None,
) -> BenchResult:
    """Alternate ours (its variants) and the references ``rounds`` times; compare medians
    (noisy host). NIXL joins when importable unless ``nixl`` is False; with ``tls_dir``,
    ours over mutual TLS too (``ours-tls``). ``only`` (`VARIANTS`) times just those: two
    processes and nothing else between transfers, for a before/after of one path."""
    if iters < 1 or layers < 1 or rounds < 1:
        raise BenchError("--iters, --layers and --rounds must be at least 1")
    if layers > wire.MAX_LAYERS:
        raise BenchError(f"--layers {layers}: at most {wire.MAX_LAYERS} (the wire header's limit)")
    if size < 8 * layers:  # a float32 K and V per layer, else the KV sent is not `size`
        raise BenchError(f"size {size} B is under 8 bytes per layer ({layers} layers)")
    chosen = _variants(only)
    if "ours-tls" in chosen and only is not None and tls_dir is None:
        raise BenchError("--only ours-tls needs --tls-dir")
    one_sided = {"ours-read", "ours-read-32", "ours-read-paged"}
    if chosen & one_sided and only is not None and backend != "ucx":
        raise BenchError(f"{', '.join(sorted(chosen & one_sided))}: one-sided, --backend ucx")
    with_nixl = nixl_ref.nixl_available() if nixl is None else nixl
    if with_nixl and "nixl" in chosen and not nixl_ref.nixl_available():
        raise BenchError("NIXL is not installed (`make nixl` installs nixl-cu12)")
    try:
        got = asyncio.run(
            _interleaved(backend, size, iters, layers, rounds, with_nixl, tls_dir, chosen)
        )
    except TlsConfigError as exc:
        raise BenchError(str(exc)) from exc
    except MemoryError:  # numpy's _ArrayMemoryError is one
        raise BenchError(f"size {size} B: cannot allocate the KV buffers") from None
    return BenchResult(
        backend=backend,
        size_bytes=size,
        iters=iters,
        layers=layers,
        gbps=medians(got),
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
    _tls = security.load_dir(sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else None
    asyncio.run(_receiver_main(sys.argv[1], TransportSettings(**json.loads(sys.argv[2])), _tls))
