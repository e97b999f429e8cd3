"""A migration's state in Redis. The only module of `orchestrator.migrate` that talks to Redis;
its errors become `orchestrator.errors.UnavailableError` here.

Keys, built by `orchestrator.store.keys` (``P`` is the prefix, ``pdorch`` by default; ``N``
the migration's name, encoded: one hash tag, one Redis Cluster slot)::

    P:migrate:{N}            hash    mode, percent, sample, upstreams, limits and pricing
                                     (JSON), started_at, updated_at; counters
                                     requests:<path>, failures:<path>, shadow_skipped
    P:migrate:{N}:rollbacks  list    rollback JSON {ts, reason, percent_before, stats}, last 100
    P:migrate:{N}:window     hash    path -> `policy.WindowStats` JSON (the proxy's window)
    P:migrate:{N}:samples    stream  one `policy.Sample` JSON per answer (field ``s``),
                                     trimmed to about ``max_samples`` (XADD MAXLEN ~)

A rollback is one Lua script: it sets percent to 0 and appends the rollback only if percent
was above 0, so two proxies that see the same breach record one rollback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rexc

from orchestrator import errors
from orchestrator.migrate.policy import Sample, WindowStats
from orchestrator.migrate.settings import MigrationSettings
from orchestrator.store.keys import DEFAULT_PREFIX, Keys
from orchestrator.store.url import redacted

T = TypeVar("T")

ROLLBACKS_KEPT = 100

# KEYS[1] the migration hash, KEYS[2] its rollbacks list. ARGV[1] rollback JSON, ARGV[2] now
# (unix s), ARGV[3] rollbacks kept. Returns 1 when percent went to 0, 0 when it already was 0.
_ROLLBACK = """
local pct = tonumber(redis.call('HGET', KEYS[1], 'percent') or '0')
if not pct or pct <= 0 then return 0 end
redis.call('HSET', KEYS[1], 'percent', '0', 'updated_at', ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[3]), -1)
return 1
"""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything `pdorch migrate status` shows."""

    name: str
    config: dict[str, Any]
    counters: dict[str, int]
    windows: dict[str, dict[str, Any]]
    rollbacks: list[dict[str, Any]]
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            **self.config,
            "counters": self.counters,
            "windows": self.windows,
            "rollbacks": self.rollbacks,
            "samples": self.samples,
        }


_CONFIG_JSON = ("upstreams", "limits", "pricing")
_CONFIG_FLOAT = ("percent", "sample", "started_at", "updated_at")


