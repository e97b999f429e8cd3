"""The planner (`orchestrator.planning.planner`) on hand-computed and characteristic cases.

The hand-computed cases use the toy model and the SLOW GPU of test_perfmodel (see there for
the FLOP and byte counts) with every efficiency 1, no memory headroom, pools sized to 100 %
of their SLO capacity, fixed 1000-token prompts, 100-token outputs, TTFT 2 s, TPOT 100 ms:

    S    = prefill of 1000 tokens = 64,915,456,000 FLOPs / 1e11 FLOP/s = 0.64915456 s
    R    = E[S^2] / (2 E[S]) = S / 2 = 0.32457728 s   (every prompt alike)
    T(B) = decode step at context 1000 + 100/2 = 1050, memory-bound:
           (62,865,408 + B * 1050 * 2048) bytes / 1e9 B/s = 0.062865408 + 0.0021504 B  s
    n    = 100 - 1 = 99 decode steps per request
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.core.hardware import DEFAULT_GPUS, GpuProfile, with_prices
from orchestrator.core.perfmodel import Efficiency, ModelConfig, get_model
from orchestrator.errors import ConfigError
from orchestrator.planning.planner import LayoutPlan, Plan, PlanOptions, PlanRequest, plan
from orchestrator.planning.traffic import Fixed, LogNormal, Slo, Traffic

TOY = ModelConfig(
    "toy", layers=2, hidden=1024, heads=8, kv_heads=2, intermediate=4096, vocab=1000, dtype="fp16"
)
SLOW = GpuProfile(
    "slow",
    memory_gib=1000,
    memory_bandwidth_gbs=1,
    fp16_tflops=0.1,
    bf16_tflops=0.1,
    fp8_tflops=None,
    price_per_hour=3.6,  # $0.001 per GPU-second
)
S, R = 0.64915456, 0.32457728


def T(batch: int) -> float:
    return 0.062865408 + 0.0021504 * batch


def toy_plan(rate: float, **options: object) -> Plan:
    opts = {
        "link_gbps": 8.0,
        "memory_headroom": 0.0,
        "max_utilisation": 1.0,
        "efficiency": Efficiency(1.0, 1.0, 1.0),
    } | options
    request = PlanRequest(
        TOY,
        Traffic(rate, Fixed(1000), Fixed(100)),
        Slo(ttft_s=2.0, tpot_s=0.1),
        {"slow": SLOW},
        ("slow",),
        ("slow",),
        PlanOptions(**opts),  # type: ignore[arg-type]
    )
    return plan(request)


def layout(p: Plan, name: str) -> LayoutPlan:
    return next(lay for lay in p.layouts if lay.name == name)


def test_disaggregated_by_hand() -> None:
    e = layout(toy_plan(2.0), "slow -> slow").estimate
    assert e is not None
    prefill, decode = e.pools
    # TTFT slack = 2 - S - KV transfer (1000 * 2048 B * 8 / 8 Gb/s = 0.002048 s) = 1.34879744
    # rho_max = slack / (R + slack) = 1.34879744 / 1.67337472 = 0.80603431
    slack = 2.0 - S - 0.002048
    rho_max = slack / (R + slack)
    assert e.prefill_utilisation == pytest.approx(rho_max)
    assert rho_max == pytest.approx(0.80603431)
    # one prefill replica carries rho_max / S = 1.24166780 req/s -> 2 replicas for 2 req/s
    assert prefill.replica_rps == pytest.approx(rho_max / S)
    assert prefill.replicas == 2
    # decode: largest B with T(B) <= 0.1: B <= (0.1 - 0.062865408) / 0.0021504 = 17.27 -> 17
    assert (decode.batch, decode.limit) == (17, "tpot")
    # T(17) = 0.099422208 s; a replica carries 17 / (99 * 0.099422208) = 1.72715106 req/s
    assert decode.replica_rps == pytest.approx(17 / (99 * T(17)))
    assert decode.replicas == 2
    # at 1 req/s per prefill replica: rho = S, wait = R * S / (1 - S) = 0.60055130 s
    assert e.ttft_s == pytest.approx(S + 0.002048 + R * S / (1 - S))
    # at 1 req/s per decode replica: smallest B with B / (99 T(B)) >= 1 is 8; T(8) = 80.07 ms
    assert e.tpot_s == pytest.approx(T(8))
    # 4 GPUs * $3.60/h = $14.40/h for 2 req/s: $14.40 / 7200 requests = $0.002 -> $2.00 / 1k
    assert e.gpus == 4
    assert e.usd_per_1k == pytest.approx(2.0)
    # fractional replicas: (S / rho_max + 99 T(17) / 17) GPU-s * $0.001 * 1000
    ideal = S / rho_max + 99 * T(17) / 17
    assert e.ideal_usd_per_1k == pytest.approx(ideal)
    assert e.goodput_per_gpu == pytest.approx(1 / ideal)
    assert e.transfer_bytes == 1000 * 2048


def test_colocated_by_hand() -> None:
    e = layout(toy_plan(2.0), "colocated slow").estimate
    assert e is not None
    (pool,) = e.pools
    # mu(B) = 1 / (99 T(B) / B + S), f = mu S, TPOT = T(B) / (1 - f):
    #   B=4: mu = 1 / (99 * 0.0714656 / 4 + 0.64915456) = 0.41357126, f = 0.26847167,
    #        TPOT = 0.0714656 / 0.73152833 = 97.7 ms  (meets 100 ms)
    #   B=5: mu = 0.47465818, f = 0.30812652, TPOT = 0.0736160 / 0.69187348 = 106.4 ms (misses)
    mu4 = 1 / (99 * T(4) / 4 + S)
    assert mu4 == pytest.approx(0.41357126)
    assert (pool.batch, pool.limit) == (4, "tpot")
    assert pool.replica_rps == pytest.approx(mu4)
    assert e.prefill_share == pytest.approx(mu4 * S)
    # 2 req/s / 0.41357 = 4.84 -> 5 replicas; at 0.4 req/s each the batch is 4 (mu(3) < 0.4)
    assert pool.replicas == 5
    f = 0.4 * S
    assert e.tpot_s == pytest.approx(T(4) / (1 - f))
    # TTFT = S + R f / (1 - f) + T(4) = 0.64915 + 0.11384 + 0.07147 = 0.83446 s
    assert e.ttft_s == pytest.approx(S + R * f / (1 - f) + T(4))
    assert e.ttft_s == pytest.approx(0.83446, abs=1e-5)
    # 5 GPUs * $3.60/h for 2 req/s -> $2.50 per 1,000 requests
    assert e.usd_per_1k == pytest.approx(2.5)


def test_toy_recommends_the_split_and_says_why() -> None:
    p = toy_plan(2.0)
    assert p.recommended is not None
    assert p.recommended.name == "slow -> slow"
    assert [lay.name for lay in p.layouts] == ["slow -> slow", "colocated slow"]
    assert "20% below the best colocated layout, colocated slow ($2.5000)" in p.reason
    assert "prefill takes 27% of the GPU's time and stretches every decode step" in p.reason
    assert "batch stops at 4 (TPOT)" in p.reason
    assert "decode pool runs batches of 17 (TPOT)" in p.reason


def test_memory_bounds_the_batch() -> None:
    # KV reserved per sequence: (1000 + 100) tokens * 2048 B = 2,252,800 B; with 0.09 GiB
    # (96,636,764.16 B) less 64,913,408 B of weights, (31,723,356) // 2,252,800 = 14 < 17
    small = replace(SLOW, memory_gib=0.09)
    request = PlanRequest(
        TOY,
        Traffic(2.0, Fixed(1000), Fixed(100)),
        Slo(2.0, 0.1),
        {"slow": small},
        ("slow",),
        ("slow",),
        PlanOptions(memory_headroom=0.0, efficiency=Efficiency(1.0, 1.0, 1.0), link_gbps=8.0),
    )
    e = layout(plan(request), "slow -> slow").estimate
    assert e is not None
    assert (e.decode_pool.batch, e.decode_pool.limit) == (14, "memory")


# ------------------------------------------------------------------ real models and GPUs


def request(
    model: str = "llama-3-8b",
    *,
    rate: float = 20.0,
    prompt: object = None,
    output: int = 256,
    ttft: float = 1.0,
    tpot: float = 0.05,
    kinds: tuple[str, ...] = ("H100", "A100", "L40S", "L4", "T4"),
    prices: dict[str, float] | None = None,
    **options: object,
) -> PlanRequest:
    return PlanRequest(
        get_model(model),
        Traffic(rate, prompt or LogNormal(1024, 4096), Fixed(output)),  # type: ignore[arg-type]
        Slo(ttft, tpot),
        with_prices(DEFAULT_GPUS, prices or {}),
        kinds,
        ("H100",),
        PlanOptions(**options),  # type: ignore[arg-type]
    )


def test_70b_does_not_fit_l4_or_t4_decode_gpus() -> None:
    p = plan(request("llama-3-70b", rate=10.0, ttft=2.0, allow_fp16_conversion=True))
    for name in ("H100 -> L4", "H100 -> T4", "colocated L4", "colocated T4"):
        lay = layout(p, name)
        assert not lay.feasible
        # 70.55e9 params * 2 bytes = 141.1 GB > 0.9 * 24 GiB (L4) or 0.9 * 16 GiB (T4)
        assert lay.reasons[0].startswith("memory: 141.1 GB of weights"), lay.reasons
    # an H100 pair needs tensor parallelism: 141.1 GB > 0.9 * 80 GiB = 77.3 GB
    e = layout(p, "colocated H100").estimate
    assert e is not None
    assert e.pools[0].tp >= 2


def test_bf16_on_t4_is_infeasible_unless_converted_to_fp16() -> None:
    p = plan(request("smollm2-135m"))
    for name in ("colocated T4", "H100 -> T4"):
        lay = layout(p, name)
        assert lay.reasons == (
            "dtype: T4 has no bf16 support (allow fp16 conversion to plan it in fp16)",
        )
    converted = plan(request("smollm2-135m", allow_fp16_conversion=True))
    split = layout(converted, "H100 -> T4")
    assert split.estimate is not None
    # the KV header carries one dtype: the H100 prefill pool runs fp16 too
    assert [pool.dtype for pool in split.estimate.pools] == ["fp16", "fp16"]
    assert "bf16 weights converted to fp16 for T4" in split.notes[0]


def test_fp8_halves_the_weights_and_is_refused_where_the_gpu_has_none() -> None:
    bf16 = plan(request())
    fp8 = plan(replace(request(), model=replace(get_model("llama-3-8b"), dtype="fp8")))
    assert layout(fp8, "colocated A100").reasons == ("dtype: A100 has no fp8 support",)
    assert layout(fp8, "H100 -> T4").reasons == ("dtype: T4 has no fp8 support",)
    # bf16 on an L4: 15.0 GB of weights at 0.8 * 300 GB/s = 62.5 ms (+1.1 ms KV) > 50 ms
    assert layout(bf16, "H100 -> L4").reasons[0].startswith("tpot: one decode step takes 63.6 ms")
    # fp8: 7,504,658,432 B of weights; KV 65,536 B/token at context 1838 + 256/2 = 1966;
    # 50 ms * 240 GB/s = 12e9 B -> B <= (12e9 - 7.5047e9) / (1966 * 65,536) = 34.9 -> 34
    e = layout(fp8, "H100 -> L4").estimate
    assert e is not None
    assert (e.decode_pool.batch, e.decode_pool.limit, e.decode_pool.dtype) == (34, "tpot", "fp8")


def test_disaggregation_wins_with_long_prompts_and_a_tight_tpot() -> None:
    # 8000-token prompts, 64 output tokens, TPOT 30 ms: colocated, prefill fills most of the
    # GPU's time and every decode step waits behind it.
    p = plan(
        request(rate=100.0, prompt=Fixed(8000), output=64, ttft=2.0, tpot=0.03, kinds=("H100",))
    )
    assert p.recommended is not None
    assert p.recommended.name == "H100 -> H100"
    split, colocated = (layout(p, n).estimate for n in ("H100 -> H100", "colocated H100"))
    assert split is not None
    assert colocated is not None
    assert split.usd_per_1k < colocated.usd_per_1k
    assert split.goodput_per_gpu > colocated.goodput_per_gpu
    assert colocated.prefill_share > 0.8
    assert "stretches every decode step" in p.reason


def test_colocated_wins_at_a_low_rate() -> None:
    # 1 req/s of short prompts: one colocated H100 carries it; a split needs two GPUs.
    p = plan(request(rate=1.0, prompt=Fixed(256), output=128, kinds=("H100",)))
    assert p.recommended is not None
    assert p.recommended.name == "colocated H100"
    best = p.recommended.estimate
    assert best is not None
    assert best.gpus == 1
    # $2.50/h for 3,600 requests/h -> $0.6944 per 1,000
    assert best.usd_per_1k == pytest.approx(2.5 / 3.6)
    split = layout(p, "H100 -> H100").estimate
    assert split is not None
    assert split.gpus == 2
    assert split.usd_per_1k == pytest.approx(5.0 / 3.6)
    assert "below the best disaggregated layout, H100 -> H100" in p.reason


def test_t4_decode_pays_only_when_t4_is_cheap_enough() -> None:
    # A small model, long prompts and a TTFT that keeps prefill off the T4: at $0.20/h the
    # T4 decode pool beats every layout; at the default $0.35/h it does not (per dollar a T4
    # then buys 914 GB/s of bandwidth against an H100's 1,340).
    def smollm(t4_price: float) -> Plan:
        return plan(
            request(
                "smollm2-135m",
                rate=200.0,
                prompt=LogNormal(2048, 8192),
                output=512,
                ttft=0.12,
                tpot=0.02,
                kinds=("H100", "T4"),
                prices={"T4": t4_price},
                allow_fp16_conversion=True,
            )
        )

    cheap = smollm(0.20)
    assert cheap.recommended is not None
    assert cheap.recommended.name == "H100 -> T4"
    assert "on GPUs at $0.20/h against $2.50/h for H100" in cheap.reason
    assert not layout(cheap, "colocated T4").feasible  # prefilling a p90 prompt on a T4: too slow
    default = smollm(0.35)
    assert default.recommended is not None
    assert default.recommended.decode_gpu == "H100"


def test_nothing_feasible_is_said_plainly() -> None:
    p = plan(request(tpot=0.001, kinds=("L4",)))
    assert p.recommended is None
    assert p.reason.startswith("no layout is feasible (colocated L4: tpot:")


def test_unknown_kind_and_bad_options() -> None:
    with pytest.raises(ConfigError, match="unknown GPU kind 'X100'"):
        plan(request(kinds=("X100",)))
    with pytest.raises(ConfigError, match=r"plan\.memory_headroom"):
        PlanOptions(memory_headroom=1.0)
    with pytest.raises(ConfigError, match=r"plan\.max_utilisation"):
        PlanOptions(max_utilisation=0.0)
