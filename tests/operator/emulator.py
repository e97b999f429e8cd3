"""kmock's Kubernetes API emulator on a loopback port, and a small synchronous client for it.

The emulator (kmock, by kopf's author) keeps objects in memory and serves discovery, list,
watch, get, create, merge-patch and delete over real HTTP. What it does not do, and what
the tests therefore do themselves, in the role of the missing cluster components:

- no controllers: a Deployment gets no pods and no status; the tests patch
  ``status.readyReplicas`` as the Deployment controller would when pods become (un)ready;
- no garbage collector: owner references are not acted on (the operator deletes children
  itself, so "resource deleted → children gone" is tested without it);
- no schema validation, no metadata.uid/generation/resourceVersion: the tests set them on
  the resources they create (kopf's finalizer patches test the resourceVersion it saw).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp.web
import attrs
from kmock import KubernetesEmulator, ResourceInfo, Server

T = TypeVar("T")

# group/version/plural → (kind, namespaced): every resource the operator or kopf touches.
RESOURCES = {
    "pdorch.io/v1alpha1/disaggregatedservices": ("DisaggregatedService", True),
    # kopf resolves these at startup even with cluster scanning disabled.
    "v1/namespaces": ("Namespace", False),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
    "v1/events": ("Event", True),
    # The operator's children.
    "v1/serviceaccounts": ("ServiceAccount", True),
    "v1/configmaps": ("ConfigMap", True),
    "v1/services": ("Service", True),
    "apps/v1/deployments": ("Deployment", True),
    "apps/v1/statefulsets": ("StatefulSet", True),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True),
    "cert-manager.io/v1/certificates": ("Certificate", True),  # as if cert-manager were in
}
_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
_KMOCK_HISTORY = 16  # more than the requests in flight at once


@attrs.frozen
class Call:
    user_agent: str
    method: str
    path: str
    query: str


@attrs.define(kw_only=True)
class _RecordingEmulator(KubernetesEmulator):
    """Also records every request: who made it, and what for (for the RBAC check)."""

    calls: list[Call] = attrs.field(factory=list)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        agent = raw_request.headers.get("User-Agent", "")
        self.calls.append(
            Call(agent, raw_request.method, raw_request.path, raw_request.query_string)
        )
        # kmock 0.8 matches every request against its whole request history (to find which
        # reactions "saw" it), so each request costs O(requests so far): a few thousand
        # requests in, it answers in 100+ ms. Nothing here asserts on kmock's history (we
        # keep our own, above), so keep only the recent part of it.
        del self._requests[:-_KMOCK_HISTORY]
        return await super().__call__(raw_request)


class Emulator:
    """Runs the emulator in a thread with its own event loop; `url` once started."""

    def __init__(self) -> None:
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kmock-emulator", daemon=True)
        self._calls: list[Call] = []

    def calls(self) -> list[Call]:
        """Every request so far (a copy; the list grows in the emulator's thread)."""
        return list(self._calls)

    def start(self) -> Emulator:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"the emulator did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        if self._thread.is_alive():
            raise RuntimeError("the emulator did not stop")

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with _RecordingEmulator() as emulator, Server(emulator) as server:
            self._calls = emulator.calls
            for key, (kind, namespaced) in RESOURCES.items():
                emulator.resources[key] = ResourceInfo(
                    kind=kind,
                    singular=kind.lower(),
                    namespaced=namespaced,
                    verbs=_VERBS,
                    subresources={"status"},
                )
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()


class Api:
    """What `kubectl` would do, plus what the controllers would (status patches)."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url = url
        self.namespace = namespace

    def path(self, resource: str, name: str = "") -> str:
        group_version, plural = resource.rsplit("/", 1)
        root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        return f"{root}/namespaces/{self.namespace}/{plural}" + (f"/{name}" if name else "")

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        status, body = self._call("GET", self.path(resource, name))
        return None if status == 404 else body

    def create(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = self._call("POST", self.path(resource), obj)[1]
        return created

    def patch(
        self, resource: str, name: str, body: dict[str, Any], *, status: bool = False
    ) -> None:
        path = self.path(resource, name) + ("/status" if status else "")
        self._call("PATCH", path, body, "application/merge-patch+json")

    def delete(self, resource: str, name: str) -> None:
        self._call("DELETE", self.path(resource, name))

    def _call(
        self,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=10) as rsp:
                return rsp.status, json.loads(rsp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return 404, None
            raise AssertionError(f"{method} {path}: {exc.code} {exc.read()[:500]!r}") from exc


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 15.0) -> T:
    """Poll `probe` until it returns something truthy, with a deadline (no fixed sleeps)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(delay)  # polling a condition with a deadline
        delay = min(delay * 2, 0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")
