"""The operator's API client: URLs, 404 semantics and error translation, over real HTTP."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from kmock import KubernetesEmulator, KubernetesError, Server

from orchestrator.operator.errors import KubeApiError, KubeUnreachableError, ObjectConflictError
from orchestrator.operator.kube import Connection, KubeClient, collection_path, object_path
from orchestrator.operator.naming import Ref

CM = Ref("v1", "ConfigMap", "ns", "c")
CONFIG_MAP = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}}


def run(scenario: Callable[[KubeClient, Any], Awaitable[None]]) -> None:
    """Run `scenario(client, emulator)` against a fresh emulator on a loopback port."""

    async def main() -> None:
        async with KubernetesEmulator() as emulator, Server(emulator) as server:
            client = KubeClient(Connection(server=str(server.url)), timeout_s=5)
            try:
                await scenario(client, emulator)
            finally:
                await client.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("ref", "path"),
    [
        (CM, "/api/v1/namespaces/ns/configmaps/c"),
        (Ref("apps/v1", "Deployment", "ns", "d"), "/apis/apps/v1/namespaces/ns/deployments/d"),
        (
            Ref("networking.k8s.io/v1", "NetworkPolicy", "ns", "n"),
            "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies/n",
        ),
        (
            Ref("policy/v1", "PodDisruptionBudget", "ns", "p"),
            "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/p",
        ),
    ],
)
def test_paths(ref: Ref, path: str) -> None:
    assert object_path(ref) == path


def test_an_unmanaged_kind_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="Secret"):
        collection_path("v1", "Secret", "ns")


def test_create_get_patch_delete() -> None:
    async def scenario(client: KubeClient, _: Any) -> None:
        assert await client.get(CM) is None
        await client.create(CONFIG_MAP | {"data": {"a": "1", "b": "2"}})
        await client.patch(CM, {"data": {"a": "3", "b": None}})  # merge patch: null removes
        live = await client.get(CM)
        assert live is not None
        assert live["data"] == {"a": "3"}
        assert await client.delete(CM) is True
        assert await client.delete(CM) is False
        assert await client.get(CM) is None

    run(scenario)


def test_creating_an_existing_object_is_a_conflict() -> None:
    async def scenario(client: KubeClient, _: Any) -> None:
        await client.create(CONFIG_MAP)
        with pytest.raises(ObjectConflictError) as info:
            await client.create(CONFIG_MAP)
        assert info.value.status == 409
        assert info.value.transient

    run(scenario)


@pytest.mark.parametrize(("status", "transient"), [(403, False), (422, False), (503, True)])
def test_error_statuses_are_translated(status: int, transient: bool) -> None:
    async def scenario(client: KubeClient, emulator: Any) -> None:
        emulator["get /api/v1/namespaces/ns/configmaps/c"] << KubernetesError(
            status=status, reason="Nope", message="refused"
        )
        with pytest.raises(KubeApiError) as info:
            await client.get(CM)
        assert (info.value.status, info.value.reason, info.value.transient) == (
            status,
            "Nope",
            transient,
        )
        assert "refused" in str(info.value)

    run(scenario)


def test_no_server_is_unreachable_and_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody listens once closed

    async def main() -> None:
        client = KubeClient(Connection(server=f"http://127.0.0.1:{port}"), timeout_s=2)
        try:
            with pytest.raises(KubeUnreachableError) as info:
                await client.get(CM)
            assert info.value.transient
        finally:
            await client.close()

    asyncio.run(main())
