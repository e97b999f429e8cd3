"""The worker side of pdorch's connector: moves KV blocks between vLLM's cache and the transport.

Runs in vLLM's worker process, called from its model runner thread; the transport runs on a
`kv_loop.LoopThread` of its own.

**Prefill: push, layer by layer.** When a step is bound (``bind_connector_metadata``, before
the forward) the connector opens a transfer per request whose prompt ends in this step, so the
header check and memory reservation on the decode side overlap the first layers' compute. As
each attention layer has written its KV (``save_kv_layer``) the request's blocks of that layer
are gathered (one index copy of K and of V) and queued to the open transfer, which sends them
while the next layers compute. ``wait_for_save`` then waits for every transfer of the step to
be verified by the receiver (or to fail) — bounded by ``timeout_s`` — so the outcome is known
before vLLM finishes the request, and the request's blocks are free to go right after.

**Decode: staged, then copied.** The `KvReceiver` (fencing, budget, hold lease) receives into
its own pooled buffer as the prefill pushes — before vLLM has even allocated blocks for the
request — and the load (``start_load_kv``) waits in the loop thread for (request id, epoch)
with ``timeout_s``; the model runner thread copies the arrived blocks into vLLM's blocks in
``get_transfer_results`` (one scatter per layer for K and V), releases the buffer and reports
the request finished. Any failure (timeout, stale epoch, refused or broken transfer, token
count mismatch) reports it failed; vLLM then ends it with an error and frees its blocks.
Measured in real vLLM engines here (SmolLM2-135M fp32, TCP, two engine processes on a 2-core VM
shared with other jobs; 3 runs each): the transfer ends *inside* the prefill's forward — the
step waited 0.02-0.04 ms after its last layer for 256- and 1024-token prompts (11.8 / 47 MB),
so the layer-wise push hides the whole transfer behind compute; a P/D prefill took 2.0 s /
7.1 s (medians) against 1.9 s / 7.1 s for the same engine without a push. The per-layer gather
is on the forward's path: 30-60 ms per prompt under that load (3.8 / 12 ms on an idle core).
The decode's staging copy took 2.9-5.0 ms (256 tokens) and 8.6-13 ms (1024 tokens) per request.
Caveat: the transport's loop thread and vLLM's model runner share one GIL; on a busy machine
a layer's hand-off can wait a switch interval (5 ms), which is what stretches transfers to the
length of the forward; this is invisible while compute is longer than the transfer.

**Prefill over ``ucx-read``: nothing gathered.** `WorkerSide.register` registers vLLM's
KV cache tensors once, for the engine's life (`Registry.register_region`: their memory,
deduplicated; the key crosses each link once), and the sender moves one layer per segment.
``save_kv_layer`` then only hands the layer's index to the loop thread, which gives the
transfer each requested block's K and V pieces in wire order (`kv_pieces`: a (block, head)
chunk each in the CPU layout, one run per block — consecutive blocks merged — in the flash
layout); the decode side reads them one-sided straight out of vLLM's cache into its
contiguous receive buffer, so the wire layout is the gather's. The gather stays where a
copy is needed anyway (a ``kv_dtype`` other than the cache's), for tcp and ucx, and where the
cache is not in host memory (the CUDA build: a warning at start). A suffix-only push leaves
out the decode's first blocks' pieces. Why reading vLLM's blocks in place is safe: the
decode only *reads* prefill memory, never writes it; ``wait_for_save`` holds the engine
step — so the request's blocks, which vLLM frees only after the step — until the receiver
verified every layer or the transfer failed; each layer's checksum is taken before the
receiver learns where to read (`transport.sender`), so a read that comes late, after a
failed transfer's blocks were re-used, gets bytes that fail their checksum and is refused
(`tests/contract/test_transport_pieces.py` changes a byte between the two). The one window
left: ``wait_for_save`` gives up ``_SAVE_GRACE_S`` after the transfer's own deadline (which
cancels the transfer on the loop first); only a loop thread stalled that long could take
a checksum after the blocks were re-used — and that attempt's prefill has already
reported failure, so its epoch is fenced off. Measured (SmolLM2-135M fp32, two engines,
2 cores shared, loads 2-5, 3 runs each): the forward's hand-over took 16-20 ms (256 tokens)
and 29-43 ms (1024) read in place against 18-108 / 41-86 ms gathered — now mostly the
per-layer hand-off to the loop thread (a GIL switch), no copy; P/D prefill times equal
main's ``ucx-read`` within noise; and 1024-token pushes, which failed over ``ucx`` (32 MiB
segments: the link silent past the receiver's 5 s idle deadline while a loaded forward
computed 21 layers), all went through with a segment per layer (README, "vLLM workers");
the tag path (``ucx``) now moves a segment per layer too.

Why staged: the push starts before the decode request exists, so there are no blocks to land
in yet; landing straight into blocks needs the decode to allocate first and pull (one-sided
reads: the transport v2 issue), which this block-shaped wire layout is ready for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from orchestrator.workers.vllm import kv_channel, kv_layout, kv_params, kv_pieces
from orchestrator.workers.vllm.connector_scheduler import LoadSpec, SaveSpec, StepPlan
from orchestrator.workers.vllm.kv_loop import LoopThread
from transport import control, kvcodec, wire
from transport import errors as terr
from transport.backend_names import needs_ucx
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.receiver import KvReceiver
from transport.registry import Registration
from transport.security import LinkTls, load_dir
from transport.sender import KvSender

log = logging.getLogger(__name__)

_TORCH_DTYPES = {
    torch.float32: wire.DType.FLOAT32,
    torch.float16: wire.DType.FLOAT16,
    torch.bfloat16: wire.DType.BFLOAT16,
}
_SAVE_GRACE_S = 5.0
"""wait_for_save waits this much past the transfer's own deadline before giving up on it."""
CONNECT_TIMEOUT_S = 10.0
"""The KV link's connect deadline (TCP, TLS, HELLO) in a vLLM worker, where the transport's
thread shares the process and the CPU with the engine: with two CPU engines on this 2-core
machine a decode worker's KV thread went unanswered for ~2.6-3 s while both computed (CI:
a prefill's connect timed out at the transport's 2 s and the request failed over). A dead
decode worker refuses the connection at once; only a hung one is found later."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """``kv_connector_extra_config``, as `kv.connector_config` writes it."""

    role: str
    backend: str
    kv_address: str
    fingerprint: str
    hold_s: float
    timeout_s: float
    control_path: str
    memory_budget_bytes: int = 0
    """Decode: the receiver's budget; 0 means the transport's default."""
    events_endpoint: str = ""
    """Decode: vLLM's KV cache events publisher (the connector follows it: `holds_prefix`)."""
    tls_dir: str = ""
    """The KV link's mutual TLS: this directory's ``ca.pem`` and ``tls_identity``'s files
    (`transport.security.load_dir`); empty: plaintext."""
    tls_identity: str = ""

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> WorkerConfig:
        return cls(
            role=str(extra["pdorch_role"]),
            backend=str(extra["backend"]),
            kv_address=str(extra.get("kv_address", "")),
            fingerprint=str(extra["fingerprint"]),
            hold_s=float(extra["hold_s"]),
            timeout_s=float(extra["timeout_s"]),
            control_path=str(extra.get("control_path", "")),
            memory_budget_bytes=int(extra.get("memory_budget_bytes") or 0),
            events_endpoint=str(extra.get("events_endpoint", "")),
            tls_dir=str(extra.get("tls_dir", "")),
            tls_identity=str(extra.get("tls_identity", "")),
        )

    def link_tls(self) -> LinkTls | None:
        """The KV link's TLS contexts (a bad file is a `TlsConfigError` naming it)."""
        if not self.tls_dir:
            return None
        return load_dir(self.tls_dir, self.tls_identity)


