"""A small async client for the Kubernetes REST API: get, create, merge-patch, delete.

The only module of the operator that makes HTTP calls (kopf makes its own for watching the
resource). It knows just the kinds `render` produces, addressed by `naming.Ref`, and maps
every failure to `errors`: no answer → KubeUnreachableError, 409 → ObjectConflictError,
any other error status → KubeApiError. A 404 is an answer, not an error: `get` returns
None, `delete` returns False.

Credentials come from kopf's login (see `handlers`) as ready-made headers and an SSL
context, so token rotation and kubeconfig parsing stay kopf's business.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from orchestrator.operator.errors import (
    KubeApiError,
    KubeUnreachableError,
    ObjectConflictError,
)
from orchestrator.operator.naming import Ref

# The kinds the operator manages → their resource (plural) names in URLs.
PLURALS: Mapping[str, str] = {
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Service": "services",
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "Certificate": "certificates",  # cert-manager.io
}

_MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "pdorch-operator"  # tells our calls from kopf's in API server audit logs


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to authenticate to it."""

    server: str  # e.g. https://10.0.0.1:443, or http://127.0.0.1:8001 behind `kubectl proxy`
    headers: Mapping[str, str] = field(default_factory=dict)  # Authorization, if any
    ssl_context: ssl.SSLContext | None = None  # CA and client certificate; None: defaults


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    try:
        plural = PLURALS[kind]
    except KeyError:
        raise ValueError(f"the operator does not manage kind {kind!r}") from None
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}"


def object_path(ref: Ref) -> str:
    return f"{collection_path(ref.api_version, ref.kind, ref.namespace)}/{ref.name}"


class KubeClient:
    """One HTTP session to the API server; close it with `close`."""

    def __init__(self, connection: Connection, *, timeout_s: float = 10.0) -> None:
        self.connection = connection
        self._session = aiohttp.ClientSession(
            headers={"User-Agent": USER_AGENT, **connection.headers},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )

    async def close(self) -> None:
        await self._session.close()

    async def get(self, ref: Ref) -> dict[str, Any] | None:
        status, body = await self._call("GET", object_path(ref))
        if status == 404:
            return None
        return _checked(status, body, f"get {ref}")

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        ref = Ref.of(obj)
        path = collection_path(ref.api_version, ref.kind, ref.namespace)
        status, body = await self._call("POST", path, json.dumps(obj))
        return _checked(status, body, f"create {ref}")

    async def patch(self, ref: Ref, body: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): maps merge, lists and scalars replace."""
        status, answer = await self._call(
            "PATCH", object_path(ref), json.dumps(body), content_type=_MERGE_PATCH
        )
        return _checked(status, answer, f"patch {ref}")

    async def delete(self, ref: Ref) -> bool:
        """Delete, letting the garbage collector remove what the object owns (ReplicaSets,
        pods) in the background. False when it did not exist."""
        path = f"{object_path(ref)}?propagationPolicy=Background"
        status, body = await self._call("DELETE", path)
        if status == 404:
            return False
        _checked(status, body, f"delete {ref}")
        return True

    async def _call(
        self,
        method: str,
        path: str,
        data: str | None = None,
        *,
        content_type: str = "application/json",
    ) -> tuple[int, Any]:
        url = self.connection.server.rstrip("/") + path
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        ssl_arg: ssl.SSLContext | bool = self.connection.ssl_context or True
        try:
            async with self._session.request(
                method, url, data=data, headers=headers, ssl=ssl_arg
            ) as rsp:
                text = await rsp.text()
                return rsp.status, _json_or_text(text)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeUnreachableError(f"{method} {path}: {exc!r}") from exc


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return text


def _checked(status: int, body: Any, what: str) -> dict[str, Any]:
    if 200 <= status < 300 and isinstance(body, dict):
        return body
    if isinstance(body, dict):
        reason = str(body.get("reason") or "Error")
        message = str(body.get("message") or body)
    else:
        reason, message = "Error", str(body)[:500]
    if status == 409:
        raise ObjectConflictError(status, reason, f"{what}: {message}")
    raise KubeApiError(status, reason, f"{what}: {message}")
