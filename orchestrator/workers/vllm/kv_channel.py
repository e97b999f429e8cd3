"""The local control link between the pdorch decode worker and its connector. Protocol: pure.

The decode side's `KvReceiver` lives inside vLLM's worker process (where the KV lands and is
copied into blocks); the pdorch worker process reaches it through one Unix socket that
`kv.DecodeKvControl` listens on (a private 0700 directory: the file system authenticates the
peer) and the connector connects to. Messages are JSON objects, one per line:

    connector -> pdorch   {"op": "hello", "kv_address": "host:port", "backend": "tcp"}
    pdorch -> connector   {"id": n, "op": "release", "request_id": str, "epoch": int}
                          {"id": n, "op": "stats"}
    connector -> pdorch   {"id": n, "released": bool} | {"id": n, "held_bytes": int}
                          | {"id": n, "error": str}
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE = 64 * 1024
"""Longest message either side reads (a request id is at most a few hundred bytes)."""


class ChannelError(Exception):
    """A malformed control message: the link is dropped."""


def encode(msg: dict[str, Any]) -> bytes:
    line = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise ChannelError(f"control message of {len(line)} bytes exceeds {MAX_LINE}")
    return line


def decode(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ChannelError(f"control message of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        msg = json.loads(line)
    except ValueError as exc:
        raise ChannelError(f"control message is not JSON: {exc}") from exc
    if not isinstance(msg, dict):
        raise ChannelError(f"control message must be an object, got {type(msg).__name__}")
    return msg
