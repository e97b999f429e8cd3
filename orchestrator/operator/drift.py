"""Has a live child drifted from what we rendered, and what may a patch of it touch (pure).

The API server adds to what we send (defaults, status, its own metadata), so "drifted" means:
some value we rendered is not in the live object. Extra keys in the live object are fine;
a list we rendered must match element by element (each element compared the same way), as
a JSON merge patch replaces lists whole.

A merge patch never removes a map key it does not mention, so the maps we render whole
(`OWNED_MAPS`: a ConfigMap's data, a pod's node selector) are compared exactly, and the
patch sets keys we no longer render to null. (Containers, env, tolerations are lists: a
patch replaces them whole anyway.)

Fields the API server refuses to change after creation are left out of both the comparison
and the patch: a change there cannot be applied by patching, and trying would fail every
resync. (The spec never changes them: selectors and names are fixed by `naming`.)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

# Per kind: paths (from the object's root) that are immutable once created.
IMMUTABLE: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "Deployment": (("spec", "selector"),),
    "StatefulSet": (
        ("spec", "selector"),
        ("spec", "serviceName"),
        ("spec", "volumeClaimTemplates"),
        ("spec", "podManagementPolicy"),
    ),
    "Service": (("spec", "clusterIP"),),
}


# Per kind: maps whose every key is ours (keys we stop rendering must go).
OWNED_MAPS: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "ConfigMap": (("data",),),
    "Deployment": (("spec", "template", "spec", "nodeSelector"),),
}


def patchable(desired: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a rendered object a merge patch may carry: metadata we own and the
    mutable rest, never apiVersion/kind/name/namespace (they address the object)."""
    body = copy.deepcopy({k: v for k, v in desired.items() if k not in ("apiVersion", "kind")})
    meta = body.get("metadata", {})
    body["metadata"] = {
        k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta
    }
    for path in IMMUTABLE.get(str(desired.get("kind")), ()):
        parent: Any = body
        for key in path[:-1]:
            parent = parent.get(key, {}) if isinstance(parent, dict) else {}
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    return body


def drifted(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Whether `live` lacks or contradicts anything of `desired` that a patch could fix, or
    has a key in a map we own that we no longer render."""
    if not contains(live, patchable(desired)):
        return True
    return any(_stale_keys(desired, live, path) for path in _owned_maps(desired))


def patch_for(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that makes `live` what we render: `patchable(desired)`, plus null
    for every stale key of the maps we own."""
    body = patchable(desired)
    for path in _owned_maps(desired):
        stale = _stale_keys(desired, live, path)
        if stale:
            node = body
            for key in path[:-1]:
                node = node.setdefault(key, {})
            target = node.get(path[-1])
            if not isinstance(target, dict):
                target = node[path[-1]] = {}
            target.update(dict.fromkeys(stale))
    return body


def _owned_maps(desired: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    return OWNED_MAPS.get(str(desired.get("kind")), ())


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _stale_keys(
    desired: Mapping[str, Any], live: Mapping[str, Any], path: tuple[str, ...]
) -> list[str]:
    wanted = _get(desired, path) or {}
    have = _get(live, path) or {}
    return sorted(k for k in have if k not in wanted) if isinstance(have, Mapping) else []


def contains(live: Any, desired: Any) -> bool:
    """`desired` is a sub-structure of `live`: every key it has, with a value `live` contains;
    lists of equal length, element-wise; other values equal."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            key in live and contains(live[key], value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(live) == len(desired)
            and all(contains(lv, dv) for lv, dv in zip(live, desired, strict=True))
        )
    return bool(live == desired)


def owned_by(live: Mapping[str, Any], uid: str) -> bool:
    """Whether `live` is controlled by the resource with this uid (we never touch an object
    of the same name that someone else made)."""
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)