class LayerViews:
    """K and V of each layer's paged tensor as views indexed by block id (dim 0)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        self.index = {name: i for i, name in enumerate(kv_caches)}
        self.tensors = list(kv_caches.values())
        views = [self._split(t, block_size) for t in self.tensors]
        self.k = [k for k, _, _ in views]
        self.v = [v for _, v, _ in views]
        layouts = {name for _, _, name in views}
        if len(layouts) != 1:
            raise ValueError(f"layers differ in KV layout: {layouts}")
        first = next(iter(kv_caches.values()))
        dtype = _TORCH_DTYPES.get(first.dtype)
        if dtype is None:
            raise ValueError(f"KV cache dtype {first.dtype} is not supported by pdorch's connector")
        self.layout = kv_layout.BlockLayout(
            n_layers=len(views),
            block_size=block_size,
            block_shape=tuple(self.k[0].shape[1:]),
            layout=layouts.pop(),
            dtype=dtype,
        )

    @staticmethod
    def _split(t: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        if t.dim() == 4 and t.shape[2] == block_size:
            # CPU backend ("LBHNC"): [blocks, kv_heads, block_size, 2 * head_dim], each
            # (block, head) holding block_size rows of K then block_size rows of V.
            n, h, bs, c = t.shape
            five = t.view(n, h, 2, bs, c // 2)
            return five[:, :, 0], five[:, :, 1], "cpu-LBHNC"
        if t.dim() == 5 and t.shape[0] == 2 and t.shape[2] == block_size:
            # Flash-attention style: [2, blocks, block_size, kv_heads, head_dim].
            return t[0], t[1], "2BNHC"
        raise ValueError(
            f"unsupported KV cache tensor shape {tuple(t.shape)} (block size {block_size})"
        )


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(dtype) if dtype is torch.bfloat16 else t


@dataclass(frozen=True, slots=True)
class InPlaceLayer:
    """One layer of vLLM's cache as the one-sided path reads it: the bytes of the memory its
    tensor views (no copy) and where each block's K and V lie in them."""

    memory: memoryview
    k: kv_pieces.BlockPieces
    v: kv_pieces.BlockPieces

    def pieces(self, blocks: Sequence[int]) -> tuple[list[memoryview], list[memoryview]]:
        """``blocks``' K and V as pieces of the cache, in wire order."""
        mem = self.memory
        return (
            [mem[s : s + n] for s, n in self.k.ranges(blocks)],
            [mem[s : s + n] for s, n in self.v.ranges(blocks)],
        )