class MigrationState:
    def __init__(
        self, url: str, name: str, prefix: str = DEFAULT_PREFIX, timeout_s: float = 2.0
    ) -> None:
        self.name = name
        self.url = url
        keys = Keys(prefix)
        self.key = keys.migration(name)
        self.rollbacks_key = keys.migration_rollbacks(name)
        self.window_key = keys.migration_window(name)
        self.samples_key = keys.migration_samples(name)
        try:
            # redis-py's stubs type replies as bytes | str | None whatever decode_responses says
            self._redis: Any = aioredis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                decode_responses=True,
            )
        except ValueError as exc:
            raise errors.ConfigError("--redis", str(exc)) from exc
        self._rollback: Any = self._redis.register_script(_ROLLBACK)

    async def close(self) -> None:
        await self._redis.aclose()

    async def _call(self, op: Awaitable[T]) -> T:
        try:
            return await op
        except (rexc.ConnectionError, rexc.TimeoutError) as exc:
            raise errors.UnavailableError(f"redis {redacted(self.url)}: {exc}") from exc
        except rexc.RedisError as exc:
            raise errors.UnavailableError(f"redis {redacted(self.url)}: {exc}") from exc

    # ------------------------------------------------------------------------- config

    async def start(self, settings: MigrationSettings) -> None:
        """Write the migration's settings (a restart with new flags replaces them; counters,
        rollbacks and samples stay)."""
        now = time.time()
        up = settings.upstreams
        fields = {
            "mode": settings.mode,
            "percent": str(settings.percent if settings.mode == "canary" else 0.0),
            "sample": str(settings.sample if settings.mode == "shadow" else 0.0),
            # as `status` and the report show them: a password in a URL is not kept
            "upstreams": json.dumps(
                {"existing": redacted(up.existing), "pdorch": redacted(up.pdorch)}
            ),
            "limits": json.dumps(_fields(settings.limits)),
            "pricing": json.dumps(_fields(settings.pricing)),
            "updated_at": str(now),
        }
        pipe = self._redis.pipeline(transaction=True)
        pipe.hsetnx(self.key, "started_at", str(now))
        pipe.hset(self.key, mapping=fields)
        pipe.delete(self.window_key)
        await self._call(pipe.execute())

    async def set_percent(self, percent: float) -> None:
        """Re-arm (or change) a canary by hand."""
        if not await self._call(self._redis.exists(self.key)):
            raise errors.NotFoundError(f"no migration named {self.name!r}")
        mode = await self._call(self._redis.hget(self.key, "mode"))
        if mode != "canary":
            raise errors.ConfigError("--percent", f"migration {self.name!r} is in {mode} mode")
        await self._call(
            self._redis.hset(
                self.key, mapping={"percent": str(percent), "updated_at": str(time.time())}
            )
        )

    async def current(self) -> tuple[str, float, float]:
        """(mode, percent, sample) as stored now."""
        mode, pct, sample = await self._call(
            self._redis.hmget(self.key, ["mode", "percent", "sample"])
        )
        if mode is None:
            raise errors.NotFoundError(f"no migration named {self.name!r}")
        return str(mode), float(pct or 0.0), float(sample or 0.0)

    # ------------------------------------------------------------------------ records

    async def record(
        self,
        samples: Sequence[Sample],
        windows: dict[str, WindowStats],
        max_samples: int,
        skipped: int = 0,
    ) -> None:
        """Append samples, bump counters and store the windows, in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for s in samples:
            pipe.xadd(
                self.samples_key,
                {"s": json.dumps(s.to_dict(), separators=(",", ":"))},
                maxlen=max_samples,
                approximate=True,
            )
            pipe.hincrby(self.key, f"requests:{s.path}", 1)
            if s.failed:
                pipe.hincrby(self.key, f"failures:{s.path}", 1)
        if skipped:
            pipe.hincrby(self.key, "shadow_skipped", skipped)
        if windows:
            pipe.hset(
                self.window_key,
                mapping={path: json.dumps(w.to_dict()) for path, w in windows.items()},
            )
        await self._call(pipe.execute())

    async def rollback(self, reason: str, percent_before: float, stats: WindowStats) -> bool:
        """Percent to 0 with the reason recorded; False if it was 0 already."""
        now = time.time()
        entry = {
            "ts": now,
            "reason": reason,
            "percent_before": percent_before,
            "stats": stats.to_dict(),
        }
        done = await self._call(
            self._rollback(
                keys=[self.key, self.rollbacks_key],
                args=[json.dumps(entry), str(now), str(ROLLBACKS_KEPT)],
            )
        )
        return bool(done)

    # ------------------------------------------------------------------------ reading

    async def snapshot(self) -> Snapshot:
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self.key)
        pipe.hgetall(self.window_key)
        pipe.lrange(self.rollbacks_key, 0, -1)
        pipe.xlen(self.samples_key)
        raw, windows, rollbacks, count = await self._call(pipe.execute())
        if not raw:
            raise errors.NotFoundError(f"no migration named {self.name!r} in {redacted(self.url)}")
        config: dict[str, Any] = {}
        counters: dict[str, int] = {}
        for k, v in raw.items():
            if k.startswith(("requests:", "failures:")) or k == "shadow_skipped":
                counters[k] = int(v)
            elif k in _CONFIG_JSON:
                config[k] = json.loads(v)
            elif k in _CONFIG_FLOAT:
                config[k] = float(v)
            else:
                config[k] = v
        return Snapshot(
            name=self.name,
            config=config,
            counters=counters,
            windows={p: json.loads(w) for p, w in sorted(windows.items())},
            rollbacks=[json.loads(r) for r in rollbacks],
            samples=int(count),
        )

    async def samples(self, batch: int = 1000) -> list[Sample]:
        """Every sample kept, oldest first."""
        out: list[Sample] = []
        start = "-"
        while True:
            page = await self._call(
                self._redis.xrange(self.samples_key, min=start, max="+", count=batch)
            )
            for entry_id, fields in page:
                out.append(Sample.from_dict(json.loads(fields["s"])))
                start = f"({entry_id}"
            if len(page) < batch:
                return out


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
