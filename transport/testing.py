"""Conformance suite every transport backend passes, a peer process, and fault injection.

Run from ``tests/contract``: each ``check_*`` coroutine takes a backend name, starts the other
end of the transfer as a separate process (`PeerProcess`, driven by JSON lines over its
stdin/stdout) and raises AssertionError on a violation. The local end runs in the caller's
event loop, so the test sees typed errors and timings first-hand.

`FaultInjector` is the fault-injecting wrapper: attached to a `KvSender`, it corrupts, stalls
or delays a chosen layer's payload *after* its checksum was taken, slows or drops every layer,
or holds one at a gate, for any backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np

from transport import control, errors, kvcodec, security, wire
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.receiver import KvReceiver
from transport.security import LinkTls
from transport.sender import KvSender

FINGERPRINT = "conformance-model"
KIB, MIB = 1 << 10, 1 << 20


# ------------------------------------------------------------------------ synthetic caches


def synthetic_layers(size: int, n_layers: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n_layers`` (K, V) float32 pairs adding up to about ``size`` bytes, cheap to fill."""
    per_tensor = max(1, size // (2 * n_layers * 4))
    # One block for all layers, K then V per layer, as the reference engine lays out a
    # prefill's KV: runs of consecutive layers then travel as single zero-copy messages.
    bits = np.arange(2 * per_tensor * n_layers, dtype=np.uint32)
    bits *= 2654435761
    bits += seed
    bits &= 0xBFFF_FFFF  # exponent's top bit clear: finite values (|x| < 2), as real KV is
    block = bits.view(np.float32).reshape(n_layers, 2, 1, per_tensor, 1)
    layers = [(block[i, 0], block[i, 1]) for i in range(n_layers)]
    return layers


def synthetic_cache(
    request_id: str, epoch: int, size: int, n_layers: int = 4, seed: int = 0
) -> wire.KvCache:
    layers = synthetic_layers(size, n_layers, seed)
    header = wire.header_for(request_id, epoch, FINGERPRINT, wire.DType.FLOAT32, layers)
    return wire.KvCache(header, tuple(layers))


def apart(cache: wire.KvCache) -> wire.KvCache:
    """The same KV with each layer's K and V in an allocation of its own (a block list)."""
    layers = []
    for k, v in cache.layers:
        block = np.empty(k.nbytes + v.nbytes, dtype=np.uint8)
        kk = block[: k.nbytes].view(k.dtype).reshape(k.shape)
        vv = block[k.nbytes :].view(v.dtype).reshape(v.shape)
        kk[...], vv[...] = k, v
        layers.append((kk, vv))
    return wire.KvCache(cache.header, tuple(layers))


APART_GAP = 4096
"""Bytes left between two layers `apart_in_arena`: none touches the next, none joins its read."""


def apart_in_arena(cache: wire.KvCache) -> wire.KvCache:
    """The same KV with each layer's K and V apart (a block list: one region per layer),
    in one allocation with a page between layers — as NIXL's 32-descriptor reference
    slices one buffer (`pdorch bench transport`'s ``ours-32``), so both get the same pages
    (numpy arrays of 4 MiB or more get transparent huge pages here; 32 allocations of
    their own would not at 1–64 MiB) and one registration."""
    sizes = [k.nbytes + v.nbytes for k, v in cache.layers]
    arena = np.empty(sum(sizes) + APART_GAP * len(sizes), dtype=np.uint8)
    layers = []
    at = 0
    for (k, v), size in zip(cache.layers, sizes, strict=True):
        block = arena[at : at + size]
        kk = block[: k.nbytes].view(k.dtype).reshape(k.shape)
        vv = block[k.nbytes :].view(v.dtype).reshape(v.shape)
        kk[...], vv[...] = k, v
        layers.append((kk, vv))
        at += size + APART_GAP
    return wire.KvCache(cache.header, tuple(layers))


@dataclass(frozen=True, slots=True)
class Paged:
    """A KV scattered in pieces over one pool, as a paged engine holds it (vLLM's blocks):
    per layer, K's pieces and V's pieces in wire order (`OutgoingTransfer.send_layer`)."""

    header: wire.KvHeader
    pool: np.ndarray
    layers: list[tuple[list[memoryview], list[memoryview]]]


def paged(cache: wire.KvCache, piece_bytes: int, seed: int = 0) -> Paged:
    """``cache``'s bytes cut into pieces of ``piece_bytes`` (a tensor's last one shorter),
    each copied to the start of its own slot of twice that size, slots in random order: no
    two pieces touch (none merges into one read), as the blocks of a long-running engine's
    cache do not."""
    tensors = [t for k, v in cache.layers for t in (wire.as_bytes_view(k), wire.as_bytes_view(v))]
    counts = [max(1, math.ceil(t.nbytes / piece_bytes)) for t in tensors]
    slot = 2 * piece_bytes
    slots = np.random.default_rng(seed).permutation(sum(counts))
    pool = np.zeros(sum(counts) * slot, dtype=np.uint8)
    out: list[list[memoryview]] = []
    taken = 0
    for t, n in zip(tensors, counts, strict=True):
        pieces = []
        for i in range(n):
            chunk = t[i * piece_bytes : (i + 1) * piece_bytes]
            at = int(slots[taken]) * slot
            taken += 1
            pool[at : at + chunk.nbytes] = np.frombuffer(chunk, dtype=np.uint8)
            pieces.append(pool[at : at + chunk.nbytes].data)
        out.append(pieces)
    return Paged(cache.header, pool, [(out[i], out[i + 1]) for i in range(0, len(out), 2)])


def scaled_cache(request_id: str, epoch: int, size: int, n_layers: int = 4) -> wire.KvCache:
    """About ``size`` bytes of fp8 KV with per-head scales (format version 2)."""
    per_tensor = max(1, size // (2 * n_layers))
    heads = 4 if per_tensor >= 4 else 1
    rng = np.random.default_rng(epoch)
    layers = [
        tuple(rng.standard_normal((heads, per_tensor // heads, 1), np.float32) for _ in "kv")
        for _ in range(n_layers)
    ]
    pairs = [(k, v) for k, v in layers]
    return kvcodec.encode_cache(
        request_id, epoch, FINGERPRINT, pairs, wire.DType.FLOAT32, wire.DType.FLOAT8_E4M3
    )


def digest(cache: wire.KvCache) -> int:
    """Checksum of every tensor of ``cache``, and of its scales if any."""
    tensors = [t for k, v in cache.layers for t in (k, v)]
    tensors += [s for pair in cache.scales for s in pair]
    return wire.checksum(*(wire.as_bytes_view(t) for t in tensors))


# ------------------------------------------------------------------------ fault injection


@dataclass
class FaultInjector:
    """Faults on the KV link, applied to each layer on its way out of a sender.

    Faults at one layer (``layer``), drawn per transfer with ``probability`` (seeded, so a
    chaos run repeats): ``corrupt_offset`` flips one byte *after* the checksum was taken;
    ``delay_s`` stalls the sending process (blocking: a hung prefill worker);
    ``link_delay_s`` holds the layer back without blocking.

    Faults on every layer (a degraded link; each is independent of the others):
    ``lag_s`` holds each layer back this long (the sender awaits it, so a transfer of L
    layers is late by up to L × ``lag_s``); ``bytes_per_s`` paces each layer to this rate;
    ``drop`` fails each layer's send with `PeerLostError` (a link that is down: the transfer
    fails, the sender aborts it).

    ``hold_s`` at ``hold_layer`` is a gate for phase-triggered chaos: the layer waits
    (without blocking) and ``on_hold`` is told, so a fault can land while the transfer is
    in flight — its header accepted, the layers before ``hold_layer`` sent, the rest not.

    ``armed`` switches the whole injector on and off at run time (the worker CLI maps
    SIGUSR1/SIGUSR2 onto it).
    """

    layer: int = 0
    corrupt_offset: int | None = None
    delay_s: float = 0.0
    link_delay_s: float = 0.0
    probability: float = 1.0
    lag_s: float = 0.0
    bytes_per_s: float = 0.0
    """0: unlimited."""
    drop: bool = False
    hold_layer: int = 0
    hold_s: float = 0.0
    armed: bool = True
    seed: int = 0
    hits: int = 0
    on_hold: Callable[[int], None] | None = field(default=None, repr=False)
    """Called (with the layer index) when a layer starts waiting at the gate."""
    _rng: random.Random = field(init=False, repr=False)
    _last_hit: int = field(default=-1, init=False, repr=False)
    _last_bytes: int = field(default=0, init=False, repr=False)

    SPEC_KEYS: ClassVar[dict[str, str]] = {
        "layer": "layer",
        "corrupt": "corrupt_offset",
        "stall": "delay_s",
        "delay": "link_delay_s",
        "p": "probability",
        "lag": "lag_s",
        "bw": "bytes_per_s",
        "drop": "drop",
        "hold_layer": "hold_layer",
        "hold": "hold_s",
        "seed": "seed",
        "armed": "armed",
    }
    """``parse``'s keys → fields."""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)  # noqa: S311 - reproducible faults, not secrets

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        """From ``key=value,...`` — keys: layer, corrupt (byte offset), stall (s), delay (s),
        p (probability), lag (s, every layer), bw (bytes/s, every layer), drop (0/1),
        hold_layer, hold (s), seed, armed (0/1). Raises ValueError naming the bad key."""
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in cls.SPEC_KEYS:
                raise ValueError(f"fault spec {spec!r}: unknown item {item!r}")
            try:
                number = float(raw)
            except ValueError:
                raise ValueError(f"fault spec {spec!r}: {key} needs a number") from None
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"fault spec {spec!r}: {key} must be finite and >= 0")
            if key in {"layer", "corrupt", "seed", "hold_layer"}:
                values[cls.SPEC_KEYS[key]] = int(number)
            elif key in {"armed", "drop"}:
                values[cls.SPEC_KEYS[key]] = bool(number)
            else:
                values[cls.SPEC_KEYS[key]] = number
        injector = cls(**values)
        if injector.probability > 1.0:
            raise ValueError(f"fault spec {spec!r}: p must be in [0, 1]")
        return injector

    def configure(self, other: FaultInjector) -> None:
        """Take ``other``'s faults (all of them: a fault ``other`` lacks is switched off)."""
        self.layer, self.corrupt_offset = other.layer, other.corrupt_offset
        self.delay_s, self.link_delay_s = other.delay_s, other.link_delay_s
        self.probability, self.seed = other.probability, other.seed
        self.lag_s, self.bytes_per_s, self.drop = other.lag_s, other.bytes_per_s, other.drop
        self.hold_layer, self.hold_s = other.hold_layer, other.hold_s
        self._rng = random.Random(self.seed)  # noqa: S311 - reproducible faults, not secrets

    def attach(self, sender: KvSender) -> None:
        sender.payload_hook = self._hook
        sender.delay_hook = self._delay
        sender.layered_hook = self._layered

    def _layered(self) -> bool:
        """Whether a timing fault is on (stall, delay, lag, pace, drop, gate): they act
        between layers, so the sender sends layer by layer (no eager KV); a corruption
        alone reaches an eager KV's bytes too."""
        if not self.armed:
            return False
        timing = (self.delay_s, self.link_delay_s, self.lag_s, self.bytes_per_s, self.hold_s)
        return self.drop or any(t > 0 for t in timing)

    def _hits(self, index: int) -> bool:
        if index != self.layer or not self.armed:
            return False
        hit = self.probability >= 1.0 or self._rng.random() < self.probability
        self.hits += hit
        return hit

    def _delay(self, index: int) -> float:
        """Seconds the layer just given to `_hook` waits before it leaves (awaited)."""
        if not self.armed:
            return 0.0
        held = self.link_delay_s if self._last_hit == index else 0.0
        held += self.lag_s
        if self.bytes_per_s > 0:
            held += self._last_bytes / self.bytes_per_s
        if self.hold_s > 0 and index == self.hold_layer:
            held += self.hold_s
            if self.on_hold is not None:
                self.on_hold(index)
        return held

    def _hook(self, index: int, k: memoryview, v: memoryview) -> tuple[memoryview, memoryview]:
        # The sender calls this, then `_delay`, for the same layer with no await between.
        self._last_bytes = k.nbytes + v.nbytes
        if self.drop and self.armed:
            self.hits += 1
            raise errors.PeerLostError(f"fault injection: the KV link is down (layer {index})")
        self._last_hit = index if self._hits(index) else -1
        if self._last_hit != index:
            return k, v
        if self.delay_s:
            time.sleep(self.delay_s)  # blocking on purpose: a stalled sender
        if self.corrupt_offset is None:
            return k, v
        both = bytearray(k) + bytearray(v)
        both[self.corrupt_offset % len(both)] ^= 0xFF
        mv = memoryview(both)
        return mv[: len(k)], mv[len(k) :]


# ------------------------------------------------------------------------ TLS


@dataclass(frozen=True)
class TlsFiles:
    """Certificates for a TLS run of a check: ``folder`` in `security.load_dir`'s layout
    (``ca.pem``, ``<identity>.pem``, ``<identity>.key``); this process speaks as ``local``,
    the peer process as ``peer``."""

    folder: str
    local: str = "prefill"
    peer: str = "decode"

    def load(self, identity: str) -> LinkTls:
        return security.load_dir(self.folder, identity)


def _local_tls(tls: TlsFiles | None) -> LinkTls | None:
    return None if tls is None else tls.load(tls.local)


# ------------------------------------------------------------------------ peer process


class PeerProcess:
    """The other end of a transfer, in its own process; commands and replies are JSON lines.
    It runs on the caller's kind of event loop (uvloop when the caller's is uvloop's)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def start(
        cls, backend: str, settings: TransportSettings, tls: TlsFiles | None = None
    ) -> PeerProcess:
        tls_args = [] if tls is None else [tls.folder, tls.peer]
        loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "transport.testing",
            "uvloop" if loop == "uvloop" else "asyncio",
            backend,
            json.dumps(asdict(settings)),
            *tls_args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    def command(self, **command: Any) -> None:
        """Send a command without waiting for its reply (read it with `reply`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")

    async def call(self, timeout_s: float = 30.0, **command: Any) -> dict[str, Any]:
        self.command(**command)
        return await self.reply(timeout_s)

    async def reply(self, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:  # native libraries may print lines of their own: skip them
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            if not line:
                raise AssertionError(f"peer process {self.pid} exited ({self.proc.returncode})")
            if line.startswith(b"{"):
                reply: dict[str, Any] = json.loads(line)
                return reply

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            await self.proc.wait()
        await self._close_pipes()

    async def _close_pipes(self) -> None:
        """Its pipes closed, and their transports' ends run, before the caller's loop may
        end: uvloop's `wait` returns on the exit alone, and a loop closed while a pipe's
        close is still pending fails (``EBUSY``) and leaks the pipes' transports into the
        next test's warnings (met in CI: `test_basic_conformance_over_tls[uvloop-ucx]`)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(self.proc.stdin.wait_closed(), 5)
        if self.proc.stdout is not None:
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(self.proc.stdout.read(), 5)  # to its EOF
        await asyncio.sleep(0)  # the transports' connection_lost callbacks


@contextlib.asynccontextmanager
async def peer(
    backend: str, settings: TransportSettings, tls: TlsFiles | None = None
) -> AsyncIterator[PeerProcess]:
    p = await PeerProcess.start(backend, settings, tls)
    try:
        yield p
    finally:
        await p.stop()


async def _peer_main(backend: str, settings: TransportSettings, tls: LinkTls | None = None) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    receiver: KvReceiver | None = None
    sender: KvSender | None = None

    def out(**reply: Any) -> None:
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()

    while line := await reader.readline():
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "listen":
                receiver = make_receiver(backend, settings, tls=tls)
                out(address=await receiver.start(port=cmd.get("port", 0)))
            elif op == "take":
                assert receiver is not None
                started = time.monotonic()
                try:
                    cache = await receiver.take(cmd["rid"], cmd["epoch"], cmd["timeout"])
                except errors.TransportError as exc:
                    out(ok=False, error=type(exc).__name__, elapsed=time.monotonic() - started)
                else:
                    out(ok=True, digest=digest(cache), nbytes=cache.nbytes)
            elif op == "stats":
                assert receiver is not None
                out(bytes_in_use=receiver.inbox.bytes_in_use)
            elif op == "send":
                sender = sender or make_sender(backend, settings, tls=tls)
                cache = synthetic_cache(cmd["rid"], cmd["epoch"], cmd["size"], cmd["layers"])
                try:
                    async with await sender.open(cmd["address"], cache.header) as transfer:
                        for i, (k, v) in enumerate(cache.layers):
                            await transfer.send_layer(i, k, v)
                            out(event="layer", index=i)
                            await asyncio.sleep(cmd.get("layer_delay_s", 0.0))
                        await transfer.finish()
                except errors.TransportError as exc:
                    out(ok=False, error=type(exc).__name__)
                else:
                    out(ok=True, digest=digest(cache))
            else:
                out(ok=False, error=f"unknown op {op}")
        except Exception as exc:  # noqa: BLE001 - the harness reports every failure to the test
            out(ok=False, error=f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------ the suite

SIZES = (1 * KIB, 1 * MIB, 16 * MIB, 256 * MIB)


async def check_sizes(
    backend: str, sizes: tuple[int, ...] = SIZES, tls: TlsFiles | None = None
) -> None:
    """Local sender → peer receiver: every size arrives intact."""
    settings = TransportSettings()
    async with peer(backend, settings, tls) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings, tls=_local_tls(tls))
        try:
            for n, size in enumerate(sizes):
                cache = synthetic_cache(f"size-{n}", 1, size, n_layers=8, seed=n)
                await sender.send(address, cache)
                got = await p.call(op="take", rid=f"size-{n}", epoch=1, timeout=30)
                assert got == {"ok": True, "digest": digest(cache), "nbytes": cache.nbytes}, got
                del cache
        finally:
            await sender.close()
        assert (await p.call(op="stats"))["bytes_in_use"] == 0


async def check_concurrent(backend: str, transfers: int = 32) -> None:
    """``transfers`` concurrent transfers between one pair, all intact."""
    settings = TransportSettings()
    async with peer(backend, settings) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings)
        caches = [synthetic_cache(f"c{i}", 1, 256 * KIB, seed=i) for i in range(transfers)]
        try:
            await asyncio.gather(*(sender.send(address, c) for c in caches))
        finally:
            await sender.close()
        for c in caches:
            got = await p.call(op="take", rid=c.header.request_id, epoch=1, timeout=10)
            assert got.get("digest") == digest(c), got


@contextlib.asynccontextmanager
async def _peer_sending(
    backend: str, settings: TransportSettings, rid: str, size: int, layers: int, delay_s: float
) -> AsyncIterator[tuple[KvReceiver, PeerProcess]]:
    """A local receiver and a peer process that has sent the first of ``layers`` layers of
    request ``rid`` to it and pauses ``delay_s`` between layers: a transfer mid-way."""
    receiver = make_receiver(backend, settings)
    address = await receiver.start()
    try:
        async with peer(backend, settings) as p:
            p.command(
                op="send",
                address=address,
                rid=rid,
                epoch=1,
                size=size,
                layers=layers,
                layer_delay_s=delay_s,
            )
            assert (await p.reply())["event"] == "layer"
            yield receiver, p
    finally:
        await receiver.close()


async def check_sender_killed(backend: str) -> None:
    """Peer sender SIGKILLed mid-transfer: the local receiver errs within 2 s, frees memory."""
    settings = TransportSettings(idle_timeout_s=10.0)
    async with _peer_sending(backend, settings, "k", 32 * MIB, 8, 0.5) as (receiver, p):
        assert receiver.inbox.bytes_in_use > 0
        p.signal(signal.SIGKILL)
        killed = time.monotonic()
        try:
            await receiver.take("k", 1, timeout_s=10)
        except errors.PeerLostError:
            pass
        else:
            raise AssertionError("a half-sent KV was handed over")
        assert time.monotonic() - killed < 2.0, time.monotonic() - killed
        assert receiver.inbox.bytes_in_use == 0


async def check_receiver_killed(backend: str) -> None:
    """Peer receiver SIGKILLed mid-transfer: the local sender errs within 2 s."""
    settings = TransportSettings(idle_timeout_s=10.0)
    async with peer(backend, settings) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings)
        cache = synthetic_cache("rk", 1, 64 * MIB, n_layers=16)
        try:
            with contextlib.suppress(errors.PeerLostError):  # either step may see it
                async with await sender.open(address, cache.header) as transfer:
                    await transfer.send_layer(0, *cache.layers[0])
                    p.signal(signal.SIGKILL)
                    killed = time.monotonic()
                    for i, (k, v) in enumerate(cache.layers[1:], start=1):
                        await transfer.send_layer(i, k, v)
                    await transfer.finish()
                raise AssertionError("transfer to a killed receiver reported success")
            assert time.monotonic() - killed < 2.0, time.monotonic() - killed
        finally:
            await sender.close()


async def check_receiver_killed_small(backend: str) -> None:
    """A small KV sent whole (one-sided: inline in one message, eager) to a peer receiver
    that stopped, then was SIGKILLed before it answered: the sender errs within 2 s."""
    settings = TransportSettings(idle_timeout_s=10.0)
    async with peer(backend, settings) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings)
        try:
            await sender.send(address, synthetic_cache("w", 1, 4 * KIB))  # a pooled link
            assert (await p.call(op="take", rid="w", epoch=1, timeout=5))["ok"]
            p.signal(signal.SIGSTOP)
            send = asyncio.create_task(sender.send(address, synthetic_cache("rs", 1, 4 * KIB)))
            done, _ = await asyncio.wait({send}, timeout=0.2)  # stopped: it cannot answer
            assert not done, "a stopped receiver answered"
            p.signal(signal.SIGKILL)
            killed = time.monotonic()
            try:
                await asyncio.wait_for(send, 10)
            except errors.PeerLostError:
                pass
            else:
                raise AssertionError("transfer to a killed receiver reported success")
            assert time.monotonic() - killed < 2.0, time.monotonic() - killed
        finally:
            await sender.close()


async def check_stalled_receiver(backend: str) -> None:
    """Peer receiver SIGSTOPped mid-transfer: the sender's deadline fires."""
    settings = TransportSettings(idle_timeout_s=1.0)
    async with peer(backend, settings) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings)
        cache = synthetic_cache("st", 1, 64 * MIB, n_layers=4)
        started = 0.0
        try:
            async with await sender.open(address, cache.header) as transfer:
                p.signal(signal.SIGSTOP)
                started = time.monotonic()
                for i, (k, v) in enumerate(cache.layers):
                    await transfer.send_layer(i, k, v)
                await transfer.finish()
            raise AssertionError("transfer to a stopped receiver reported success")
        except errors.TransferTimeoutError:
            assert time.monotonic() - started < 5.0
        finally:
            p.signal(signal.SIGCONT)
            await sender.close()


async def check_stalled_sender(backend: str) -> None:
    """Peer sender SIGSTOPped mid-transfer: the local receiver's deadline fires, memory freed."""
    settings = TransportSettings(idle_timeout_s=1.0)
    async with _peer_sending(backend, settings, "ss", 4 * MIB, 4, 0.3) as (receiver, p):
        p.signal(signal.SIGSTOP)
        try:
            await receiver.take("ss", 1, timeout_s=10)
        except errors.TransferTimeoutError:
            pass
        else:
            raise AssertionError("a stalled transfer was handed over")
        assert receiver.inbox.bytes_in_use == 0


async def check_corruption(backend: str) -> None:
    """One flipped payload byte: both ends see ChecksumMismatchError; nothing is handed over
    — in large KVs (one-sided: 1 MiB read and verified on the receiver's loop, 4 MiB read
    and verified in its reader thread; 16 MiB past every eager bound, so ``ucx`` and ``tcp``
    move it layer by layer and one-sided summed while it is read) and in a small one
    (one-sided: inline in its OPEN, eager). A failed transfer's payload buffer never goes
    back to the receiver's pool (a read still landing in it would write into a buffer
    handed to another transfer)."""
    settings = TransportSettings()
    receiver = make_receiver(backend, settings)
    address = await receiver.start()
    sender = make_sender(backend, settings)
    FaultInjector(layer=2, corrupt_offset=12345).attach(sender)
    try:
        sizes = (
            ("bad", 1 * MIB),
            ("bad-large", 4 * MIB),
            ("bad-16", 16 * MIB),
            ("bad-small", 16 * KIB),
        )
        for rid, size in sizes:
            pooled = receiver.buffers.idle_bytes
            try:
                await sender.send(address, synthetic_cache(rid, 1, size, n_layers=4))
            except errors.ChecksumMismatchError:
                pass
            else:
                raise AssertionError(f"corrupted transfer of {size} bytes reported success")
            try:
                await receiver.take(rid, 1, timeout_s=5)
            except errors.ChecksumMismatchError:
                pass
            else:
                raise AssertionError(f"a corrupted KV of {size} bytes was handed over")
            assert receiver.inbox.bytes_in_use == 0
            if size > control.EAGER_BYTES:  # (an eager OPEN's body goes back, copied out)
                assert receiver.buffers.idle_bytes <= pooled, "a failed payload was pooled"
        sender.payload_hook = None  # the link recovers: the next transfer goes through
        await sender.send(address, synthetic_cache("good", 1, 1 * MIB))
        assert digest(await receiver.take("good", 1, 5)) == digest(synthetic_cache("good", 1, MIB))
    finally:
        await sender.close()
        await receiver.close()


async def check_stale_epoch(backend: str) -> None:
    """An epoch older than one seen for the request is refused before any payload moves."""
    settings = TransportSettings()
    async with peer(backend, settings) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings)
        try:
            await sender.send(address, synthetic_cache("e", 3, 64 * KIB))
            try:
                await sender.open(address, synthetic_cache("e", 2, 64 * KIB).header)
            except errors.StaleEpochError:
                pass
            else:
                raise AssertionError("stale epoch accepted")
            try:  # a small KV in one message (one-sided: inline, eager) is fenced as well
                await sender.send(address, synthetic_cache("e", 2, 4 * KIB))
            except errors.StaleEpochError:
                pass
            else:
                raise AssertionError("stale epoch of a small KV accepted")
            assert (await p.call(op="take", rid="e", epoch=3, timeout=5))["ok"]
            assert (await p.call(op="take", rid="e", epoch=2, timeout=1))["error"] == (
                "StaleEpochError"
            )
        finally:
            await sender.close()


async def check_peer_restart(backend: str) -> None:
    """After the receiver restarts on the same address, the next transfer reconnects."""
    settings = TransportSettings()
    sender = make_sender(backend, settings)
    try:
        async with peer(backend, settings) as p:
            address = (await p.call(op="listen"))["address"]
            await sender.send(address, synthetic_cache("a", 1, 1 * MIB))
            assert (await p.call(op="take", rid="a", epoch=1, timeout=5))["ok"]
        port = int(address.rpartition(":")[2])
        async with peer(backend, settings) as p2:
            assert (await p2.call(op="listen", port=port))["address"] == address
            await sender.send(address, synthetic_cache("b", 1, 1 * MIB))
            assert (await p2.call(op="take", rid="b", epoch=1, timeout=5))["ok"]
    finally:
        await sender.close()


async def check_scaled(backend: str, sizes: tuple[int, ...] = (1 * KIB, 16 * MIB)) -> None:
    """fp8 KV with per-head scales (format version 2) arrives intact, scales included."""
    settings = TransportSettings()
    async with peer(backend, settings) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings)
        try:
            for n, size in enumerate(sizes):
                cache = scaled_cache(f"fp8-{n}", n + 1, size, n_layers=8)
                assert cache.header.scales is wire.ScaleLayout.PER_HEAD_F32
                await sender.send(address, cache)
                got = await p.call(op="take", rid=f"fp8-{n}", epoch=n + 1, timeout=30)
                assert got == {"ok": True, "digest": digest(cache), "nbytes": cache.nbytes}, got
        finally:
            await sender.close()
        assert (await p.call(op="stats"))["bytes_in_use"] == 0


async def check_replay(backend: str, tls: TlsFiles | None = None) -> None:
    """A transfer replayed after its KV was taken is refused, and cannot be taken again."""
    settings = TransportSettings()
    async with peer(backend, settings, tls) as p:
        address = (await p.call(op="listen"))["address"]
        sender = make_sender(backend, settings, tls=_local_tls(tls))
        cache = synthetic_cache("rp", 4, 256 * KIB)
        try:
            await sender.send(address, cache)
            assert (await p.call(op="take", rid="rp", epoch=4, timeout=5))["ok"]
            try:
                await sender.send(address, cache)
            except errors.StaleEpochError:
                pass
            else:
                raise AssertionError("a replayed transfer was accepted after its KV was taken")
            got = await p.call(op="take", rid="rp", epoch=4, timeout=30)
            assert got["error"] == "StaleEpochError", got
            assert got["elapsed"] < 5, got  # refused at once, not after the take's timeout
            await sender.send(address, synthetic_cache("rp", 5, 256 * KIB))  # the next epoch
            assert (await p.call(op="take", rid="rp", epoch=5, timeout=5))["ok"]
        finally:
            await sender.close()
        assert (await p.call(op="stats"))["bytes_in_use"] == 0


async def _say_hello(
    address: str, data_address: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw control connection that says HELLO (with ``data_address``: none, as a tcp
    sender's), reads the receiver's, and then nothing."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(control.hello(os.urandom(control.INSTANCE_ID_BYTES), data_address))
    head = await asyncio.wait_for(reader.readexactly(control.HEAD_SIZE), 5)
    kind, length = control.decode_head(head)
    await asyncio.wait_for(reader.readexactly(length), 5)
    assert kind is control.Kind.HELLO, kind
    return reader, writer


async def _closed_by_peer(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Whether the receiver closes (or resets) the connection within ``timeout_s``."""
    try:
        return await asyncio.wait_for(reader.read(1), timeout_s) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def check_idle_connections(backend: str) -> None:
    """Connections that say HELLO and then nothing are closed after ``connection_idle_s``;
    a sender's pooled link that outlives it is replaced without a failed transfer."""
    settings = TransportSettings(connection_idle_s=0.5)
    async with peer(backend, settings) as p:
        address = (await p.call(op="listen"))["address"]
        conns = [await _say_hello(address) for _ in range(20)]
        started = time.monotonic()
        try:
            closed = await asyncio.gather(*(_closed_by_peer(r, 10.0) for r, _ in conns))
            assert all(closed), f"{closed.count(False)} of 20 idle connections left open"
            assert time.monotonic() - started < 5.0
        finally:
            for _, w in conns:
                w.close()
        sender = make_sender(backend, settings)
        try:
            await sender.send(address, synthetic_cache("idle-1", 1, 64 * KIB))
            await asyncio.sleep(1.0)  # the pooled link idles past the receiver's timeout
            await sender.send(address, synthetic_cache("idle-2", 1, 64 * KIB))
            for rid in ("idle-1", "idle-2"):
                assert (await p.call(op="take", rid=rid, epoch=1, timeout=5))["ok"]
        finally:
            await sender.close()


async def finish_then_refill(
    sender: KvSender,
    receiver: KvReceiver,
    address: str,
    transfers: Sequence[Any],
    caches: Sequence[wire.KvCache],
) -> None:
    """A cap test's end: the open ``transfers`` (of the first ``caches``) finish, the last
    cache — refused while they held every slot — now goes through, and every cache lands
    whole at ``receiver``."""
    for transfer, cache in zip(transfers, caches, strict=False):
        for i, (k, v) in enumerate(cache.layers):
            await transfer.send_layer(i, k, v)
        await transfer.finish()
    await sender.send(address, caches[-1])  # a slot is free again
    for cache in caches:
        got = await receiver.take(cache.header.request_id, 1, 5)
        assert digest(got) == digest(cache)


async def check_connection_caps(backend: str) -> None:
    """At the per-host cap, a new connection closes the longest-idle one; when every
    connection is moving KV, a new one is refused (BudgetExceededError), not queued."""
    settings = TransportSettings(max_connections_per_host=4, max_connections=6)
    receiver = make_receiver(backend, settings)
    address = await receiver.start()
    sender = make_sender(backend, settings)
    conns = []
    transfers = []
    try:
        conns = [await _say_hello(address) for _ in range(10)]
        assert receiver.connections <= 4, receiver.connections
        closed = [await _closed_by_peer(r, 0.2) for r, _ in conns]
        assert closed == [True] * 6 + [False] * 4, closed  # the oldest went first
        caches = [synthetic_cache(f"cap-{i}", 1, 64 * KIB) for i in range(5)]
        for cache in caches[:4]:  # these evict the idle ones and then hold every slot
            transfers.append(await sender.open(address, cache.header))
        assert receiver.connections == 4
        try:
            await sender.open(address, caches[4].header)
        except errors.BudgetExceededError:
            pass
        else:
            raise AssertionError("a connection beyond the cap was accepted")
        await finish_then_refill(sender, receiver, address, transfers, caches)
    finally:
        for _, w in conns:
            w.close()
        await sender.close()
        await receiver.close()


async def check_nonfinite(backend: str) -> None:
    """KV values holding a NaN or an infinity are refused (checksums match: the sender
    computed junk); with ``check_finite`` off they are accepted as they are."""
    for check in (True, False):
        settings = TransportSettings(check_finite=check)
        receiver = make_receiver(backend, settings)
        address = await receiver.start()
        sender = make_sender(backend, settings)
        try:
            for n, bad in enumerate((np.nan, np.inf, -np.inf)):
                rid = f"nan-{check}-{n}"
                cache = synthetic_cache(rid, 1, 4 * MIB, n_layers=4, seed=n)
                cache.layers[2][1].reshape(-1)[12345] = bad
                try:
                    await sender.send(address, cache)
                except errors.WireFormatError:
                    assert check, "refused with check_finite off"
                else:
                    assert not check, f"{bad} in the KV was accepted"
                if check:
                    try:
                        await receiver.take(rid, 1, 5)
                    except errors.NonFiniteError:
                        pass
                    else:
                        raise AssertionError(f"{bad} in the KV was handed over")
                else:
                    assert digest(await receiver.take(rid, 1, 5)) == digest(cache)
                assert receiver.inbox.bytes_in_use == 0
        finally:
            await sender.close()
            await receiver.close()


async def check_failure_isolated(backend: str) -> None:
    """One transfer failing with its payload moving fails only itself: another transfer
    between the same pair, mid-way at that moment (its receives posted, a segment in
    flight), completes intact (issue 18, defect 1: a failure used to cancel every UCX
    operation to the peer)."""
    settings = TransportSettings(segment_bytes=1 * MIB)
    receiver = make_receiver(backend, settings)
    address = await receiver.start()
    sender = make_sender(backend, settings)
    a = synthetic_cache("iso-a", 1, 8 * MIB, n_layers=8)
    b = synthetic_cache("iso-b", 1, 8 * MIB, n_layers=8, seed=1)
    try:
        tb = await sender.open(address, b.header)
        ta = await sender.open(address, a.header)
        await tb.send_layer(0, *b.layers[0])  # a segment of each in flight
        await ta.send_layer(0, *a.layers[0])
        await ta.abort("the request was cancelled")
        for i, (k, v) in enumerate(b.layers[1:], start=1):
            await tb.send_layer(i, k, v)
        await tb.finish()
        got = await receiver.take("iso-b", 1, timeout_s=5)
        assert digest(got) == digest(b)
        got.release()
        try:
            await receiver.take("iso-a", 1, timeout_s=5)
        except errors.PeerLostError:
            pass
        else:
            raise AssertionError("an aborted KV was handed over")
        assert receiver.inbox.bytes_in_use == 0
        await sender.send(address, synthetic_cache("iso-c", 1, 2 * MIB))  # the pair still works
        assert digest(await receiver.take("iso-c", 1, 5)) == digest(
            synthetic_cache("iso-c", 1, 2 * MIB)
        )
    finally:
        await sender.close()
        await receiver.close()


CHECKS = (
    check_sizes,
    check_scaled,
    check_concurrent,
    check_sender_killed,
    check_receiver_killed,
    check_receiver_killed_small,
    check_stalled_receiver,
    check_stalled_sender,
    check_corruption,
    check_stale_epoch,
    check_peer_restart,
    check_replay,
    check_idle_connections,
    check_connection_caps,
    check_nonfinite,
    check_failure_isolated,
)


def _main(argv: Sequence[str]) -> None:
    """``python -m transport.testing LOOP BACKEND SETTINGS [TLS-FOLDER IDENTITY]``."""
    tls = security.load_dir(argv[3], argv[4]) if len(argv) > 4 else None
    main = _peer_main(argv[1], TransportSettings(**json.loads(argv[2])), tls)
    if argv[0] == "uvloop":
        import uvloop  # noqa: PLC0415 - optional; only a peer told to run on it loads it

        uvloop.run(main)
    else:
        asyncio.run(main)


if __name__ == "__main__":
    _main(sys.argv[1:])