def in_place_layers(
    views: LayerViews,
) -> tuple[list[InPlaceLayer], list[tuple[int, int, torch.Tensor]]] | None:
    """Every layer's `InPlaceLayer`, and the distinct memory regions they lie in (address,
    length, a tensor that keeps it alive) — or None when some layer cannot be read in
    place (not in host memory, or blocks that are not regular runs): then it gathers."""
    layers: list[InPlaceLayer] = []
    regions: dict[int, tuple[int, int, torch.Tensor]] = {}
    memories: dict[int, memoryview] = {}
    for t, k, v in zip(views.tensors, views.k, views.v, strict=True):
        if t.device.type != "cpu":
            return None
        storage = t.untyped_storage()
        address, length = int(storage.data_ptr()), int(storage.nbytes())
        pk = kv_pieces.block_pieces(k.shape, k.stride(), int(k.storage_offset()), k.element_size())
        pv = kv_pieces.block_pieces(v.shape, v.stride(), int(v.storage_offset()), v.element_size())
        if pk is None or pv is None or not address or not length:
            return None
        if address not in memories:
            raw = (ctypes.c_uint8 * length).from_address(address)  # kept alive by the tensor
            memories[address] = memoryview(raw).cast("B")
            regions[address] = (address, length, t)
        layers.append(InPlaceLayer(memories[address], pk, pv))
    return layers, list(regions.values())


Layer = tuple[int, np.ndarray | None, np.ndarray | None]
"""A saved layer: its index and its gathered K and V (None, None: read in place)."""


@dataclass(slots=True)
class _Push:
    spec: SaveSpec
    queue: asyncio.Queue[Layer | None]
    future: concurrent.futures.Future[kv_params.PrefillTransfer]
    in_place: bool = False
    """Its layers are read in place by the decode side (no gather)."""
    layers_put: int = 0
    gather_s: float = 0.0
    first_layer_at: float = 0.0


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    future: concurrent.futures.Future[wire.KvCache]
    cancelled: bool = False


