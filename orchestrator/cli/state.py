"""Where a running `pdorch up` cluster is: the small state file it writes, and how the
client commands (`generate`, `cost`, `status`, `down`) find their endpoints without flags.

An endpoint comes from, in order: the flag, the environment (``PDORCH_ORCHESTRATOR``,
``PDORCH_REDIS_URL``), the state file of a `pdorch up` still running — or of one killed
(SIGKILL: it could not stop its processes) whose orchestrator still serves, the cluster
`pdorch down` stops — the built-in default.
The file lives at ``$PDORCH_STATE`` if set, else ``$XDG_STATE_HOME/pdorch/up.json`` (else
``~/.local/state/pdorch/up.json``); one `pdorch up` at a time owns it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from orchestrator.procs import alive, group_runs, pid_taken, started

ORCHESTRATOR_ENV = "PDORCH_ORCHESTRATOR"
REDIS_ENV = "PDORCH_REDIS_URL"
STATE_ENV = "PDORCH_STATE"
TLS_ENV = "PDORCH_TLS_DIR"
ORCHESTRATOR_PROC = "orchestrator-0"
"""The process serving `ClusterState.orchestrator` (`LocalCluster.start_orchestrator`)."""


@dataclass(frozen=True, slots=True)
class ClusterState:
    """What `pdorch up` publishes about the cluster it runs."""

    pid: int
    """The `pdorch up` process: `pdorch down` sends it SIGTERM."""
    orchestrator: str
    """gRPC client API, host:port."""
    redis: str
    """The cluster's Redis URL."""
    http: str = ""
    """OpenAI-compatible base URL (``http://HOST:PORT/v1``); "" when not served."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Process name -> its Prometheus ``/metrics`` URL."""
    model: str = ""
    """The model name the gateway serves."""
    logs: str = ""
    """Folder holding every process's log."""
    tls: str = ""
    """The cluster's TLS directory (its throwaway CA); "" when it runs plaintext."""
    procs: dict[str, list[int]] = field(default_factory=dict)
    """Process name -> [pid, start time] (`started`) of every process it started (each
    worker and orchestrator leads its own process group): what `pdorch down` stops when
    `pdorch up` itself was killed (SIGKILL leaves them running). Written as each one
    starts, so a `pdorch up` killed while starting leaves them listed too."""
    ready: bool = True
    """False while `pdorch up` is still starting: the endpoints are not served yet (the
    client commands see no cluster; `up` refuses a second one; `down` stops it). A file
    without the field was written once the cluster was up."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def state_path(env: Mapping[str, str]) -> Path:
    if env.get(STATE_ENV):
        return Path(env[STATE_ENV])
    base = env.get("XDG_STATE_HOME") or str(
        Path(env.get("HOME", "~")).expanduser() / ".local/state"
    )
    return Path(base) / "pdorch" / "up.json"


def _file_state(env: Mapping[str, str]) -> ClusterState | None:
    """The state file's contents; None when there is none or it is unreadable."""
    try:
        return ClusterState.from_json(state_path(env).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def live_state(env: Mapping[str, str]) -> ClusterState | None:
    """The state of a `pdorch up` that runs, up or still starting; None when there is no
    file, it is unreadable, or the `pdorch up` that wrote it is gone (a killed run's)."""
    state = _file_state(env)
    return state if state is not None and alive(state.pid) else None


def read_state(env: Mapping[str, str]) -> ClusterState | None:
    """The state of the cluster the client commands talk to: the running `pdorch up`'s once
    it serves (`live_state`, ``ready``), else the one a killed `pdorch up` left serving
    (`orphaned_state`); None otherwise."""
    state = live_state(env)
    if state is not None:
        return state if state.ready else None
    return orphaned_state(env)


def orphaned_state(env: Mapping[str, str]) -> ClusterState | None:
    """The state a `pdorch up` killed once its cluster served left behind (`stale_state`,
    ``ready``), while the orchestrator serving its endpoint (`ORCHESTRATOR_PROC`) still
    runs — the process it started, not one that took the pid over since (`ours`); None
    otherwise. `pdorch down` stops such a cluster."""
    state = stale_state(env)
    if state is None or not state.ready:
        return None
    pid, start = state.procs.get(ORCHESTRATOR_PROC, (0, 0))
    return state if ours(pid, start) else None


def stale_state(env: Mapping[str, str]) -> ClusterState | None:
    """The state a `pdorch up` that is gone left behind (it was killed: it removes its file
    when it stops); None when there is none, or its `pdorch up` still runs."""
    state = _file_state(env)
    return state if state is not None and not alive(state.pid) else None


def ours(pid: int, start: int) -> bool:
    """Whether the process that started as ``pid`` at ``start`` (`started`) still runs —
    not another one that took the pid over since."""
    return bool(start) and alive(pid) and started(pid) == start


def group_ours(pid: int, start: int) -> bool:
    """Whether process group ``pid`` is still the one led by the process that started as
    ``pid`` at ``start`` (`started`): that process is still there (running, or exited and
    not reaped), or no process has the pid any more. Linux hands out no pid in use as a
    process group's id, so while the group has members its killed leader's pid is not
    reused; a pid another process has taken since means the group is empty."""
    if start and started(pid) == start:
        return True
    return not pid_taken(pid)


def still_running(state: ClusterState, name: str) -> bool:
    """Whether process ``name`` of a killed `pdorch up` (``state``) still runs as it
    started it: the process itself (pid and start time), or its group while that is still
    its own (`group_ours`) and has members — a worker killed alone (``kill -9``) leaves its
    group running (a vLLM worker's engine core)."""
    pid, start = state.procs[name]
    return ours(pid, start) or (group_ours(pid, start) and group_runs(pid))


def leftovers(state: ClusterState) -> list[str]:
    """The processes of a killed `pdorch up` (``state``) still running (`still_running`),
    by name: what `pdorch down` stops, and why a new `pdorch up` must not overwrite the
    state file that lists them."""
    return sorted(name for name in state.procs if still_running(state, name))


def write_state(env: Mapping[str, str], state: ClusterState) -> Path:
    path = state_path(env)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.to_json() + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def remove_state(env: Mapping[str, str], pid: int) -> None:
    """Remove the state file if it is still ``pid``'s."""
    path = state_path(env)
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        if ClusterState.from_json(path.read_text(encoding="utf-8")).pid == pid:
            path.unlink()


def orchestrator_default(env: Mapping[str, str], builtin: str) -> str:
    if env.get(ORCHESTRATOR_ENV):
        return env[ORCHESTRATOR_ENV]
    state = read_state(env)
    return state.orchestrator if state is not None else builtin


def redis_default(env: Mapping[str, str], builtin: str) -> str:
    if env.get(REDIS_ENV):
        return env[REDIS_ENV]
    state = read_state(env)
    return state.redis if state is not None else builtin


def tls_default(env: Mapping[str, str]) -> str:
    """``$PDORCH_TLS_DIR``, else the running `pdorch up` cluster's TLS directory, else ""."""
    if env.get(TLS_ENV):
        return env[TLS_ENV]
    state = read_state(env)
    return state.tls if state is not None else ""
