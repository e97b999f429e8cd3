"""What the pdorch worker process uses to drive pdorch's KV connector inside vLLM.

No vLLM import here: `connector_config` returns plain kwargs for ``vllm.config.KVTransferConfig``.

Changes to the interface of /work/agents/vllm-interface.md (written here, as agreed):

- `connector_config` takes ``control_path`` (decode role only, required there): the Unix
  socket of this worker's `DecodeKvControl` (``control.control_path``), through which the
  connector inside vLLM's worker process reports its KV address and takes Release.
- `DecodeKvControl(control_path=None)` is built *before* the engine (its path goes into the
  engine's config); ``await start(timeout_s)`` may be called before or after the engine is
  built and returns once the connector connected, with the KV address prefill workers push to.
  `release` is ``async`` (it is a round trip into the engine process) and returns whether KV
  was freed. `held_bytes()` is the last value polled (every ``poll_s``).
- `connector_config` takes ``memory_budget_bytes`` (decode: the receiver's budget).
- `prefill_result` also fills `PrefillTransfer.tail_ms` (see `kv_params.PrefillTransfer`).

Typical use (the engine helper)::

    control = DecodeKvControl()                                  # decode role
    cfg = connector_config("decode", backend="tcp", kv_address="0.0.0.0:0",
                           fingerprint=fp, hold_s=30, timeout_s=30,
                           control_path=control.control_path)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(..., kv_transfer_config=
                                       KVTransferConfig(**cfg)))
    kv_address = await control.start()
    ...SamplingParams(max_tokens=n, extra_args={"kv_transfer_params":
                      decode_params(rid, epoch, len(prompt_and_generated) - 1)})
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
from typing import Any

from orchestrator.workers.vllm import kv_channel
from orchestrator.workers.vllm.kv_params import (
    DTYPES,
    DecodeParams,
    PrefillParams,
    PrefillTransfer,
    result_of,
)

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "PdorchConnector"
CONNECTOR_MODULE = "orchestrator.workers.vllm.connector"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}

__all__ = [
    "DecodeKvControl",
    "PrefillTransfer",
    "connector_config",
    "decode_params",
    "prefill_params",
    "prefill_result",
]


def connector_config(
    role: str,
    *,
    backend: str,
    kv_address: str | None,
    fingerprint: str,
    hold_s: float,
    timeout_s: float,
    control_path: str | None = None,
    memory_budget_bytes: int | None = None,
    events_endpoint: str = "",
    tls_dir: str = "",
    tls_identity: str = "",
) -> dict[str, Any]:
    """kwargs for ``vllm.config.KVTransferConfig`` that load pdorch's connector.

    ``role`` "prefill" pushes every finished prefill's KV to its request's target; "decode"
    listens on ``kv_address`` ("host:port", port 0 picks one) and loads pushed KV.
    ``timeout_s``: prefill — a whole transfer; decode — how long a request's load waits for
    its KV before the request fails. ``hold_s``: decode — a received KV nobody loads within
    this lease is freed. ``memory_budget_bytes``: decode — KV held at once, in flight or
    waiting to be loaded (the transport's default when None). A load that fails ends the
    request with an error (``kv_load_failure_policy="fail"``): vLLM never recomputes behind
    pdorch's back. ``events_endpoint``: decode — vLLM's KV cache events publisher
    (`kv_events`), which the receiver follows to know which prefixes it may accept a suffix
    for; without it every suffix-only transfer is refused (the whole KV follows).
    ``tls_dir``/``tls_identity``: the KV link's mutual TLS (paths and a name, never key
    material: vLLM's worker process loads the files itself); empty: plaintext.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if role == "decode" and (not kv_address or not control_path):
        raise ValueError("the decode role needs kv_address and control_path")
    if timeout_s <= 0 or hold_s <= 0:
        raise ValueError("timeout_s and hold_s must be positive")
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": ROLES[role],
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "pdorch_role": role,
            "backend": backend,
            "kv_address": kv_address or "",
            "fingerprint": fingerprint,
            "hold_s": float(hold_s),
            "timeout_s": float(timeout_s),
            "control_path": control_path or "",
            "memory_budget_bytes": memory_budget_bytes or 0,
            "events_endpoint": events_endpoint,
            "tls_dir": tls_dir,
            "tls_identity": tls_identity,
        },
    }


