"""The least each pdorch process needs from Redis, as Redis 6+ ACL rules.

One place: the README's table is these rules, and the tests run the store's contract suite
(and a worker's and a migration's calls) as a user holding nothing more, so the list is
proved sufficient, not guessed. Key patterns follow `orchestrator.store.keys`; scripts are
run with EVALSHA, and EVAL / SCRIPT LOAD re-send them after Redis lost its script cache.

    orchestrator   every request key, the indexes, worker heartbeats (read), tenant costs
    worker         its heartbeat key and the workers index, nothing else
    migrate        the migration's own keys
"""

from __future__ import annotations

from orchestrator.store.keys import DEFAULT_PREFIX

_SCRIPTS = ("evalsha", "eval", "script|load")
_TRANSACTIONS = ("multi", "exec", "discard")

COMMANDS: dict[str, tuple[str, ...]] = {
    "orchestrator": (
        "ping", "time",
        "get", "set", "mget", "exists", "del", "expire", "pexpire",
        "hset", "hget", "hmget", "hgetall", "hincrby", "hincrbyfloat",
        "sadd", "srem", "smembers",
        "zadd", "zrem", "zrange", "zscore", "zcard",
        "rpush", "lrange",
        *_SCRIPTS, *_TRANSACTIONS,
    ),
    "worker": ("ping", "set", "del", "sadd", "srem"),
    "migrate": (
        "ping", "exists", "del",
        "hset", "hsetnx", "hget", "hmget", "hgetall", "hincrby",
        "rpush", "lrange", "ltrim",
        "xadd", "xlen", "xrange",
        *_SCRIPTS, *_TRANSACTIONS,
    ),
}  # fmt: skip
"""Role -> the commands it sends (directly or from its Lua scripts)."""


def key_patterns(role: str, prefix: str = DEFAULT_PREFIX) -> tuple[str, ...]:
    """Role -> the key patterns (Redis glob) it touches under ``prefix``."""
    return {
        "orchestrator": (f"{prefix}:*",),
        "worker": (f"{prefix}:worker:*", f"{prefix}:workers"),
        "migrate": (f"{prefix}:migrate:*",),
    }[role]


def acl_rules(role: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The ``ACL SETUSER`` rules (after the user's name and password) for ``role``: no
    command, key or channel but those listed."""
    keys = " ".join(f"~{p}" for p in key_patterns(role, prefix))
    commands = " ".join(f"+{c}" for c in COMMANDS[role])
    return f"resetkeys {keys} resetchannels -@all {commands}"
