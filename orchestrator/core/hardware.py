"""GPU kinds the planner and the cost model know: memory, bandwidth, peak throughput, price.

Figures are *dense* (no 2:4 structured sparsity) tensor-core peaks from NVIDIA's datasheets;
where a datasheet prints only the "with sparsity" figure, the dense one is half of it. Memory
is the datasheet's nominal size (the usable size nvidia-smi reports is a little lower, e.g.
79.6 GiB on an H100 80GB; the planner's memory headroom covers the difference).

Prices are **typical on-demand prices per GPU-hour in USD**, rounded, not quotes: they vary
several-fold between providers (a hyperscaler's H100 costs two to three times a specialist
GPU cloud's) and change often. They were taken from public price pages as remembered in 2025
and only partly cross-checked (see each ``price_source``); override them for your own
provider with a table (``gpu_table_from_mapping``, ``pdorch plan --gpu-file``/``--price``).

``max_tp`` is the largest tensor-parallel group the planner considers for a kind: 8 for SXM
parts on NVLink/NVSwitch, 1 for PCIe cards without NVLink (tensor parallelism over PCIe works
but is slow, and the planner does not model it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from orchestrator.errors import ConfigError

DTYPES = ("bf16", "fp16", "fp8")
"""Weight/KV data types the performance model knows (bytes per element: 2, 2, 1)."""

TP_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    memory_gib: float
    """Device memory (datasheet nominal)."""
    memory_bandwidth_gbs: float
    """Peak device-memory bandwidth, GB/s (10^9 bytes per second)."""
    fp16_tflops: float
    """Dense fp16 tensor-core peak (fp32 accumulate), 10^12 FLOP/s."""
    bf16_tflops: float | None
    """Dense bf16 tensor-core peak; None where the GPU has no bf16 (T4, Turing)."""
    fp8_tflops: float | None
    """Dense fp8 tensor-core peak; None where the GPU has no fp8 (Ampere and older)."""
    price_per_hour: float
    """USD per GPU-hour (configurable, see module docstring)."""
    max_tp: int = 1
    """Largest tensor-parallel group the planner considers (8 with NVLink, 1 without)."""
    source: str = ""
    """Where the hardware figures come from."""
    price_source: str = ""
    """Where the price comes from."""

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_tflops is not None

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_tflops is not None

    def supports(self, dtype: str) -> bool:
        return self.peak_tflops(dtype) is not None

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense tensor-core peak for ``dtype``, or None when the GPU lacks it."""
        if dtype == "bf16":
            return self.bf16_tflops
        if dtype == "fp16":
            return self.fp16_tflops
        if dtype == "fp8":
            return self.fp8_tflops
        raise ConfigError("dtype", f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


_SPARSITY = "dense = half the datasheet's with-sparsity figure"

DEFAULT_GPUS: dict[str, GpuProfile] = {
    g.name: g
    for g in (
        GpuProfile(
            "H100",
            memory_gib=80,
            memory_bandwidth_gbs=3350,
            fp16_tflops=989.4,
            bf16_tflops=989.4,
            fp8_tflops=1978.9,
            price_per_hour=2.50,
            max_tp=8,
            source=f"NVIDIA H100 datasheet, SXM5 80GB (HBM3 3.35 TB/s; {_SPARSITY})",
            price_source="specialist GPU clouds ~$2-3/GPU-h on demand in 2025; AWS p5 ~$6.9",
        ),
        GpuProfile(
            "H200",
            memory_gib=141,
            memory_bandwidth_gbs=4800,
            fp16_tflops=989.4,
            bf16_tflops=989.4,
            fp8_tflops=1978.9,
            price_per_hour=3.50,
            max_tp=8,
            source=f"NVIDIA H200 datasheet, SXM 141GB (HBM3e 4.8 TB/s; H100 compute; {_SPARSITY})",
            price_source="specialist GPU clouds ~$3-4/GPU-h on demand in 2025 (not verified)",
        ),
        GpuProfile(
            "A100",
            memory_gib=80,
            memory_bandwidth_gbs=2039,
            fp16_tflops=312,
            bf16_tflops=312,
            fp8_tflops=None,
            price_per_hour=1.50,
            max_tp=8,
            source=f"NVIDIA A100 datasheet, 80GB SXM (HBM2e 2,039 GB/s; {_SPARSITY})",
            price_source="specialist GPU clouds ~$1.2-1.8/GPU-h on demand in 2025 (not verified)",
        ),
        GpuProfile(
            "L40S",
            memory_gib=48,
            memory_bandwidth_gbs=864,
            fp16_tflops=362.05,
            bf16_tflops=362.05,
            fp8_tflops=733,
            price_per_hour=0.90,
            max_tp=1,
            source=f"NVIDIA L40S datasheet (48GB GDDR6 864 GB/s, PCIe; {_SPARSITY})",
            price_source="specialist GPU clouds ~$0.85-1.0/GPU-h on demand in 2025",
        ),
        GpuProfile(
            "L4",
            memory_gib=24,
            memory_bandwidth_gbs=300,
            fp16_tflops=121,
            bf16_tflops=121,
            fp8_tflops=242.5,
            price_per_hour=0.70,
            max_tp=1,
            source=f"NVIDIA L4 datasheet (24GB GDDR6 300 GB/s, PCIe; 242/485 sparse: {_SPARSITY})",
            price_source="Google Cloud g2-standard-4 (1x L4 with its VM) ~$0.71/h, us-central1",
        ),
        GpuProfile(
            "T4",
            memory_gib=16,
            memory_bandwidth_gbs=320,
            fp16_tflops=65,
            bf16_tflops=None,
            fp8_tflops=None,
            price_per_hour=0.35,
            max_tp=1,
            source="NVIDIA T4 datasheet (16GB GDDR6 320 GB/s, PCIe; 65 TFLOPS fp16 mixed "
            "precision; Turing: no bf16, no fp8)",
            price_source="Google Cloud T4 GPU price ~$0.35/GPU-h, us-central1 (VM extra)",
        ),
    )
}


CPU_HOST = GpuProfile(
    "CPU",
    memory_gib=16,
    memory_bandwidth_gbs=20,
    fp16_tflops=0.5,
    bf16_tflops=0.5,
    fp8_tflops=None,
    price_per_hour=0.10,
    source="a small cloud VM running the reference engine on its CPU (this project's CI)",
    price_source="order of magnitude of a 2-4 vCPU on-demand VM in 2025",
)
"""Not a GPU: what workers running the CPU reference engine (``--gpu-kind cpu``, the
default) are priced at. Kept out of `DEFAULT_GPUS`, so the planner never proposes it."""

PRICED_KINDS: dict[str, GpuProfile] = {**DEFAULT_GPUS, CPU_HOST.name: CPU_HOST}
"""What the orchestrator prices a worker's ``gpu_kind`` with."""


def get_gpu(table: Mapping[str, GpuProfile], name: str) -> GpuProfile:
    """Look a kind up by name, case-insensitively; ConfigError naming the known kinds."""
    for key, profile in table.items():
        if key.lower() == name.strip().lower():
            return profile
    raise ConfigError("gpus", f"unknown GPU kind {name!r} (known: {', '.join(table)})")


# ------------------------------------------------------------------ overrides from a file

_FIELDS = {f.name for f in fields(GpuProfile)} - {"name"}
_REQUIRED_NEW = {"memory_gib", "memory_bandwidth_gbs", "fp16_tflops", "price_per_hour"}


def _number(path: str, value: object, *, minimum: float, inclusive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(path, f"must be a number, got {value!r}")
    if value < minimum or (value == minimum and not inclusive):
        bound = ">=" if inclusive else ">"
        raise ConfigError(path, f"must be {bound} {minimum}, got {value!r}")
    return float(value)


def _optional_peak(path: str, value: object) -> float | None:
    """A peak that may be absent: ``0`` or ``false`` (TOML has no null) or null means none."""
    if value is None or value is False or value == 0:
        return None
    return _number(path, value, minimum=0.0)


def _profile_field(path: str, key: str, value: object) -> object:
    if key in ("memory_gib", "memory_bandwidth_gbs", "fp16_tflops"):
        return _number(path, value, minimum=0.0)
    if key == "price_per_hour":
        return _number(path, value, minimum=0.0, inclusive=True)
    if key in ("bf16_tflops", "fp8_tflops"):
        return _optional_peak(path, value)
    if key == "max_tp":
        if isinstance(value, bool) or value not in TP_DEGREES:
            raise ConfigError(path, f"must be one of {TP_DEGREES}, got {value!r}")
        return value
    if not isinstance(value, str):
        raise ConfigError(path, f"must be a string, got {value!r}")
    return value


def gpu_table_from_mapping(
    data: Mapping[str, object], base: Mapping[str, GpuProfile] | None = None, *, path: str = "gpus"
) -> dict[str, GpuProfile]:
    """Apply overrides to a GPU table (``DEFAULT_GPUS`` by default); strict.

    ``data`` maps a kind to a table of fields. For a known kind (matched case-insensitively)
    any subset of fields replaces the defaults, e.g. ``{"H100": {"price_per_hour": 2.1}}``; a
    new kind must give at least memory_gib, memory_bandwidth_gbs, fp16_tflops and
    price_per_hour. Unknown fields, wrong types and out-of-range values raise ConfigError
    naming the field (``gpus.H100.price_per_hour``).
    """
    table = dict(DEFAULT_GPUS if base is None else base)
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"must be a table of GPU kinds, got {type(data).__name__}")
    for name, spec in data.items():
        where = f"{path}.{name}"
        if not isinstance(spec, Mapping):
            raise ConfigError(where, f"must be a table of fields, got {type(spec).__name__}")
        values: dict[str, object] = {}
        for key, value in spec.items():
            if key not in _FIELDS:
                known = ", ".join(sorted(_FIELDS))
                raise ConfigError(f"{where}.{key}", f"unknown field (known: {known})")
            values[key] = _profile_field(f"{where}.{key}", key, value)
        existing = next((k for k in table if k.lower() == str(name).lower()), None)
        if existing is not None:
            table[existing] = replace(table[existing], **values)  # type: ignore[arg-type]
            continue
        missing = sorted(_REQUIRED_NEW - values.keys())
        if missing:
            raise ConfigError(where, f"a new GPU kind needs {', '.join(missing)}")
        values.setdefault("bf16_tflops", None)
        values.setdefault("fp8_tflops", None)
        table[str(name)] = GpuProfile(name=str(name), **values)  # type: ignore[arg-type]
    return table


def with_prices(
    table: Mapping[str, GpuProfile], prices: Mapping[str, float]
) -> dict[str, GpuProfile]:
    """A copy of ``table`` with some kinds' prices replaced (``{"H100": 2.1}``)."""
    for name in prices:
        get_gpu(table, name)  # an unknown kind is an error here, not a new kind
    return gpu_table_from_mapping(
        {name: {"price_per_hour": price} for name, price in prices.items()}, table, path="price"
    )