def prefill_params(
    request_id: str,
    epoch: int,
    target: str,
    kv_dtype: str,
    prefix_tokens: int = 0,
    prefix_hash: bytes = b"",
) -> dict[str, Any]:
    """``kv_transfer_params`` of a prefill (max_tokens=1) request whose KV goes to ``target``.
    ``kv_dtype``: the wire dtype ("float32", "float16", "bfloat16", "fp8") or "" for the
    cache's own. ``prefix_tokens``/``prefix_hash``: the decode worker holds that prefix
    (`PrefillRequest.decode_prefix_tokens/_hash`): send only the blocks after it, or the
    whole KV if the decode side refuses (`PrefillTransfer.prefix_refused`)."""
    if kv_dtype not in ("", *DTYPES):
        raise ValueError(f"unknown KV dtype {kv_dtype!r}")
    digest = prefix_hash.hex() if prefix_tokens else ""
    return PrefillParams(request_id, epoch, target, kv_dtype, prefix_tokens, digest).to_dict()


def prefill_result(kv_transfer_params: dict[str, Any] | None) -> PrefillTransfer:
    """How the prefill's transfer ended, from its finished ``RequestOutput.kv_transfer_params``.
    ``ok`` means the decode side verified the whole KV; anything else is a failure."""
    return result_of(kv_transfer_params)


def decode_params(request_id: str, epoch: int, num_tokens: int) -> dict[str, Any]:
    """``kv_transfer_params`` of the decode request; its prompt is prompt + generated so far
    and ``num_tokens`` (= that length - 1) of it are loaded from the pushed KV."""
    return DecodeParams(request_id, epoch, num_tokens).to_dict()


class DecodeKvControl:
    """The decode worker's handle on the KV receiver inside its vLLM engine."""

    def __init__(
        self,
        control_path: str | None = None,
        *,
        poll_s: float = 0.5,
        request_timeout_s: float = 5.0,
    ) -> None:
        self._own_dir = None if control_path else tempfile.mkdtemp(prefix="pdorch-kv-")
        if self._own_dir is not None:
            os.chmod(self._own_dir, 0o700)
        self.control_path = control_path or os.path.join(self._own_dir or "", "control.sock")
        self._poll_s = poll_s
        self._timeout_s = request_timeout_s
        self._server: asyncio.Server | None = None
        self._hello: asyncio.Future[dict[str, Any]] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._held = 0
        self.kv_address = ""
        self.backend = ""

    async def start(self, timeout_s: float = 300.0) -> str:
        """Listen (if not yet) and wait for the connector; returns its KV address."""
        if self._server is None:
            self._hello = asyncio.get_running_loop().create_future()
            self._server = await asyncio.start_unix_server(
                self._serve, self.control_path, limit=kv_channel.MAX_LINE
            )
        assert self._hello is not None
        try:
            hello = await asyncio.wait_for(asyncio.shield(self._hello), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"the vLLM KV connector did not connect within {timeout_s}s"
            ) from None
        self.kv_address = str(hello["kv_address"])
        self.backend = str(hello.get("backend", ""))
        return self.kv_address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._writer is not None:  # a restarted connector replaces the old link
            self._writer.close()
        self._writer = writer
        poller = asyncio.create_task(self._poll(), name="pdorch-kv-control-poll")
        self._tasks.add(poller)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                msg = kv_channel.decode(line)
                if msg.get("op") == "hello":
                    self.kv_address = str(msg.get("kv_address", ""))  # a restart may move it
                    if self._hello is not None and not self._hello.done():
                        self._hello.set_result(msg)
                    continue
                fut = self._pending.pop(int(msg.get("id", 0)), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (kv_channel.ChannelError, OSError, ValueError) as exc:
            log.warning("KV control link broke: %s", exc)
        finally:
            poller.cancel()
            self._tasks.discard(poller)
            if self._writer is writer:
                self._writer = None
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("KV control link closed"))
            self._pending.clear()
            writer.close()

    async def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        writer = self._writer
        if writer is None:
            raise ConnectionError("the vLLM KV connector is not connected")
        n = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[n] = fut
        try:
            writer.write(kv_channel.encode({"id": n, **msg}))
            await asyncio.wait_for(writer.drain(), self._timeout_s)
            reply = await asyncio.wait_for(fut, self._timeout_s)
        finally:
            self._pending.pop(n, None)
        if "error" in reply:
            raise RuntimeError(f"KV connector: {reply['error']}")
        return reply

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
                self._held = int((await self._call({"op": "stats"}))["held_bytes"])
            await asyncio.sleep(self._poll_s)

    async def release(self, request_id: str, epoch: int) -> bool:
        """Free what is held or arriving for ``request_id`` at ``epoch`` or older."""
        reply = await self._call({"op": "release", "request_id": request_id, "epoch": epoch})
        return bool(reply["released"])

    def held_bytes(self) -> int:
        """KV bytes the receiver holds (in flight or waiting to be loaded), as last polled."""
        return self._held

    async def close(self) -> None:
        """Stop listening and drop the link. Idempotent."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
