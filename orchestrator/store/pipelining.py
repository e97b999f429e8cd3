"""Script calls made during one turn of the event loop, sent to Redis as one pipeline.

**Why.** redis-py spends ~80 µs of CPU on its own machinery for every command it sends
alone (a pooled connection taken and given back, a write, a read, its observability hooks)
and ~35-50 µs for the same command inside a pipeline, most of which is packing the command's
arguments. A request makes three script calls of its own — its creation, ``kv_sent``, its
end — and a replica serves hundreds of requests at once: most turns of the loop find several
requests at a store call.

**How.** The first call queued in a turn leads it: it yields once to the loop, so that
every call made meanwhile, by any request, queues behind it, then takes the queue. Alone, it
sends its call itself (a plain call: no task, no pipeline). With others, a task of its own
(``pdorch-store-pipeline``) sends them all as one pipeline on a connection of its own (no
call waits for another pipeline in flight, and a caller cancelled meanwhile cannot stop the
others'), split at `MAX_PIPELINE` commands (each holds Redis while it runs, as
`RedisStore`'s journal batches are capped). Each caller gets its own reply, or its own error
reply raised, or — when the pipeline could not be sent or read — the outage that stopped it
(every caller of that pipeline then raises it, and retries or gives up as it would have
alone: each call is exactly as safe to send twice as before, see
`orchestrator.store.outage`). Scripts the server lost (NOSCRIPT: a restart, a failover) are
loaded and only the calls refused sent again. A call whose caller was cancelled before the
turn's calls were taken is not sent; a leader cancelled then hands the others on. Arguments
are encoded to bytes once, as they are packed (`wire`: ~15 µs less for a creation's ~60
arguments than redis-py's encoder), and every call — a pipeline, or one alone — is packed
here and exchanged on a pooled connection (`pipelined`, `exchange`): redis-py's own
pipeline and `Script` spent ~2.5x the CPU on their machinery.

One server (or a Sentinel primary) only: a Redis Cluster's client spreads a pipeline over its
nodes, and `RedisStore` calls a cluster's scripts one by one (through redis-py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rexc

from orchestrator import errors

log = logging.getLogger(__name__)

MAX_PIPELINE = 128
"""Commands per pipeline at most; a larger turn's calls go as several pipelines at once."""


@dataclass(slots=True)
class _Call:
    script: Any
    """A redis-py `AsyncScript` (``sha``, ``script``; callable with keys and args)."""
    keys: list[Any]
    args: list[Any]
    reply: asyncio.Future[Any]


class ScriptPipeline:
    """Runs script calls, each turn's together (module docstring). ``redis``: a redis-py
    asyncio client of one server."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._queued: list[_Call] = []
        self._flushes: set[asyncio.Task[None]] = set()
        """Pipelines in flight (cancelled by `close`)."""
        self._closed = False

    async def call(self, script: Any, keys: list[Any], args: list[Any]) -> Any:
        """``script(keys=keys, args=args)``'s reply, sent with this turn's other calls."""
        if self._closed:
            raise errors.StoreUnavailableError("request store closed")
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        self._queued.append(_Call(script, keys, args, reply))
        if len(self._queued) > 1:
            return await reply  # the turn's leader sends it
        try:
            await asyncio.sleep(0)  # the turn's other calls queue behind this one
        except asyncio.CancelledError:
            reply.cancel()
            loop.call_soon(self._flush)  # the others still go
            raise
        calls = self._taken()
        if calls == [] or self._closed:  # closed meanwhile (`close` failed the queue)
            return await reply
        if len(calls) == 1:  # alone: no task (a lost script is reloaded, as in a pipeline)
            return await one(self._redis, script, keys, args)
        self._start(calls)
        return await reply

    async def close(self) -> None:
        """Fail what is queued and stop the pipelines in flight (their callers raise
        `StoreUnavailableError`); idempotent."""
        self._closed = True
        _fail(self._taken(), errors.StoreUnavailableError("request store closed"))
        flushes = list(self._flushes)
        for task in flushes:
            task.cancel()
        if flushes:
            await asyncio.wait(flushes)

    def _taken(self) -> list[_Call]:
        """The queue's calls whose callers still wait; the queue is empty after."""
        queued, self._queued = self._queued, []
        return [c for c in queued if not c.reply.done()]

    def _flush(self) -> None:
        """Send what is queued (its leader was cancelled before it could)."""
        calls = self._taken()
        if calls:
            self._start(calls)

    def _start(self, calls: list[_Call]) -> None:
        for i in range(0, len(calls), MAX_PIPELINE):
            task = asyncio.create_task(
                self._send(calls[i : i + MAX_PIPELINE]), name="pdorch-store-pipeline"
            )
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _send(self, calls: list[_Call]) -> None:
        try:
            replies = await self._pipelined(calls)
        except asyncio.CancelledError:
            _fail(calls, errors.StoreUnavailableError("request store closed"))
            raise
        except Exception as exc:  # noqa: BLE001 - the outage (or bug) every caller raises
            _fail(calls, exc)
            return
        for c, reply in zip(calls, replies, strict=True):
            if c.reply.done():
                continue
            if isinstance(reply, Exception):
                c.reply.set_exception(reply)
            else:
                c.reply.set_result(reply)

    async def _pipelined(self, calls: list[_Call]) -> list[Any]:
        """Each call's reply, or its error reply as an exception (not raised)."""
        return await pipelined(self._redis, [(c.script, c.keys, c.args) for c in calls])


