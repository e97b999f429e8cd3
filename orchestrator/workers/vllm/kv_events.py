"""vLLM's KV cache events, read in the worker process: what its prefix cache holds.

vLLM's engine core (a child process) publishes ``KVEventBatch``es — ``BlockStored`` (block
hashes, parent hash, token ids), ``BlockRemoved``, ``AllBlocksCleared`` — on a ZMQ PUB
socket when ``KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")``. `KvEventFeed`
binds nothing: the publisher binds an ``ipc://`` endpoint private to this worker, and a
daemon thread here subscribes, decodes each batch (msgpack, vLLM's own structs) and feeds
`orchestrator.workers.kv_report.HeldBlocks`; the heartbeat reads `report` under a lock.
The decode connector (in vLLM's worker process) follows the same publisher with a feed of
its own to check the prefix a suffix-only KV extends (`holds`).

Subscribing is best effort by design: a batch lost or a late subscription leaves the
report short (only slower routing), and a sequence gap clears it.

Imports vLLM, pyzmq and msgspec at module level (all come with vLLM): only
`orchestrator.workers.vllm.engine` and `.connector` import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import uuid

import msgspec
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from orchestrator.workers.kv_report import HeldBlocks

log = logging.getLogger(__name__)

_POLL_MS = 100
"""How often the subscriber thread checks whether it should stop."""
_MEDIA = (None, "GPU")
"""Blocks in the engine's own KV pool (vLLM labels it GPU on every device); offloaded
tiers (CPU, storage) are not what a request placed here reuses for free."""


def endpoint() -> str:
    """A fresh ipc endpoint private to this process."""
    name = f"pdorch-kv-events-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"


def events_config(address: str) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=address)


class KvEventFeed:
    def __init__(self, address: str, block_size: int) -> None:
        self.address = address
        self._held = HeldBlocks(block_size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._thread = threading.Thread(target=self._run, name="pdorch-kv-events", daemon=True)
        self.batches = 0

    @property
    def block_size(self) -> int:
        return self._held.block_size

    def start(self) -> None:
        self._sock.connect(self.address)
        self._thread.start()

    def report(self, limit: int) -> str:
        with self._lock:
            return self._held.report(limit)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def holds(self, digest: bytes) -> bool:
        """Whether the cache holds the block of that chained digest (`HeldBlocks.holds`)."""
        with self._lock:
            return self._held.holds(digest)

    @property
    def closed(self) -> bool:
        return bool(self._ctx.closed)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        self._sock.close(linger=0)
        self._ctx.term()
        path = self.address.removeprefix("ipc://")
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            try:
                _topic, seq, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                batch = decoder.decode(payload)
            except (zmq.ZMQError, ValueError, msgspec.DecodeError) as exc:
                log.warning("KV event batch dropped: %s", exc)
                continue
            with self._lock:
                self.batches += 1
                self._held.sequence(int.from_bytes(seq, "big"))
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        # extra_keys: one entry per block, None without LoRA/mm/salt
                        plain = not ev.lora_name and not any(ev.extra_keys or ())
                        if ev.medium in _MEDIA and plain:
                            self._held.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids)
                    elif isinstance(ev, BlockRemoved):
                        if ev.medium in _MEDIA:
                            self._held.removed(ev.block_hashes)
                    elif isinstance(ev, AllBlocksCleared):
                        self._held.cleared()
