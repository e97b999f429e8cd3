"""Will a disaggregated deployment pay off? Sizing colocated and split layouts. Pure.

A planning aid, not a simulator: every number comes from the roofline model
(`orchestrator.core.perfmodel`) and a few textbook formulas, written out here.

**Notation.** Poisson arrivals at ``rate`` requests/s; ``S(p)`` is the prefill time of one
prompt of p tokens (prompts are prefilled one at a time); ``E[S]`` and ``E[S²]`` are averaged
over a fixed grid of prompt-length quantiles; ``S_q`` is S at the SLO's percentile prompt
length; ``T(B)`` is one decode step of B sequences at the mean decode context
``E[prompt] + E[output] / 2``; a request needs ``n = E[output] - 1`` decode steps (the first
token comes out of prefill). ``R = E[S²] / (2 E[S])`` is the mean residual prefill time.

**Prefill pool** (disaggregated): an M/G/1 queue per replica (Pollaczek-Khinchine), so at
utilisation ρ a prompt waits ``R ρ / (1 - ρ)`` on average and::

    TTFT = S_q + transfer(KV of the percentile prompt) + R ρ / (1 - ρ)

The TTFT target caps ρ at ``slack / (R + slack)`` with ``slack = TTFT - S_q - transfer``,
and a replica carries ``ρ_max / E[S]`` requests/s. (The first token comes out of prefill, but
decode cannot start before the KV has landed; charging the transfer to TTFT is conservative.)

**Decode pool** (disaggregated): continuous batching; TPOT is ``T(B)``; by Little's law a
replica running batches of B carries ``B / (n T(B))`` requests/s. B is the largest batch with
``T(B) <= TPOT`` whose KV (``E[prompt] + E[output]`` tokens reserved per sequence) fits.

**Colocated**: one pool does both, prefill first (a prefill-prioritising scheduler without
chunked prefill, vLLM's classic default). Each request costs ``E[S]`` of prefill plus
``n T(B) / B`` of decode time, so a replica at batch B carries ``μ(B) = 1 / (n T(B)/B + E[S])``
requests/s and spends ``f = μ E[S]`` of its time prefilling. Decode steps only run in the
remaining time and a new prompt waits for the step in flight::

    TPOT = T(B) / (1 - f)          TTFT = S_q + R f / (1 - f) + T(B)

B is the largest batch meeting both SLOs and memory.

**Sizing and cost.** Replicas = ceil(rate / (max_utilisation · per-replica capacity at the
SLOs)); a replica is a
tensor-parallel group of ``tp`` GPUs (``tp`` tried up to the kind's ``max_tp``; the cheapest
wins). Cost per 1,000 requests = the deployment's $/hour / (3600 · rate) · 1000 plus the KV
transfer price; *goodput per GPU* is the requests/s one GPU carries within the SLOs with
fractional replicas (DistServe's per-GPU goodput, computed rather than measured).

**Feasibility.** A layout is infeasible when the weights plus one sequence's KV do not fit in
``(1 - memory_headroom)`` of a replica's memory at any allowed ``tp``; when the GPU lacks the
model's dtype (a bf16 model on a T4 is planned in fp16 only with ``allow_fp16_conversion``,
on both pools, because the KV header fixes one dtype); or when even batch 1 misses an SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from orchestrator.core import perfmodel as pm
from orchestrator.core.cost import PoolUsage, request_cost
from orchestrator.core.hardware import TP_DEGREES, GpuProfile, get_gpu
from orchestrator.core.perfmodel import Efficiency, ModelConfig
from orchestrator.errors import ConfigError
from orchestrator.planning.traffic import Slo, Traffic, quantile_grid, tokens_at


@dataclass(frozen=True, slots=True)
class PlanOptions:
    link_gbps: float = 100.0
    """Prefill→decode link, Gbit/s (a 100 Gb/s RDMA NIC per GPU)."""
    transfer_usd_per_gb: float = 0.0
    """Price of moving KV between pools (0 inside one cluster)."""
    memory_headroom: float = 0.10
    """Memory kept free for activations, CUDA context, fragmentation (vLLM uses 0.9 of it)."""
    max_batch: int = 256
    """Most sequences one replica decodes at once (vLLM's default ``max_num_seqs``)."""
    allow_fp16_conversion: bool = False
    """Plan a bf16 model in fp16 on GPUs without bf16 (T4) instead of calling it infeasible."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    max_utilisation: float = 0.9
    """Pools are sized so the offered rate is at most this fraction of the rate at which
    they would just meet the SLOs: room for bursts the Poisson model does not capture."""
    grid_points: int = 32
    """Prompt-length quantiles averaged for E[S] and E[S²]."""

    def __post_init__(self) -> None:
        if not 0 <= self.memory_headroom < 1:
            raise ConfigError(
                "plan.memory_headroom", f"must be in [0, 1), got {self.memory_headroom!r}"
            )
        if not 0 < self.max_utilisation <= 1:
            raise ConfigError(
                "plan.max_utilisation", f"must be in (0, 1], got {self.max_utilisation!r}"
            )
        if self.max_batch < 1:
            raise ConfigError("plan.max_batch", f"must be >= 1, got {self.max_batch!r}")
        if not self.link_gbps > 0:
            raise ConfigError("plan.link_gbps", f"must be > 0, got {self.link_gbps!r}")
        if not self.transfer_usd_per_gb >= 0:
            raise ConfigError(
                "plan.transfer_usd_per_gb", f"must be >= 0, got {self.transfer_usd_per_gb!r}"
            )


@dataclass(frozen=True, slots=True)
class PlanRequest:
    model: ModelConfig
    traffic: Traffic
    slo: Slo
    gpus: Mapping[str, GpuProfile]
    """The GPU table (defaults plus overrides)."""
    kinds: tuple[str, ...]
    """Kinds planned colocated and as decode pools."""
    prefill_kinds: tuple[str, ...]
    """Kinds planned as prefill pools of disaggregated layouts."""
    options: PlanOptions = field(default_factory=PlanOptions)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    role: str
    """"prefill", "decode" or "colocated"."""
    gpu: GpuProfile
    tp: int
    dtype: str
    replicas: int
    batch: int
    """Largest decode batch meeting the SLOs (1 for a prefill pool)."""
    limit: str
    """What bounds it: "ttft", "tpot", "memory" or "max_batch"."""
    replica_rps: float
    """Requests/s one replica carries within the SLOs."""

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp

    @property
    def usd_per_hour(self) -> float:
        return self.gpus * self.gpu.price_per_hour

    @property
    def gpu_seconds_per_request(self) -> float:
        """At full capacity, with fractional replicas."""
        return self.tp / self.replica_rps

    def label(self) -> str:
        return f"{self.replicas}x{self.gpu.name}" + (f"/tp{self.tp}" if self.tp > 1 else "")


@dataclass(frozen=True, slots=True)
class Estimate:
    pools: tuple[PoolPlan, ...]
    ttft_s: float
    """At the offered rate, for the percentile prompt (mean queueing wait)."""
    tpot_s: float
    """At the offered rate."""
    prefill_share: float
    """Colocated: fraction of GPU time spent in prefill at capacity (0 when split)."""
    prefill_utilisation: float
    """Disaggregated: the most the prefill pool may be busy and still meet TTFT."""
    transfer_bytes: float
    """Mean KV bytes moved per request (0 colocated)."""
    usd_per_1k: float
    """At the offered rate with whole replicas, transfer included."""
    ideal_usd_per_1k: float
    """With fractional replicas at capacity (the cost per request at scale)."""

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def usd_per_hour(self) -> float:
        return sum(p.usd_per_hour for p in self.pools)

    @property
    def capacity_rps(self) -> float:
        return min(p.replicas * p.replica_rps for p in self.pools)

    @property
    def goodput_per_gpu(self) -> float:
        return 1.0 / sum(p.gpu_seconds_per_request for p in self.pools)

    @property
    def decode_pool(self) -> PoolPlan:
        return self.pools[-1]


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    name: str
    kind: str
    """"colocated" or "disaggregated"."""
    prefill_gpu: str
    decode_gpu: str
    estimate: Estimate | None
    reasons: tuple[str, ...] = ()
    """Why it is infeasible."""
    notes: tuple[str, ...] = ()

    @property
    def feasible(self) -> bool:
        return self.estimate is not None


@dataclass(frozen=True, slots=True)
class Plan:
    request: PlanRequest
    layouts: tuple[LayoutPlan, ...]
    """Feasible ones cheapest first, then the infeasible ones."""
    recommended: LayoutPlan | None
    reason: str


# ------------------------------------------------------------------------- the pieces


class _Infeasible(Exception):
    """Internal: a layout cannot meet its constraints (never escapes ``plan``)."""


@dataclass(frozen=True, slots=True)
class _Ctx:
    request: PlanRequest
    model: ModelConfig
    """With the dtype the layout runs in."""

    @property
    def opts(self) -> PlanOptions:
        return self.request.options

    def prefill_s(self, gpu: GpuProfile, tp: int, tokens: int) -> float:
        return pm.prefill_seconds(
            self.model, gpu, tokens, 1, tp=tp, efficiency=self.opts.efficiency
        )

    def step_s(self, gpu: GpuProfile, tp: int, batch: int) -> float:
        t = self.request.traffic
        context = max(1, round(t.prompt.mean() + t.output.mean() / 2))
        return pm.decode_step_seconds(
            self.model, gpu, batch, context, tp=tp, efficiency=self.opts.efficiency
        )

    @property
    def decode_steps(self) -> float:
        return self.request.traffic.output.mean() - 1

    @property
    def kv_per_token(self) -> int:
        return pm.kv_bytes_per_token(self.model)

    @property
    def p_q(self) -> int:
        return tokens_at(self.request.traffic.prompt, self.request.slo.percentile)

    def prefill_moments(self, gpu: GpuProfile, tp: int) -> tuple[float, float]:
        """(E[S], R = E[S²] / (2 E[S])) over the prompt-length grid."""
        times = [
            self.prefill_s(gpu, tp, p)
            for p in quantile_grid(self.request.traffic.prompt, self.opts.grid_points)
        ]
        mean = sum(times) / len(times)
        return mean, sum(s * s for s in times) / len(times) / (2 * mean)

    def kv_room(self, gpu: GpuProfile, tp: int, tokens: int) -> float:
        """Bytes left for KV on a replica, or _Infeasible naming what does not fit."""
        usable = tp * gpu.memory_bytes * (1 - self.opts.memory_headroom)
        room = usable - self.model.weight_bytes
        if room < tokens * self.kv_per_token:
            raise _Infeasible(
                f"memory: {self.model.weight_bytes / 1e9:.1f} GB of weights + KV for "
                f"{tokens} tokens exceed {1 - self.opts.memory_headroom:.0%} of "
                f"{tp}x{gpu.name} ({tp * gpu.memory_gib:g} GiB)"
            )
        return room

    def transfer_s(self, tokens: float) -> float:
        return pm.transfer_seconds(tokens * self.kv_per_token, self.opts.link_gbps)


def _largest(ok: Callable[[int], bool], limit: int) -> int:
    """The largest b in [1, limit] with ok(b), for ok true up to some b and false after."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _batch_limit(ctx: _Ctx, gpu: GpuProfile, tp: int) -> tuple[int, str]:
    t = ctx.request.traffic
    reserve = max(1, math.ceil(t.prompt.mean() + t.output.mean()))
    room = ctx.kv_room(gpu, tp, reserve)
    by_memory = int(room // (reserve * ctx.kv_per_token))
    if by_memory <= ctx.opts.max_batch:
        return by_memory, "memory"
    return ctx.opts.max_batch, "max_batch"


def _prefill_pool(ctx: _Ctx, gpu: GpuProfile, tp: int) -> PoolPlan:
    """One replica of a prefill pool, run as busy as TTFT allows (ρ_max)."""
    slo, p_q = ctx.request.slo, ctx.p_q
    ctx.kv_room(gpu, tp, p_q)
    mean_s, residual = ctx.prefill_moments(gpu, tp)
    s_q, xfer = ctx.prefill_s(gpu, tp, p_q), ctx.transfer_s(p_q)
    slack = slo.ttft_s - s_q - xfer
    if slack <= 0:
        raise _Infeasible(
            f"ttft: prefilling the p{slo.percentile * 100:g} prompt ({p_q} tokens) takes "
            f"{s_q * 1e3:.0f} ms + {xfer * 1e3:.0f} ms KV transfer on {tp}x{gpu.name}, "
            f"TTFT target {slo.ttft_s * 1e3:.0f} ms"
        )
    rho = slack / (residual + slack)
    return PoolPlan("prefill", gpu, tp, ctx.model.dtype, 1, 1, "ttft", rho / mean_s)


def _decode_pool(ctx: _Ctx, gpu: GpuProfile, tp: int) -> PoolPlan:
    limit, why = _batch_limit(ctx, gpu, tp)
    tpot = ctx.request.slo.tpot_s
    if ctx.step_s(gpu, tp, 1) > tpot:
        raise _Infeasible(
            f"tpot: one decode step takes {ctx.step_s(gpu, tp, 1) * 1e3:.1f} ms at batch 1 on "
            f"{tp}x{gpu.name}, TPOT target {tpot * 1e3:.0f} ms"
        )
    batch = _largest(lambda b: ctx.step_s(gpu, tp, b) <= tpot, limit)
    rps = batch / (ctx.decode_steps * ctx.step_s(gpu, tp, batch))
    return PoolPlan(
        "decode", gpu, tp, ctx.model.dtype, 1, batch, why if batch == limit else "tpot", rps
    )


def _colocated_at(
    ctx: _Ctx, gpu: GpuProfile, tp: int, batch: int
) -> tuple[float, float, float, float]:
    """(μ, f, TPOT, TTFT) of a colocated replica in steady state at batch ``batch``."""
    mean_s, residual = ctx.prefill_moments(gpu, tp)
    step = ctx.step_s(gpu, tp, batch)
    mu = 1.0 / (ctx.decode_steps * step / batch + mean_s)
    f = mu * mean_s
    return mu, f, step / (1 - f), ctx.prefill_s(gpu, tp, ctx.p_q) + residual * f / (1 - f) + step


def _colocated_pool(ctx: _Ctx, gpu: GpuProfile, tp: int) -> PoolPlan:
    slo = ctx.request.slo
    limit, why = _batch_limit(ctx, gpu, tp)

    def misses(b: int) -> str:
        _, _, tpot, ttft = _colocated_at(ctx, gpu, tp, b)
        return "tpot" if tpot > slo.tpot_s else "ttft" if ttft > slo.ttft_s else ""

    first = misses(1)
    if first:
        _, f, tpot, ttft = _colocated_at(ctx, gpu, tp, 1)
        raise _Infeasible(
            f"{first}: even at batch 1 on {tp}x{gpu.name}, TTFT {ttft * 1e3:.0f} ms / TPOT "
            f"{tpot * 1e3:.1f} ms (prefill takes {f:.0%} of the GPU's time) miss "
            f"{slo.ttft_s * 1e3:.0f} / {slo.tpot_s * 1e3:.0f} ms"
        )
    batch = _largest(lambda b: not misses(b), limit)
    bound = why if batch == limit else misses(batch + 1)
    mu = _colocated_at(ctx, gpu, tp, batch)[0]
    return PoolPlan("colocated", gpu, tp, ctx.model.dtype, 1, batch, bound, mu)


def _sized(pool: PoolPlan, rate: float, utilisation: float) -> PoolPlan:
    """Enough replicas that ``rate`` is at most ``utilisation`` of their SLO capacity."""
    need = rate / (pool.replica_rps * utilisation)
    return replace(pool, replicas=max(1, math.ceil(need - 1e-9)))


def _best_tp(
    ctx: _Ctx, gpu: GpuProfile, build: Callable[[_Ctx, GpuProfile, int], PoolPlan]
) -> PoolPlan:
    """The cheapest sized pool over the allowed tp degrees; _Infeasible with the last reason."""
    rate, found, last = ctx.request.traffic.rate, [], ""
    for tp in (d for d in TP_DEGREES if d <= gpu.max_tp):
        try:
            found.append(_sized(build(ctx, gpu, tp), rate, ctx.opts.max_utilisation))
        except _Infeasible as exc:
            last = str(exc)
    if not found:
        raise _Infeasible(last)
    return min(found, key=lambda p: (p.usd_per_hour, p.gpu_seconds_per_request, p.tp))


def _smallest(ok: Callable[[int], bool], limit: int) -> int:
    """The smallest b in [1, limit] with ok(b) (limit if none), for ok false then true."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# ------------------------------------------------------------------------------ layouts


def _model_for(
    request: PlanRequest, gpus: Sequence[GpuProfile]
) -> tuple[ModelConfig, tuple[str, ...]]:
    """The model in the dtype all of ``gpus`` run; _Infeasible when there is none."""
    model = request.model
    lacking = sorted({g.name for g in gpus if not g.supports(model.dtype)})
    if not lacking:
        return model, ()
    fp16_ok = model.dtype == "bf16" and all(g.supports("fp16") for g in gpus)
    if fp16_ok and request.options.allow_fp16_conversion:
        kv = "fp16" if model.kv_dtype in (None, "bf16") else model.kv_dtype
        note = (
            f"bf16 weights converted to fp16 for {', '.join(lacking)} (fp16 overflows where "
            "bf16 does not: check accuracy)"
        )
        return replace(model, dtype="fp16", kv_dtype=kv), (note,)
    hint = " (allow fp16 conversion to plan it in fp16)" if fp16_ok else ""
    raise _Infeasible(f"dtype: {', '.join(lacking)} has no {model.dtype} support{hint}")


def _costs(ctx: _Ctx, pools: Sequence[PoolPlan], transfer_bytes: float) -> tuple[float, float]:
    """(USD per 1k requests at the offered rate with whole replicas, the same at capacity)."""
    rate, nbytes = ctx.request.traffic.rate, round(transfer_bytes)
    per_gb = ctx.opts.transfer_usd_per_gb
    sized = request_cost([PoolUsage(p.role, p.gpu, p.gpus / rate) for p in pools], nbytes, per_gb)
    ideal = request_cost(
        [PoolUsage(p.role, p.gpu, p.gpu_seconds_per_request) for p in pools], nbytes, per_gb
    )
    return sized.total_usd * 1000, ideal.total_usd * 1000


def _colocated(request: PlanRequest, gpu: GpuProfile) -> LayoutPlan:
    name = f"colocated {gpu.name}"
    try:
        model, notes = _model_for(request, [gpu])
        ctx = _Ctx(request, model)
        pool = _best_tp(ctx, gpu, _colocated_pool)
    except _Infeasible as exc:
        return LayoutPlan(name, "colocated", gpu.name, gpu.name, None, (str(exc),))
    rate, tp = request.traffic.rate / pool.replicas, pool.tp
    mean_s, residual = ctx.prefill_moments(gpu, tp)
    batch = _smallest(lambda b: _colocated_at(ctx, gpu, tp, b)[0] >= rate, pool.batch)
    step, f = ctx.step_s(gpu, tp, batch), rate * mean_s
    ttft = ctx.prefill_s(gpu, tp, ctx.p_q) + residual * f / (1 - f) + step
    usd, ideal = _costs(ctx, [pool], 0.0)
    share = pool.replica_rps * mean_s
    estimate = Estimate((pool,), ttft, step / (1 - f), share, 0.0, 0.0, usd, ideal)
    return LayoutPlan(name, "colocated", gpu.name, gpu.name, estimate, (), notes)


def _disaggregated(request: PlanRequest, prefill: GpuProfile, decode: GpuProfile) -> LayoutPlan:
    name = f"{prefill.name} -> {decode.name}"
    try:
        model, notes = _model_for(request, [prefill, decode])
        ctx = _Ctx(request, model)
        ppool = _best_tp(ctx, prefill, _prefill_pool)
        dpool = _best_tp(ctx, decode, _decode_pool)
    except _Infeasible as exc:
        return LayoutPlan(name, "disaggregated", prefill.name, decode.name, None, (str(exc),))
    rate = request.traffic.rate
    mean_s, residual = ctx.prefill_moments(prefill, ppool.tp)
    rho = rate / ppool.replicas * mean_s
    ttft = ctx.prefill_s(prefill, ppool.tp, ctx.p_q) + ctx.transfer_s(ctx.p_q)
    ttft += residual * rho / (1 - rho)
    d_rate = rate / dpool.replicas
    batch = _smallest(
        lambda b: b / (ctx.decode_steps * ctx.step_s(decode, dpool.tp, b)) >= d_rate, dpool.batch
    )
    transfer = request.traffic.prompt.mean() * ctx.kv_per_token
    usd, ideal = _costs(ctx, [ppool, dpool], transfer)
    rho_max = ppool.replica_rps * mean_s
    tpot = ctx.step_s(decode, dpool.tp, batch)
    estimate = Estimate((ppool, dpool), ttft, tpot, 0.0, rho_max, transfer, usd, ideal)
    return LayoutPlan(name, "disaggregated", prefill.name, decode.name, estimate, (), notes)


def plan(request: PlanRequest) -> Plan:
    """Plan every layout of ``request`` and recommend the cheapest feasible one."""
    # a kind named twice (--gpus H100,H100, or h100 beside H100) is planned once
    kinds = list({g.name: g for g in (get_gpu(request.gpus, k) for k in request.kinds)}.values())
    prefills = list(
        {g.name: g for g in (get_gpu(request.gpus, k) for k in request.prefill_kinds)}.values()
    )
    if not kinds:
        raise ConfigError("plan.kinds", "needs at least one GPU kind")
    layouts = [_colocated(request, g) for g in kinds]
    layouts += [_disaggregated(request, p, d) for p in prefills for d in kinds]
    feasible = sorted((lay for lay in layouts if lay.estimate is not None), key=_rank)
    infeasible = [lay for lay in layouts if lay.estimate is None]
    best = feasible[0] if feasible else None
    return Plan(request, (*feasible, *infeasible), best, _explain(best, feasible, infeasible))


def _rank(layout: LayoutPlan) -> tuple[float, float, int, str]:
    e = layout.estimate
    assert e is not None
    return (round(e.usd_per_1k, 9), round(e.ideal_usd_per_1k, 9), e.gpus, layout.name)


_LIMITS = {"tpot": "TPOT", "ttft": "TTFT", "memory": "KV memory", "max_batch": "max batch"}


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _explain(
    best: LayoutPlan | None, feasible: Sequence[LayoutPlan], infeasible: Sequence[LayoutPlan]
) -> str:
    """Why ``best``, in a sentence or two, against the best layout of the other family."""
    if best is None or best.estimate is None:
        why = "; ".join(f"{lay.name}: {lay.reasons[0]}" for lay in infeasible)
        return f"no layout is feasible ({why})"
    e = best.estimate
    pools = " + ".join(p.label() for p in e.pools)
    head = (
        f"{best.name} is the cheapest feasible layout: ${e.usd_per_1k:.4f} per 1,000 requests "
        f"on {_gpus(e.gpus)} ({pools})"
    )
    other = "disaggregated" if best.kind == "colocated" else "colocated"
    rivals = [lay for lay in feasible if lay.kind == other]
    if not rivals:
        lost = [lay for lay in infeasible if lay.kind == other]
        if lost:
            return f"{head}; no {other} layout is feasible ({lost[0].name}: {lost[0].reasons[0]})"
        return head
    rival = rivals[0]
    r = rival.estimate
    assert r is not None
    # e <= r (cheapest first): r is 0 only when both are free (--price KIND=0)
    saving = 1 - e.usd_per_1k / r.usd_per_1k if r.usd_per_1k > 0 else 0.0
    if abs(saving) < 0.005:
        compare = f"the same cost as the best {other} layout, {rival.name}"
    else:
        compare = f"{saving:.0%} below the best {other} layout, {rival.name} (${r.usd_per_1k:.4f})"
    if best.kind == "disaggregated":
        c, d = r.decode_pool, e.decode_pool
        if c.limit in ("tpot", "ttft"):
            detail = (
                f"colocated, prefill takes {r.prefill_share:.0%} of the GPU's time and stretches "
                f"every decode step, so its batch stops at {c.batch} ({_LIMITS[c.limit]}); "
                f"split, the {d.gpu.name} decode pool runs batches of {d.batch} "
                f"({_LIMITS[d.limit]})"
            )
        else:
            detail = (
                f"colocated, prefill takes {r.prefill_share:.0%} of the GPU's time, which "
                f"decoding cannot use; split, the {d.gpu.name} decode pool runs batches of "
                f"{d.batch} ({_LIMITS[d.limit]})"
            )
        p = e.pools[0]
        if d.gpu.name != p.gpu.name:
            detail += (
                f", on GPUs at ${d.gpu.price_per_hour:.2f}/h against ${p.gpu.price_per_hour:.2f}/h "
                f"for {p.gpu.name}"
            )
    elif r.ideal_usd_per_1k < e.ideal_usd_per_1k:
        detail = (
            f"splitting would cost less per request at scale (${r.ideal_usd_per_1k:.4f} against "
            f"${e.ideal_usd_per_1k:.4f} per 1,000 with fractional replicas), but at this rate "
            f"its whole replicas cost ${r.usd_per_hour:.2f}/h ({_gpus(r.gpus)}) against "
            f"${e.usd_per_hour:.2f}/h ({_gpus(e.gpus)})"
        )
    else:
        c, d = e.decode_pool, r.decode_pool
        detail = (
            f"one pool meets both SLOs with prefill taking {e.prefill_share:.0%} of its time "
            f"at batch {c.batch} ({_LIMITS[c.limit]}); splitting adds a prefill pool kept at "
            f"most {r.prefill_utilisation:.0%} busy for TTFT and a {d.gpu.name} decode pool "
            f"whose batch stops at {d.batch} ({_LIMITS[d.limit]})"
        )
    return f"{head}, {compare}: {detail}"