async def pipelined(redis: Any, calls: list[tuple[Any, list[Any], list[Any]]]) -> list[Any]:
    """Each (script, keys, args) call's reply, sent on ``redis`` (one server) as one
    pipeline, or its error reply as an exception (not raised). After a NOSCRIPT (a restart,
    a failover lost the script cache) the scripts are loaded and only the calls it refused
    sent again: the others were applied, and sent twice a journal append would be refused
    as a gap. An outage is raised.

    On one server (or a Sentinel primary) the commands are packed here and written on a
    pooled connection, their replies read back in order (`exchange`): redis-py's pipeline
    spent ~2.5x the CPU a command on its own machinery (a run of eight: ~70-105 against
    ~33-42 µs a call; a call alone ~230 against ~150). A cluster's client keeps its own
    pipeline (it routes commands to nodes)."""
    pool = getattr(redis, "connection_pool", None)  # a cluster client has none
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):  # the second round only after a NOSCRIPT
        if pool is not None:
            got = await exchange(pool, [_evalsha(*calls[i]) for i in todo])
        else:
            pipe = redis.pipeline(transaction=False)
            for i in todo:
                script, keys, args = calls[i]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            got = await pipe.execute(raise_on_error=False)
        for i, reply in zip(todo, got, strict=True):
            replies[i] = reply
        todo = [i for i in todo if isinstance(replies[i], rexc.NoScriptError)]
        if not todo or attempt:
            break
        for source in {calls[i][0].script for i in todo}:
            await redis.script_load(source)
    return replies


async def one(redis: Any, script: Any, keys: list[Any], args: list[Any]) -> Any:
    """One script call's reply (`pipelined` of one); an error reply is raised."""
    reply = (await pipelined(redis, [(script, keys, args)]))[0]
    if isinstance(reply, Exception):
        raise reply
    return reply


async def exchange(pool: Any, commands: list[bytes]) -> list[Any]:
    """Write ``commands`` (packed) on one connection of redis-py's ``pool`` and read a
    reply for each, in order; an error reply is returned as its exception. A connection
    left with replies unread (a read failed, the caller was cancelled) is dropped, never
    handed to the next caller; a connection error or timeout (an outage) is raised."""
    conn = await pool.get_connection()
    try:
        await conn.send_packed_command(b"".join(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except rexc.ResponseError as exc:
                replies.append(exc)
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    else:
        return replies
    finally:
        await pool.release(conn)


def _evalsha(script: Any, keys: list[Any], args: list[Any]) -> bytes:
    """``EVALSHA`` of ``script`` packed (keys and arguments `wire`-encoded: bytes pass as
    they are)."""
    head = (b"EVALSHA", script.sha.encode(), str(len(keys)).encode())
    return pack((*head, *wire(keys), *wire(args)))


def pack_resp(args: tuple[bytes, ...]) -> bytes:
    """A command in RESP, as ``hiredis.pack_command`` packs it (used without hiredis)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


def _packer() -> Callable[[tuple[bytes, ...]], bytes]:
    try:
        from hiredis import pack_command  # noqa: PLC0415
    except ImportError:  # redis-py's own pure-Python parser is in use too
        return pack_resp
    return pack_command  # type: ignore[return-value]  # typed for any argument; bytes here


pack = _packer()
"""Packs one command's arguments (bytes) in RESP: in C when hiredis is installed."""


def wire(values: list[Any]) -> list[bytes]:
    """Script arguments as redis-py would send them — text in UTF-8, numbers as their
    ``repr`` — in one pass here: redis-py's encoder checks every argument's type in Python
    on its own (~1 µs an argument; a creation has ~60), and passes bytes through."""
    return [v.encode() if type(v) is str else v if type(v) is bytes else _number(v) for v in values]


def _number(v: Any) -> bytes:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"a script argument must be text, bytes or a number, not {v!r}")
    return repr(v).encode()


def _fail(calls: list[_Call], exc: BaseException) -> None:
    for c in calls:
        if not c.reply.done():
            c.reply.set_exception(exc)
