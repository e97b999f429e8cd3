"""`pdorch plan` input: a JSON or TOML document (and flags laid over it) → a PlanRequest. Pure.

Every section and key is optional; what is missing takes the default shown::

    [model]                 # a preset, optionally with fields replaced, or every field
    preset = "llama-3-8b"   # smollm2-135m | llama-3-8b | llama-3-70b
    # layers, hidden, heads, kv_heads, intermediate, vocab, dtype, kv_dtype,
    # tied_embeddings, head_dim, name

    [traffic]
    rate = 20.0                      # requests/s
    prompt = "lognormal:1024:4096"   # or 512, "uniform:128:2048", {dist = "fixed", tokens = 512}
    output = 256

    [slo]
    ttft_ms = 1000.0        # for the percentile prompt
    tpot_ms = 50.0
    percentile = 0.9

    [plan]
    kinds = ["H100", "A100", "L40S", "L4", "T4"]   # colocated, and decode pools
    prefill_kinds = ["H100"]                       # default: the first of kinds
    link_gbps = 100.0
    transfer_usd_per_gb = 0.0
    memory_headroom = 0.1
    max_batch = 256
    max_utilisation = 0.9
    allow_fp16 = false

    [efficiency]
    compute = 0.5
    memory = 0.8
    tp = 0.9

    [prices]                # USD per GPU-hour
    H100 = 2.1

    [gpus.H100]             # any GpuProfile field; a new kind needs the four main ones
    memory_bandwidth_gbs = 3350

Unknown keys, wrong types and out-of-range values raise ConfigError naming the key.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from orchestrator.core.hardware import gpu_table_from_mapping, with_prices
from orchestrator.core.perfmodel import Efficiency, ModelConfig, get_model
from orchestrator.errors import ConfigError
from orchestrator.planning.planner import PlanOptions, PlanRequest
from orchestrator.planning.traffic import Slo, Traffic, parse_length

DEFAULT_KINDS = ("H100", "A100", "L40S", "L4", "T4")
DEFAULT_PRESET = "llama-3-8b"
DEFAULT_RATE = 20.0
"""Requests/s."""
DEFAULT_PROMPT = "lognormal:1024:4096"
DEFAULT_OUTPUT = 256
DEFAULT_TTFT_MS = 1000.0
DEFAULT_TPOT_MS = 50.0
"""The defaults of what has no dataclass default; the rest are the defaults of `Slo`,
`PlanOptions` and `Efficiency`."""

_SECTIONS: dict[str, tuple[str, ...] | None] = {
    "model": (
        "preset",
        "name",
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "intermediate",
        "vocab",
        "dtype",
        "kv_dtype",
        "tied_embeddings",
        "head_dim",
    ),
    "traffic": ("rate", "prompt", "output"),
    "slo": ("ttft_ms", "tpot_ms", "percentile"),
    "plan": (
        "kinds",
        "prefill_kinds",
        "link_gbps",
        "transfer_usd_per_gb",
        "memory_headroom",
        "max_batch",
        "max_utilisation",
        "allow_fp16",
    ),
    "efficiency": ("compute", "memory", "tp"),
    "prices": None,  # free keys: GPU kinds
    "gpus": None,
}


def parse_text(text: str, fmt: str) -> dict[str, Any]:
    """A document's text → mapping; ``fmt`` is "json" or "toml" (e.g. from the file suffix)."""
    try:
        data = json.loads(text) if fmt == "json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("config", f"not valid {fmt.upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("config", f"must be a {fmt.upper()} object/table at the top level")
    return data


def overlay(data: Mapping[str, Any], flags: Mapping[str, object]) -> dict[str, Any]:
    """A copy of ``data`` with dotted keys (``"traffic.rate"``) set from ``flags``."""
    merged: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for dotted, value in flags.items():
        section, _, key = dotted.partition(".")
        table = merged.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(section, f"must be a table, got {table!r}")
        old = table.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            table[key] = {**old, **value}
        else:
            table[key] = value
    return merged


def parse_price(text: str) -> tuple[str, float]:
    """``"H100=2.1"`` → ("H100", 2.1)."""
    kind, sep, price = text.partition("=")
    try:
        value = float(price)
    except ValueError:
        value = math.nan
    if not sep or not kind.strip() or not (value >= 0 and math.isfinite(value)):
        raise ConfigError("price", f"expected KIND=USD_PER_HOUR (e.g. H100=2.1), got {text!r}")
    return kind.strip(), value


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(name, f"must be a table, got {table!r}")
    known = _SECTIONS[name]
    if known is not None:
        for key in table:
            if key not in known:
                raise ConfigError(f"{name}.{key}", f"unknown key (known: {', '.join(known)})")
    return table


def _num(field: str, value: object, *, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(field, f"must be a number, got {value!r}")
    return float(value)


def _kinds(field: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(field, f"must be a list of GPU kinds, got {value!r}")
    if not value:
        raise ConfigError(field, "needs at least one GPU kind")
    return tuple(v.strip() for v in value)


def _model(table: Mapping[str, Any]) -> ModelConfig:
    fields = dict(table)
    preset = fields.pop("preset", None)
    if preset is not None and not isinstance(preset, str):
        raise ConfigError("model.preset", f"must be a string, got {preset!r}")
    if preset is None and not fields:
        preset = DEFAULT_PRESET
    if preset is not None:
        return replace(get_model(preset), **fields) if fields else get_model(preset)
    fields.setdefault("name", "custom")
    missing = [k for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")]
    missing = [k for k in missing if k not in fields]
    if missing:
        raise ConfigError(f"model.{missing[0]}", "required without a preset")
    return ModelConfig(**fields)


def plan_request_from_mapping(data: Mapping[str, Any]) -> PlanRequest:
    for key in data:
        if key not in _SECTIONS:
            raise ConfigError(key, f"unknown section (known: {', '.join(_SECTIONS)})")
    model = _model(_section(data, "model"))
    t = _section(data, "traffic")
    traffic = Traffic(
        rate=_num("traffic.rate", t.get("rate"), default=DEFAULT_RATE),
        prompt=parse_length(t.get("prompt", DEFAULT_PROMPT), "traffic.prompt"),
        output=parse_length(t.get("output", DEFAULT_OUTPUT), "traffic.output"),
    )
    s = _section(data, "slo")
    slo_fields = {
        "ttft_s": _num("slo.ttft_ms", s.get("ttft_ms"), default=DEFAULT_TTFT_MS) / 1e3,
        "tpot_s": _num("slo.tpot_ms", s.get("tpot_ms"), default=DEFAULT_TPOT_MS) / 1e3,
    }
    if s.get("percentile") is not None:  # else Slo's default
        slo_fields["percentile"] = _num("slo.percentile", s["percentile"], default=math.nan)
    slo = Slo(**slo_fields)
    e, e0 = _section(data, "efficiency"), Efficiency()
    eff = Efficiency(
        compute=_num("efficiency.compute", e.get("compute"), default=e0.compute),
        memory=_num("efficiency.memory", e.get("memory"), default=e0.memory),
        tp=_num("efficiency.tp", e.get("tp"), default=e0.tp),
    )
    p, p0 = _section(data, "plan"), PlanOptions()
    max_batch = p.get("max_batch", p0.max_batch)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int):
        raise ConfigError("plan.max_batch", f"must be an integer, got {max_batch!r}")
    allow = p.get("allow_fp16", p0.allow_fp16_conversion)
    if not isinstance(allow, bool):
        raise ConfigError("plan.allow_fp16", f"must be true or false, got {allow!r}")
    options = PlanOptions(
        link_gbps=_num("plan.link_gbps", p.get("link_gbps"), default=p0.link_gbps),
        transfer_usd_per_gb=_num(
            "plan.transfer_usd_per_gb", p.get("transfer_usd_per_gb"), default=p0.transfer_usd_per_gb
        ),
        memory_headroom=_num(
            "plan.memory_headroom", p.get("memory_headroom"), default=p0.memory_headroom
        ),
        max_batch=max_batch,
        max_utilisation=_num(
            "plan.max_utilisation", p.get("max_utilisation"), default=p0.max_utilisation
        ),
        allow_fp16_conversion=allow,
        efficiency=eff,
    )
    kinds = _kinds("plan.kinds", p.get("kinds", list(DEFAULT_KINDS)))
    prefill_kinds = _kinds("plan.prefill_kinds", p.get("prefill_kinds", [kinds[0]]))
    gpus = gpu_table_from_mapping(_section(data, "gpus"))
    prices = {
        str(kind): _num(f"prices.{kind}", price, default=math.nan)
        for kind, price in _section(data, "prices").items()
    }
    for kind in prices:  # the price's error (`--price`, [prices]), not the GPU table's
        if not any(known.lower() == kind.strip().lower() for known in gpus):
            raise ConfigError("price", f"unknown GPU kind {kind!r} (known: {', '.join(gpus)})")
    return PlanRequest(
        model, traffic, slo, with_prices(gpus, prices), kinds, prefill_kinds, options
    )
