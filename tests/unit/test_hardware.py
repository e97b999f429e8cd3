"""GPU profiles (`orchestrator.core.hardware`): the default table and strict overrides."""

from __future__ import annotations

import pytest

from orchestrator.core.hardware import (
    DEFAULT_GPUS,
    GpuProfile,
    get_gpu,
    gpu_table_from_mapping,
    with_prices,
)
from orchestrator.errors import ConfigError, PdorchError


def test_default_table_has_the_kinds_with_datasheet_figures() -> None:
    assert set(DEFAULT_GPUS) >= {"H100", "H200", "A100", "L40S", "L4", "T4"}
    h100 = DEFAULT_GPUS["H100"]
    # H100 SXM5: 3.35 TB/s HBM3; 1,978.9 TFLOPS bf16 with sparsity -> 989.4 dense.
    assert (h100.memory_gib, h100.memory_bandwidth_gbs, h100.bf16_tflops) == (80, 3350, 989.4)
    assert h100.fp8_tflops == 1978.9
    assert DEFAULT_GPUS["H200"].memory_bandwidth_gbs == 4800
    assert DEFAULT_GPUS["A100"].memory_bandwidth_gbs == 2039
    # L4: 242 TFLOPS fp16 / 485 fp8 *with sparsity* on the datasheet -> 121 / 242.5 dense.
    assert (DEFAULT_GPUS["L4"].fp16_tflops, DEFAULT_GPUS["L4"].fp8_tflops) == (121, 242.5)
    assert DEFAULT_GPUS["L4"].memory_bandwidth_gbs == 300
    t4 = DEFAULT_GPUS["T4"]
    assert (t4.memory_gib, t4.memory_bandwidth_gbs, t4.fp16_tflops) == (16, 320, 65)


def test_every_default_names_its_sources() -> None:
    for gpu in DEFAULT_GPUS.values():
        assert "datasheet" in gpu.source, gpu.name
        assert gpu.price_source, gpu.name
        assert gpu.price_per_hour > 0


def test_dtype_support_follows_the_peaks() -> None:
    t4, a100, l4 = DEFAULT_GPUS["T4"], DEFAULT_GPUS["A100"], DEFAULT_GPUS["L4"]
    assert (t4.supports_bf16, t4.supports_fp8, t4.supports("fp16")) == (False, False, True)
    assert t4.peak_tflops("bf16") is None
    assert (a100.supports_bf16, a100.supports_fp8) == (True, False)
    assert l4.peak_tflops("fp8") == 242.5
    with pytest.raises(ConfigError, match="unknown dtype 'int4'"):
        l4.peak_tflops("int4")


def test_nvlink_parts_allow_tensor_parallelism_pcie_cards_do_not() -> None:
    assert [DEFAULT_GPUS[k].max_tp for k in ("H100", "H200", "A100")] == [8, 8, 8]
    assert [DEFAULT_GPUS[k].max_tp for k in ("L40S", "L4", "T4")] == [1, 1, 1]


def test_get_gpu_is_case_insensitive_and_names_the_known_kinds() -> None:
    assert get_gpu(DEFAULT_GPUS, " h100 ").name == "H100"
    with pytest.raises(ConfigError, match=r"unknown GPU kind 'B200' \(known: H100, H200"):
        get_gpu(DEFAULT_GPUS, "B200")


def test_override_replaces_only_the_given_fields() -> None:
    table = gpu_table_from_mapping({"h100": {"price_per_hour": 1.99}})
    assert table["H100"].price_per_hour == 1.99
    assert table["H100"].memory_bandwidth_gbs == 3350
    assert DEFAULT_GPUS["H100"].price_per_hour == 2.50  # defaults untouched


def test_a_new_kind_needs_the_main_fields_and_zero_means_unsupported() -> None:
    spec = {
        "memory_gib": 32,
        "memory_bandwidth_gbs": 1000,
        "fp16_tflops": 100,
        "bf16_tflops": 0,
        "price_per_hour": 0.5,
        "max_tp": 2,
    }
    table = gpu_table_from_mapping({"X1": spec})
    assert table["X1"] == GpuProfile(
        "X1",
        memory_gib=32,
        memory_bandwidth_gbs=1000,
        fp16_tflops=100,
        bf16_tflops=None,
        fp8_tflops=None,
        price_per_hour=0.5,
        max_tp=2,
    )
    with pytest.raises(ConfigError, match=r"gpus\.X2: a new GPU kind needs fp16_tflops"):
        gpu_table_from_mapping(
            {"X2": {"memory_gib": 1, "memory_bandwidth_gbs": 1, "price_per_hour": 1}}
        )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"H100": {"price": 2}}, r"gpus\.H100\.price: unknown field"),
        ({"H100": {"price_per_hour": -1}}, r"gpus\.H100\.price_per_hour: must be >= 0"),
        ({"H100": {"memory_gib": 0}}, r"gpus\.H100\.memory_gib: must be > 0"),
        ({"H100": {"memory_gib": "80"}}, r"gpus\.H100\.memory_gib: must be a number"),
        ({"H100": {"memory_gib": True}}, r"gpus\.H100\.memory_gib: must be a number"),
        ({"H100": {"max_tp": 3}}, r"gpus\.H100\.max_tp: must be one of \(1, 2, 4, 8\)"),
        ({"H100": {"source": 7}}, r"gpus\.H100\.source: must be a string"),
        ({"H100": 2.5}, r"gpus\.H100: must be a table of fields"),
    ],
)
def test_bad_overrides_are_config_errors_naming_the_field(
    data: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        gpu_table_from_mapping(data)
    assert isinstance(info.value, PdorchError)


def test_with_prices_refuses_unknown_kinds() -> None:
    assert with_prices(DEFAULT_GPUS, {"T4": 0.2})["T4"].price_per_hour == 0.2
    with pytest.raises(ConfigError, match="unknown GPU kind 'Q9'"):
        with_prices(DEFAULT_GPUS, {"Q9": 1.0})
