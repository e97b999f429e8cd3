"""The lifecycle table (`orchestrator.core.state`) rendered as Lua, for the store's scripts.

Every script that reads or writes a request's state starts with `PRELUDE`, so the states, the
terminal set and the edges exist in exactly one place (Python) and Redis can't drift from it:

    TERMINAL   set of terminal state names          TERMINAL['done'] == true
    EDGES      edge name -> {src = set, dst = name, bump = 0|1}
    INITIAL    the state a request is created in
    now_ms()   Redis's clock in milliseconds, as a string (the `updated_at` field)
"""

from __future__ import annotations

from orchestrator.core.state import INITIAL, TERMINAL, Edge, State


def _set(states: frozenset[State]) -> str:
    return "{" + ", ".join(f"{s}=true" for s in sorted(states)) + "}"


def render_prelude() -> str:
    edges = ",\n  ".join(
        f"{e.wire}={{src={_set(e.sources)}, dst='{e.target}', bump={int(e.rule.bumps_epoch)}}}"
        for e in Edge
    )
    return (
        f"local TERMINAL = {_set(TERMINAL)}\n"
        f"local EDGES = {{\n  {edges}\n}}\n"
        f"local INITIAL = '{INITIAL}'\n"
        "local function now_ms()\n"
        "  local t = redis.call('TIME')\n"
        "  return tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))\n"
        "end\n"
    )


PRELUDE = render_prelude()
