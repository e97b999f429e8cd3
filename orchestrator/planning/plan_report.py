"""A Plan for people (a table) and for machines (a JSON-ready dict). Pure."""

from __future__ import annotations

from typing import Any

from orchestrator.core.perfmodel import kv_bytes_per_token
from orchestrator.planning.planner import LayoutPlan, Plan, PoolPlan
from orchestrator.planning.traffic import LengthDist, tokens_at


def _length(dist: LengthDist, percentile: float) -> dict[str, Any]:
    return {
        **dist.to_dict(),
        "mean": round(dist.mean(), 1),
        f"p{percentile * 100:g}": tokens_at(dist, percentile),
    }


def _pool(p: PoolPlan) -> dict[str, Any]:
    return {
        "role": p.role,
        "gpu": p.gpu.name,
        "tp": p.tp,
        "dtype": p.dtype,
        "replicas": p.replicas,
        "gpus": p.gpus,
        "batch": p.batch,
        "limit": p.limit,
        "replica_rps": round(p.replica_rps, 4),
        "usd_per_hour": round(p.usd_per_hour, 4),
    }


def _layout(lay: LayoutPlan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": lay.name,
        "kind": lay.kind,
        "prefill_gpu": lay.prefill_gpu,
        "decode_gpu": lay.decode_gpu,
        "feasible": lay.feasible,
        "reasons": list(lay.reasons),
        "notes": list(lay.notes),
    }
    e = lay.estimate
    if e is not None:
        out |= {
            "pools": [_pool(p) for p in e.pools],
            "gpus": e.gpus,
            "ttft_ms": round(e.ttft_s * 1e3, 2),
            "tpot_ms": round(e.tpot_s * 1e3, 3),
            "goodput_rps_per_gpu": round(e.goodput_per_gpu, 4),
            "capacity_rps": round(e.capacity_rps, 3),
            "usd_per_hour": round(e.usd_per_hour, 4),
            "usd_per_1k_requests": round(e.usd_per_1k, 6),
            "ideal_usd_per_1k_requests": round(e.ideal_usd_per_1k, 6),
            "prefill_share": round(e.prefill_share, 4),
            "prefill_utilisation": round(e.prefill_utilisation, 4),
            "transfer_bytes_per_request": round(e.transfer_bytes),
        }
    return out


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    r = plan.request
    m, o = r.model, r.options
    used = dict.fromkeys([*r.prefill_kinds, *r.kinds])
    gpus = {name: g for name, g in r.gpus.items() if name.lower() in {k.lower() for k in used}}
    return {
        "model": {
            "name": m.name,
            "dtype": m.dtype,
            "layers": m.layers,
            "hidden": m.hidden,
            "heads": m.heads,
            "kv_heads": m.kv_heads,
            "intermediate": m.intermediate,
            "vocab": m.vocab,
            "params": m.params,
            "weight_bytes": m.weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token(m),
        },
        "traffic": {
            "rate_rps": r.traffic.rate,
            "prompt": _length(r.traffic.prompt, r.slo.percentile),
            "output": _length(r.traffic.output, r.slo.percentile),
        },
        "slo": {
            "ttft_ms": r.slo.ttft_s * 1e3,
            "tpot_ms": r.slo.tpot_s * 1e3,
            "percentile": r.slo.percentile,
        },
        "options": {
            "link_gbps": o.link_gbps,
            "transfer_usd_per_gb": o.transfer_usd_per_gb,
            "memory_headroom": o.memory_headroom,
            "max_batch": o.max_batch,
            "max_utilisation": o.max_utilisation,
            "allow_fp16_conversion": o.allow_fp16_conversion,
            "efficiency": {
                "compute": o.efficiency.compute,
                "memory": o.efficiency.memory,
                "tp": o.efficiency.tp,
            },
        },
        "gpus": {
            name: {
                "memory_gib": g.memory_gib,
                "memory_bandwidth_gbs": g.memory_bandwidth_gbs,
                "fp16_tflops": g.fp16_tflops,
                "bf16_tflops": g.bf16_tflops,
                "fp8_tflops": g.fp8_tflops,
                "price_per_hour": g.price_per_hour,
                "max_tp": g.max_tp,
            }
            for name, g in gpus.items()
        },
        "layouts": [_layout(lay) for lay in plan.layouts],
        "recommended": plan.recommended.name if plan.recommended else None,
        "reason": plan.reason,
    }


_HEADER = ("layout", "pools", "batch", "TTFT ms", "TPOT ms", "req/s/GPU", "$/hour", "$/1k req")


def format_plan(plan: Plan) -> str:
    """The plan as a table with a header describing the inputs, for a terminal."""
    r = plan.request
    m, t, s = r.model, r.traffic, r.slo
    q = f"p{s.percentile * 100:g}"
    lines = [
        f"model    {m.name}: {m.dtype}, {m.params / 1e9:.2f} B params, "
        f"{m.weight_bytes / 1e9:.1f} GB weights, {kv_bytes_per_token(m) / 1024:g} KiB KV/token",
        f"traffic  {t.rate:g} req/s; prompt {t.prompt.describe()} (mean {t.prompt.mean():.0f}); "
        f"output {t.output.describe()} (mean {t.output.mean():.0f})",
        f"SLO      TTFT <= {s.ttft_s * 1e3:g} ms for the {q} prompt "
        f"({tokens_at(t.prompt, s.percentile)} tokens); TPOT <= {s.tpot_s * 1e3:g} ms",
        "",
    ]
    rows = []
    for lay in plan.layouts:
        e = lay.estimate
        if e is None:
            continue
        rows.append(
            (
                lay.name + (" *" if lay.notes else ""),
                " + ".join(p.label() for p in e.pools),
                str(e.decode_pool.batch),
                f"{e.ttft_s * 1e3:.0f}",
                f"{e.tpot_s * 1e3:.1f}",
                f"{e.goodput_per_gpu:.2f}",
                f"{e.usd_per_hour:.2f}",
                f"{e.usd_per_1k:.4f}",
            )
        )
    if rows:
        widths = [max(len(row[i]) for row in [_HEADER, *rows]) for i in range(len(_HEADER))]
        for row in [_HEADER, *rows]:
            cells = [
                cell.ljust(w) if i < 2 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
    notes = [f"  * {lay.name}: {n}" for lay in plan.layouts for n in lay.notes]
    infeasible = [f"  {lay.name}: {lay.reasons[0]}" for lay in plan.layouts if not lay.feasible]
    if notes:
        lines += ["", "notes:", *notes]
    if infeasible:
        lines += ["", "infeasible:", *infeasible]
    lines += ["", f"recommended: {plan.recommended.name if plan.recommended else 'none'}"]
    lines += [f"why: {plan.reason}."]
    prices = ", ".join(
        f"{g.name} ${g.price_per_hour:.2f}"
        for g in r.gpus.values()
        if g.name.lower() in {k.lower() for k in (*r.kinds, *r.prefill_kinds)}
    )
    eff = r.options.efficiency
    lines += [
        "",
        f"Roofline estimates (compute efficiency {eff.compute:g}, memory {eff.memory:g}); "
        f"pools sized to {r.options.max_utilisation:.0%} of their SLO capacity; "
        f"prices per GPU-hour: {prices}.",
    ]
    return "\n".join(lines)