class WorkerSide:
    def __init__(self, config: WorkerConfig, block_size: int, max_tokens: int) -> None:
        self.config = config
        self._block_size = block_size
        self._max_tokens = max_tokens
        self._loop = LoopThread(f"pdorch-kv-{config.role}")
        self._sender: KvSender | None = None
        self._receiver: KvReceiver | None = None
        self._views: LayerViews | None = None
        self._in_place: list[InPlaceLayer] | None = None
        """Prefill over ``ucx-read``: vLLM's cache, registered once, read in place."""
        self._regions: list[Registration] = []
        self._fingerprint = ""
        self._pushes: list[_Push] = []
        self._outcomes: dict[str, dict[str, Any]] = {}
        self._loads: dict[str, _Load] = {}
        self._control: concurrent.futures.Future[None] | None = None
        self.holds_prefix: Callable[[bytes], bool] | None = None
        """Decode: whether this engine's prefix cache holds the block of that chained digest
        (and so the prefix it ends; `kv_events`); None: it holds none."""

    @property
    def layout(self) -> kv_layout.BlockLayout:
        assert self._views is not None
        return self._views.layout

    # ------------------------------------------------------------------ lifecycle

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._views = LayerViews(kv_caches, self._block_size)
        layout = self._views.layout
        self._fingerprint = layout.fingerprint(self.config.fingerprint)
        settings = TransportSettings(
            connect_timeout_s=CONNECT_TIMEOUT_S,
            transfer_timeout_s=self.config.timeout_s,
            kv_hold_s=self.config.hold_s,
        )
        if self.config.memory_budget_bytes:
            settings = dataclasses.replace(
                settings, memory_budget_bytes=self.config.memory_budget_bytes
            )
        self._loop.start()
        if self.config.role == "prefill":
            if needs_ucx(self.config.backend):
                # A segment per layer: each layer moves as soon as it is saved (overlapping
                # the forward; with 32 MiB segments a 1024-token KV's first one was announced
                # only once 21 of 30 layers existed, and a loaded CPU forward left the link
                # silent past the receiver's idle deadline), and one-sided, its pieces fit
                # one READ (`control.MAX_REGIONS`).
                settings = dataclasses.replace(settings, segment_bytes=control.MIN_SEGMENT_BYTES)
            self._sender = make_sender(self.config.backend, settings, tls=self.config.link_tls())
            self._loop.submit(self._sender.start()).result(30)
            if self.config.backend == UCX_READ:
                self._loop.submit(self._register_cache()).result(30)
        else:
            spec = kv_layout.model_spec(self.config.fingerprint, layout, self._max_tokens)
            self._receiver = make_receiver(
                self.config.backend, settings, spec, tls=self.config.link_tls()
            )
            self._receiver.prefix_check = self._prefix_held
            host, _, port = self.config.kv_address.rpartition(":")
            address = self._loop.submit(self._receiver.start(host, int(port))).result(30)
            self._control = self._loop.submit(self._control_link(address))
            log.info(
                "pdorch KV receiver on %s (%s), layout %s", address, self.config.backend, layout
            )

    async def _register_cache(self) -> None:
        """Register vLLM's KV cache once, for the engine's life (on the loop: the sender's
        registry is the loop's); where it cannot be read in place, pushes gather."""
        assert self._sender is not None
        assert self._views is not None
        found = in_place_layers(self._views)
        if found is None:
            log.warning("vLLM's KV cache cannot be read in place here: KV pushes gather")
            return
        layers, regions = found
        registry = self._sender.registry
        for address, length, owner in regions:
            self._regions.append(registry.register_region(address, length, owner))
        self._in_place = layers
        log.info(
            "vLLM's KV cache registered for one-sided reads: %d region(s), %d MiB",
            len(regions),
            sum(length for _, length, _ in regions) >> 20,
        )

    def _prefix_held(self, tokens: int, digest: bytes) -> bool:
        """The receiver's check of a suffix-only header, before any payload: the prefix is
        whole blocks and the cache holds its last one, as vLLM's events last said. A block
        evicted since fails the load instead (`_prefix_problem`): the request is re-prefilled."""
        holds = self.holds_prefix
        return not tokens % self._block_size and holds is not None and holds(digest)

    def shutdown(self) -> None:
        self._loop.stop(self._close())

    async def _close(self) -> None:
        if self._sender is not None:
            for reg in self._regions:
                self._sender.registry.unregister_region(reg)
            self._regions = []
            await self._sender.close()
        if self._receiver is not None:
            await self._receiver.close()

    # ------------------------------------------------------------------ prefill: push

    def begin_step(self, plan: StepPlan) -> None:
        """Open this step's transfers (before the forward) and queue this step's loads."""
        for spec in plan.saves:
            queue: asyncio.Queue[Layer | None] = asyncio.Queue()
            # In place only when the wire bytes are the cache's (no dtype encoding).
            in_place = self._in_place is not None and self._wire_dtype(spec) is self.layout.dtype
            future = self._loop.submit(self._push(spec, queue, in_place))
            self._pushes.append(_Push(spec, queue, future, in_place))
        for rid in plan.cancels:
            loading = self._loads.get(rid)
            if loading is not None:
                loading.cancelled = True
                loading.future.cancel()
        for load in plan.loads:
            assert self._receiver is not None, "a KV load on a prefill engine"
            p = load.params
            taking = self._loop.submit(
                self._receiver.take(p.request_id, p.epoch, self.config.timeout_s)
            )
            self._loads[load.req_id] = _Load(load, taking)

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not self._pushes:
            return
        views = self._views
        assert views is not None
        index = views.index[layer_name]
        for push in self._pushes:
            t = time.perf_counter()
            if push.in_place:  # the decode side reads the blocks where they are
                self._loop.call(push.queue.put_nowait, (index, None, None))
            else:
                ids = torch.tensor(push.spec.block_ids, dtype=torch.long)
                k, v = to_numpy(views.k[index][ids]), to_numpy(views.v[index][ids])
                self._loop.call(push.queue.put_nowait, (index, k, v))
            push.layers_put += 1
            push.first_layer_at = push.first_layer_at or t
            push.gather_s += time.perf_counter() - t

    def wait_for_save(self) -> None:
        """Wait until every transfer opened this step is verified or failed."""
        if not self._pushes:
            return
        started = time.perf_counter()
        n_layers = self.layout.n_layers
        for push in self._pushes:
            if push.layers_put < n_layers:  # a layer never saved: the transfer cannot finish
                self._loop.call(push.queue.put_nowait, None)
        for push in self._pushes:
            try:
                outcome = push.future.result(self.config.timeout_s + _SAVE_GRACE_S)
            except concurrent.futures.TimeoutError:
                push.future.cancel()
                outcome = kv_params.PrefillTransfer(
                    ok=False, error="KV transfer did not end in time", retryable=True
                )
            except Exception as exc:  # a bug in the push itself: fail the transfer, loudly
                log.exception("KV push of %s failed", push.spec.params.request_id)
                outcome = kv_params.PrefillTransfer(ok=False, error=f"KV push failed: {exc!r}")
            tail_ms = (time.perf_counter() - started) * 1000
            outcome = dataclasses.replace(
                outcome, tail_ms=tail_ms, gather_ms=push.gather_s * 1000, in_place=push.in_place
            )
            self._outcomes[push.spec.req_id] = outcome.to_dict()
            log.info(
                "KV push of %s: ok=%s %d bytes, %.1f ms open to verified, layers computed "
                "over %.1f ms (gather %.1f ms, %s), step waited %.1f ms after the last layer",
                push.spec.params.request_id,
                outcome.ok,
                outcome.kv_bytes,
                outcome.transfer_ms,
                (started - push.first_layer_at) * 1000 if push.first_layer_at else 0.0,
                push.gather_s * 1000,
                "read in place" if push.in_place else "gathered",
                tail_ms,
            )
        self._pushes = []

    def take_outcomes(self) -> dict[str, dict[str, Any]]:
        outcomes, self._outcomes = self._outcomes, {}
        return outcomes

    def _wire_dtype(self, spec: SaveSpec) -> wire.DType:
        kv_dtype = spec.params.kv_dtype
        return kv_params.DTYPES[kv_dtype] if kv_dtype else self.layout.dtype

    async def _push(
        self, spec: SaveSpec, queue: asyncio.Queue[Layer | None], in_place: bool
    ) -> kv_params.PrefillTransfer:
        assert self._sender is not None
        layout = self.layout
        p = spec.params
        wire_dtype = self._wire_dtype(spec)
        prefix, refused = self._sendable_prefix(spec), False
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                try:
                    header = self._header(spec, wire_dtype, prefix)
                    transfer = await self._sender.open(p.target, header)
                except terr.PrefixMissingError as exc:  # the decode side lacks it: send it all
                    log.info("suffix-only KV of %s refused (%s); sending all", p.request_id, exc)
                    prefix, refused = 0, True
                    header = self._header(spec, wire_dtype, 0)
                    transfer = await self._sender.open(p.target, header)
                skip = prefix // layout.block_size  # the decode side's own blocks
                async with transfer:
                    for _ in range(layout.n_layers):
                        # Saved already, or the forward computes it: a sign of life
                        # meanwhile (a slow step is not a dead prefill to the decode side).
                        if queue.empty():
                            item = await transfer.hold(queue.get())
                        else:
                            item = queue.get_nowait()
                        if item is None:
                            raise terr.WireFormatError("the engine step ended with layers unsaved")
                        index, k, v = item
                        if k is None or v is None:  # read in place (not the decode's blocks)
                            assert self._in_place is not None
                            assert in_place
                            pieces = self._in_place[index].pieces(spec.block_ids[skip:])
                            await transfer.send_layer(index, *pieces)
                            continue
                        if skip:
                            k, v = np.ascontiguousarray(k[skip:]), np.ascontiguousarray(v[skip:])
                        if wire_dtype is layout.dtype:
                            await transfer.send_layer(index, k, v)
                        else:
                            enc = await asyncio.to_thread(
                                kvcodec.encode_layer, k, v, layout.dtype, wire_dtype
                            )
                            await transfer.send_layer(index, enc.k, enc.v, enc.scales)
                    await transfer.finish()
        except TimeoutError:
            return kv_params.PrefillTransfer(
                ok=False, error=f"KV transfer exceeded {self.config.timeout_s}s", retryable=True
            )
        except terr.TransportError as exc:
            log.warning(
                "KV push of %s epoch %s to %s failed: %s", p.request_id, p.epoch, p.target, exc
            )
            return kv_params.PrefillTransfer(ok=False, error=str(exc), retryable=exc.retryable)
        return kv_params.PrefillTransfer(
            ok=True,
            kv_bytes=header.payload_bytes,
            transfer_ms=(time.perf_counter() - started) * 1000,
            prefix_tokens=prefix,
            prefix_refused=refused,
        )

    def _sendable_prefix(self, spec: SaveSpec) -> int:
        """The decode side's prefix this push may leave out: whole blocks, at least one token
        left to send; else 0 (the whole KV)."""
        n = spec.params.prefix_tokens
        if n and (n % self._block_size or n >= spec.num_tokens):
            log.warning(
                "%s: a decode prefix of %d tokens (blocks of %d, %d tokens to send); sending all",
                spec.params.request_id,
                n,
                self._block_size,
                spec.num_tokens,
            )
            return 0
        return n

    def _header(self, spec: SaveSpec, wire_dtype: wire.DType, prefix: int) -> wire.KvHeader:
        """The header of ``spec``'s KV after its first ``prefix`` tokens (0: all of it)."""
        layout, p = self.layout, spec.params
        tokens = spec.num_tokens - prefix
        return wire.KvHeader(
            request_id=p.request_id,
            epoch=p.epoch,
            fingerprint=self._fingerprint,
            dtype=wire_dtype,
            token_count=tokens,
            layers=(layout.layer_shape(tokens),) * layout.n_layers,
            scales=kvcodec.scale_layout(wire_dtype),
            prefix_tokens=prefix,
            prefix_hash=p.prefix_digest if prefix else b"",
        )

    # ------------------------------------------------------------------ decode: load

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed) loads since the last call; failed ones are in both sets."""
        finished: set[str] = set()
        failed: set[str] = set()
        for rid, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[rid]
            finished.add(rid)
            if not self._land(load):
                failed.add(rid)
        return finished, failed

    def _land(self, load: _Load) -> bool:
        """Copy an arrived KV into the request's blocks; False if there is none to copy."""
        p = load.spec.params
        if load.future.cancelled():
            log.info("KV load of %s epoch %s cancelled", p.request_id, p.epoch)
            return False
        exc = load.future.exception()
        if exc is not None:
            log.warning("KV load of %s epoch %s failed: %s", p.request_id, p.epoch, exc)
            return False
        cache = load.future.result()
        try:
            if load.cancelled:
                return False
            if cache.header.total_tokens != p.num_tokens:
                log.warning(
                    "KV of %s covers %d tokens, the decode expected %d",
                    p.request_id,
                    cache.header.total_tokens,
                    p.num_tokens,
                )
                return False
            problem = self._prefix_problem(cache.header, load.spec)
            if problem:
                log.warning("KV of %s not loaded: %s", p.request_id, problem)
                return False
            self._copy_in(cache, load.spec)
        except terr.WireFormatError as exc:
            log.warning("KV of %s could not be decoded: %s", p.request_id, exc)
            return False
        finally:
            cache.release()
        return True

    def _prefix_problem(self, header: wire.KvHeader, spec: LoadSpec) -> str:
        """Why a suffix-only KV cannot complete this request ("" if it can): it must extend
        blocks this engine's prefix cache gave the request — the same tokens (the digest) and
        no fewer than the prefix (an eviction since the header was accepted shrinks the hit)."""
        n = header.prefix_tokens
        if not n:
            return ""
        blocks = n // self._block_size
        if n % self._block_size or blocks > len(spec.held):
            return (
                f"it extends a {n}-token prefix; this engine's cache gave the request "
                f"{len(spec.held) * self._block_size} tokens"
            )
        if spec.held[blocks - 1] != header.prefix_hash:
            return f"it extends a {n}-token prefix that is not this request's own"
        return ""

    def _copy_in(self, cache: wire.KvCache, spec: LoadSpec) -> None:
        views = self._views
        assert views is not None
        dtype = views.k[0].dtype
        layers = kvcodec.decode_layers(cache, views.layout.dtype)
        plan = spec.plan
        if not plan.dst:
            return
        started = time.perf_counter()
        dst = torch.tensor(plan.dst, dtype=torch.long)
        skip = cache.header.prefix_tokens // self._block_size  # wire block 0 is this block
        src = slice(plan.src.start - skip, plan.src.stop - skip)
        for i, (k, v) in enumerate(layers):
            views.k[i][dst] = to_torch(k[src], dtype).to(views.k[i].device)
            views.v[i][dst] = to_torch(v[src], dtype).to(views.v[i].device)
        took = time.perf_counter() - started
        log.info(
            "KV load of %s: %d blocks (%d bytes) copied into vLLM's blocks in %.2f ms",
            spec.params.request_id,
            len(plan.dst),
            cache.nbytes,
            took * 1000,
        )

    # ------------------------------------------------------------------ control link

    async def _control_link(self, kv_address: str) -> None:
        """Connect to the pdorch worker's `kv.DecodeKvControl` (retrying until it listens),
        introduce the receiver and serve its Release/stats calls; reconnect if it breaks."""
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(
                    self.config.control_path, limit=kv_channel.MAX_LINE
                )
            except OSError:
                await asyncio.sleep(0.2)
                continue
            try:
                hello = {"op": "hello", "kv_address": kv_address, "backend": self.config.backend}
                writer.write(kv_channel.encode(hello))
                await writer.drain()
                while line := await reader.readline():
                    writer.write(kv_channel.encode(self._on_control(kv_channel.decode(line))))
                    await writer.drain()
            except (OSError, kv_channel.ChannelError) as exc:
                log.warning("KV control link to %s broke: %s", self.config.control_path, exc)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            await asyncio.sleep(0.2)

    def _on_control(self, msg: dict[str, Any]) -> dict[str, Any]:
        receiver = self._receiver
        assert receiver is not None
        reply: dict[str, Any] = {"id": msg.get("id", 0)}
        op = msg.get("op")
        if op == "stats":
            reply["held_bytes"] = receiver.inbox.bytes_in_use
        elif op == "release":
            rid, epoch = msg.get("request_id"), msg.get("epoch")
            if not isinstance(rid, str) or not isinstance(epoch, int):
                reply["error"] = f"bad release {msg!r}"
            else:
                # That attempt's KV or an older one's; its epoch is closed for good.
                reply["released"] = receiver.discard(rid, epoch)
        else:
            reply["error"] = f"unknown op {op!r}"
        return reply
