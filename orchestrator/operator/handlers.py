"""kopf handlers for DisaggregatedService: the thin layer between kopf and `reconcile`.

    create / update(spec) / resume   reconcile now
    timer (every resync interval)    reconcile again: level-triggered repair of drift and a
                                     fresh status from the children's readiness
    delete                           tear the children down (kopf holds a finalizer meanwhile)

All passes over one resource are serialized by a lock, so a timer tick never interleaves
with an update. A pass in which the API refused some objects still writes its status
(`Reconciled` False, with the API's messages) and logs a warning (posted as an event); when
a refusal was transient (a conflict, a busy server) the handler then raises TemporaryError
so that kopf tries again soon (kopf writes the status patch either way). Errors that end a
pass are translated here and only here into kopf's: a transient API error → TemporaryError
(kopf retries soon), anything else → PermanentError (logged and posted as an event; the
next timer tick tries again anyway).

Settings we give kopf, and why:
- scanning disabled: kopf would otherwise list/watch namespaces and CRDs cluster-wide;
  the operator's RBAC is a namespaced Role, and the CRD is installed before it starts;
- progress and diff-base kept in annotations under pdorch.io (the status belongs to us);
- events posted only for warnings and errors (a timer succeeding every 30 s is no news).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

import kopf

from orchestrator.operator import health
from orchestrator.operator.config import OperatorConfig
from orchestrator.operator.drift import contains
from orchestrator.operator.errors import KubeApiError, OperatorError, SpecError
from orchestrator.operator.kube import Connection, KubeClient
from orchestrator.operator.naming import GROUP, PLURAL, VERSION, Identity
from orchestrator.operator.reconcile import reconcile, teardown

_RESOURCE = (GROUP, VERSION, PLURAL)


class _Runtime:
    """What the handlers share: the API client for the current credentials, and a lock per
    resource."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self._info: kopf.ConnectionInfo | None = None
        self._client: KubeClient | None = None
        self._client_info: kopf.ConnectionInfo | None = None
        self._locks: dict[str, asyncio.Lock] = {}

    def use_credentials(self, info: kopf.ConnectionInfo) -> None:
        self._info = info

    async def client(self) -> KubeClient:
        """The client for the latest login (kopf logs in again when a token expires)."""
        if self._client is not None and self._client_info is self._info:
            return self._client
        if self._info is None:
            raise kopf.TemporaryError("not logged in to the API yet", delay=1)
        await self.close()
        info = self._info
        connection = Connection(
            server=info.server,
            headers=info.as_http_headers(),
            ssl_context=info.as_ssl_context() if info.server.startswith("https") else None,
        )
        self._client = KubeClient(connection, timeout_s=self.config.api_timeout_s)
        self._client_info = info
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        self._locks.pop(uid, None)


def identity_of(body: Mapping[str, Any]) -> Identity:
    meta = body["metadata"]
    return Identity(
        name=meta["name"],
        namespace=meta["namespace"],
        uid=meta.get("uid", ""),
        generation=meta.get("generation"),
    )


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _unless_stopped(
    work: Coroutine[Any, Any, None], stopped: kopf.DaemonStopped, name: str
) -> None:
    """Run one timer pass, abandoning it if the operator stops (or the resource goes)
    meanwhile: kopf does not cancel a running timer at exit but leaves it orphaned, and a
    pass cut short is harmless (passes are idempotent; the next one converges)."""

    async def until_stopped() -> None:
        await stopped.wait()

    task = asyncio.create_task(work, name=name)
    watch = asyncio.create_task(until_stopped(), name=f"{name}: stop watch")
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if not task.cancelled():
        task.result()  # the pass's own error, if any


def _write_status(patch: kopf.Patch, current: Mapping[str, Any], status: Mapping[str, Any]) -> None:
    """Patch the status to `status`, removing keys it no longer has (e.g. the dev Redis's
    counts); nothing at all when it is unchanged, so that a quiet resync neither writes
    nor wakes the resource's watchers."""
    stale = [key for key in current if key not in status]
    if stale or not contains(current, status):
        patch.status.update({**status, **dict.fromkeys(stale)})


def _translate(exc: OperatorError, delay: float) -> kopf.TemporaryError | kopf.PermanentError:
    if isinstance(exc, KubeApiError) and exc.transient:
        return kopf.TemporaryError(str(exc), delay=delay)
    return kopf.PermanentError(str(exc))


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler into `registry`, closed over `config` (nothing global)."""
    rt = _Runtime(config)
    _register_process(registry, config, rt)
    _register_resource(registry, config, rt)


def _register_process(
    registry: kopf.OperatorRegistry, config: OperatorConfig, rt: _Runtime
) -> None:
    """The operator process's own handlers: settings, login, cleanup."""

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True
        settings.persistence.finalizer = f"{GROUP}/operator"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if config.server:
            info: kopf.ConnectionInfo | None = kopf.ConnectionInfo(server=config.server)
        else:
            info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            rt.use_credentials(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await rt.close()


def _register_resource(
    registry: kopf.OperatorRegistry, config: OperatorConfig, rt: _Runtime
) -> None:
    """The DisaggregatedService handlers: converge on create/update/resume/resync, teardown."""

    async def converge(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> None:
        previous = body.get("status", {}).get("conditions") or []
        try:
            identity = identity_of(body)
        except SpecError as exc:
            logger.warning("invalid resource: %s", exc)
            patch.status.update(health.invalid_spec(str(exc), None, previous, _now()))
            return
        async with rt.lock(identity.uid):
            try:
                client = await rt.client()
                status, outcome = await reconcile(client, identity, body.spec, previous, _now())
            except OperatorError as exc:
                raise _translate(exc, config.retry_delay_s) from exc
        _write_status(patch, body.get("status", {}), status)
        if outcome is None:
            logger.warning("spec not applied: %s", status["conditions"][0]["message"])
        else:
            if outcome.changes() or outcome.pruned:
                logger.info("applied %s; pruned %s", outcome.changes(), list(outcome.pruned))
            if outcome.foreign():
                logger.warning("names taken by objects we don't control: %s", outcome.foreign())
            if outcome.failures:
                logger.warning("refused by the API: %s", outcome.failed())
                if outcome.retry_soon:
                    raise kopf.TemporaryError(
                        f"refused for now: {sorted(outcome.failures)}", delay=config.retry_delay_s
                    )

    @kopf.on.create(*_RESOURCE, id="create", registry=registry)
    @kopf.on.update(*_RESOURCE, id="update", field="spec", registry=registry)
    @kopf.on.resume(*_RESOURCE, id="resume", registry=registry)
    async def on_change(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
        await converge(body, patch, logger)

    @kopf.timer(*_RESOURCE, id="resync", interval=config.resync_interval_s, registry=registry)
    async def on_timer(
        body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **kwargs: Any
    ) -> None:
        stopped: kopf.DaemonStopped = kwargs["stopped"]  # not in kopf's TimerFn protocol
        name = f"resync {body.meta.namespace}/{body.meta.name}"
        await _unless_stopped(converge(body, patch, logger), stopped, name)

    @kopf.on.delete(*_RESOURCE, id="delete", registry=registry)
    async def on_delete(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        try:
            identity = identity_of(body)
        except SpecError:
            return  # never rendered: there are no children
        async with rt.lock(identity.uid):
            try:
                deleted = await teardown(await rt.client(), identity)
            except OperatorError as exc:
                raise _translate(exc, config.retry_delay_s) from exc
        rt.forget(identity.uid)
        logger.info("deleted %s", deleted)
