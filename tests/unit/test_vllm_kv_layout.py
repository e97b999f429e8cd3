"""The connector's pure parts: block layout, header checks, parameters, the scheduler side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from orchestrator.core.prefix import block_digests
from orchestrator.workers.vllm import kv, kv_channel, kv_layout, kv_params
from orchestrator.workers.vllm.connector_scheduler import Scheduled, SchedulerSide
from transport import errors, wire

LAYOUT = kv_layout.BlockLayout(
    n_layers=3, block_size=4, block_shape=(2, 4, 8), layout="cpu-LBHNC", dtype=wire.DType.FLOAT32
)


def test_blocks_cover_tokens_with_a_partial_last_block() -> None:
    assert [LAYOUT.blocks_for(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert LAYOUT.layer_shape(5) == wire.LayerShape(k=(2, 2, 4, 8), v=(2, 2, 4, 8))
    assert LAYOUT.kv_bytes(5) == 3 * 2 * (2 * 2 * 4 * 8) * 4
    assert LAYOUT.kv_bytes(5, wire.DType.FLOAT16) == LAYOUT.kv_bytes(5) // 2


def test_send_blocks_are_the_prompts_leading_blocks() -> None:
    assert kv_layout.send_blocks([7, 3, 9, 1], 5, 4) == [7, 3]
    assert kv_layout.send_blocks([7, 3], 8, 4) == [7, 3]
    with pytest.raises(ValueError, match="need 3 blocks"):
        kv_layout.send_blocks([7, 3], 9, 4)
    with pytest.raises(ValueError, match="0 tokens"):
        kv_layout.send_blocks([7], 0, 4)


def test_load_plan_skips_locally_cached_blocks() -> None:
    plan = kv_layout.load_plan([10, 11, 12, 13], computed_tokens=4, load_tokens=10, block_size=4)
    assert plan == kv_layout.LoadPlan(src=range(1, 3), dst=(11, 12))
    whole = kv_layout.load_plan([10, 11, 12], computed_tokens=0, load_tokens=9, block_size=4)
    assert whole == kv_layout.LoadPlan(src=range(3), dst=(10, 11, 12))
    with pytest.raises(ValueError, match="whole blocks"):
        kv_layout.load_plan([10, 11], computed_tokens=3, load_tokens=6, block_size=4)
    with pytest.raises(ValueError, match="do not fit"):
        kv_layout.load_plan([10], computed_tokens=0, load_tokens=6, block_size=4)


def _header(**changes: Any) -> wire.KvHeader:
    fields: dict[str, Any] = {
        "request_id": "r",
        "epoch": 1,
        "fingerprint": LAYOUT.fingerprint("model-a"),
        "dtype": wire.DType.FLOAT32,
        "token_count": 5,
        "layers": (LAYOUT.layer_shape(5),) * 3,
    }
    return wire.KvHeader(**{**fields, **changes})


def test_receiver_spec_accepts_only_matching_block_headers() -> None:
    spec = kv_layout.model_spec("model-a", LAYOUT, max_tokens=100)
    exp = wire.Expectation(max_kv_bytes=1 << 30, model=spec)
    wire.check_expected(_header(), exp)
    other_bs = kv_layout.BlockLayout(3, 8, (2, 8, 8), "cpu-LBHNC", wire.DType.FLOAT32)
    refused = [
        _header(fingerprint=other_bs.fingerprint("model-a")),  # block size differs
        _header(fingerprint=LAYOUT.fingerprint("model-b")),  # another model
        _header(layers=(LAYOUT.layer_shape(9),) * 3),  # shapes do not fit the token count
        _header(layers=(LAYOUT.layer_shape(5),) * 2),  # layer count
        _header(token_count=101, layers=(LAYOUT.layer_shape(101),) * 3),  # beyond the context
    ]
    for header in refused:
        with pytest.raises(errors.HeaderRejectedError):
            wire.check_expected(header, exp)


def test_params_round_trip_and_reject_garbage() -> None:
    pre = kv_params.parse(kv.prefill_params("r1", 2, "10.0.0.1:5000", "float16"))
    assert pre == kv_params.PrefillParams("r1", 2, "10.0.0.1:5000", "float16")
    dec = kv_params.parse(kv.decode_params("r1", 2, 17))
    assert dec == kv_params.DecodeParams("r1", 2, 17)
    assert kv_params.parse(None) is None
    assert kv_params.parse({"do_remote_prefill": True}) is None  # another connector's params
    bad: list[dict[str, Any]] = [
        {"role": "prefill", "request_id": "r", "epoch": 1, "target": "nohostport"},
        {"role": "prefill", "request_id": "r", "epoch": 1, "target": "h:1", "kv_dtype": "int4"},
        {"role": "decode", "request_id": "r", "epoch": -1, "num_tokens": 3},
        {"role": "decode", "request_id": "r", "epoch": True, "num_tokens": 3},
        {"role": "decode", "request_id": "", "epoch": 1, "num_tokens": 3},
        {"role": "decode", "request_id": "r", "epoch": 1, "num_tokens": 0},
        {"role": "both", "request_id": "r", "epoch": 1},
    ]
    for p in bad:
        with pytest.raises(kv_params.ParamsError):
            kv_params.parse({kv_params.KEY: p})
    with pytest.raises(ValueError, match="dtype"):
        kv.prefill_params("r", 1, "h:1", "int4")


def test_prefill_params_carry_the_decodes_prefix() -> None:
    digest = bytes(range(32))
    pre = kv_params.parse(kv.prefill_params("r", 1, "h:1", "", 128, digest))
    assert isinstance(pre, kv_params.PrefillParams)
    assert (pre.prefix_tokens, pre.prefix_digest) == (128, digest)
    assert kv_params.parse(kv.prefill_params("r", 1, "h:1", "")) == kv_params.PrefillParams(
        "r", 1, "h:1", ""
    )
    base = {"role": "prefill", "request_id": "r", "epoch": 1, "target": "h:1"}
    for bad in ({"prefix_tokens": 4, "prefix_hash": "ab"}, {"prefix_tokens": -4},
                {"prefix_tokens": 4, "prefix_hash": "zz" * 32}):  # fmt: skip
        with pytest.raises(kv_params.ParamsError, match="prefix"):
            kv_params.parse({kv_params.KEY: {**base, **bad}})
    sent = kv_params.PrefillTransfer(ok=True, kv_bytes=7, prefix_tokens=128, prefix_refused=False)
    assert kv_params.PrefillTransfer.from_dict(sent.to_dict()) == sent


def test_prefill_result_fails_closed() -> None:
    ok = kv_params.PrefillTransfer(ok=True, kv_bytes=10, transfer_ms=1.5)
    assert kv.prefill_result({kv_params.KEY: {kv_params.RESULT: ok.to_dict()}}) == ok
    missing: list[dict[str, Any] | None] = [
        None,
        {},
        {kv_params.KEY: {}},
        {kv_params.KEY: {kv_params.RESULT: "yes"}},
    ]
    for params in missing:
        result = kv.prefill_result(params)
        assert not result.ok
        assert result.error
    wrong = kv.prefill_result({kv_params.KEY: {kv_params.RESULT: {"ok": True, "kv_bytes": "x"}}})
    assert not wrong.ok


def test_connector_config_is_vllms_kv_transfer_config() -> None:
    cfg = kv.connector_config(
        "decode",
        backend="tcp",
        kv_address="0.0.0.0:0",
        fingerprint="fp",
        hold_s=30,
        timeout_s=10,
        control_path="/tmp/x.sock",
    )
    assert cfg["kv_connector"] == "PdorchConnector"
    assert cfg["kv_connector_module_path"] == "orchestrator.workers.vllm.connector"
    assert cfg["kv_role"] == "kv_consumer"
    assert cfg["kv_load_failure_policy"] == "fail"
    with pytest.raises(ValueError, match="control_path"):
        kv.connector_config(
            "decode", backend="tcp", kv_address="h:0", fingerprint="f", hold_s=1, timeout_s=1
        )


def test_channel_messages_are_bounded_json_objects() -> None:
    msg = {"id": 3, "op": "release", "request_id": "r", "epoch": 2}
    assert kv_channel.decode(kv_channel.encode(msg)) == msg
    for line in (b"[1]", b"{nope", b"x" * (kv_channel.MAX_LINE + 1)):
        with pytest.raises(kv_channel.ChannelError):
            kv_channel.decode(line)


# ------------------------------------------------------------------ scheduler side


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_tokens: int
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None = None


def test_prefill_pushes_in_the_step_that_completes_its_prompt() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("v1", kv.prefill_params("r", 1, "h:1", ""), 10, 10)
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = {"v1": [5, 6, 7]}
    first = side.build([Scheduled("v1", 0, 8)], blocks.__getitem__)  # chunk 1 of 2
    assert first.saves == []
    second = side.build([Scheduled("v1", 8, 2)], blocks.__getitem__)
    (save,) = second.saves
    assert (save.block_ids, save.num_tokens, save.params.request_id) == ((5, 6, 7), 10, "r")
    assert side.build([Scheduled("v1", 10, 1)], blocks.__getitem__).saves == []  # only once


@pytest.mark.parametrize("outcome_first", [False, True])
def test_prefill_outcome_lands_in_the_finished_output(outcome_first: bool) -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("v1", kv.prefill_params("r", 1, "h:1", ""), 5, 5)
    side.on_new_request(req)
    outcome = kv_params.PrefillTransfer(ok=True, kv_bytes=99).to_dict()
    if outcome_first:
        side.on_outcomes({"v1": outcome})
    delay, params = side.request_finished(req)
    if not outcome_first:
        side.on_outcomes({"v1": outcome})
    side.step_done()
    assert delay is False  # the step waited for the transfer: blocks may go at once
    assert kv.prefill_result(params).ok
    assert kv.prefill_result(params).kv_bytes == 99


def test_prefill_without_an_outcome_reads_as_failed() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("v1", kv.prefill_params("r", 1, "h:1", ""), 5, 5)
    _, params = side.request_finished(req)
    side.step_done()
    side.on_outcomes({"v1": kv_params.PrefillTransfer(ok=True).to_dict()})  # too late
    assert not kv.prefill_result(params).ok


def test_decode_loads_its_tokens_asynchronously_then_cancels_on_abort() -> None:
    side = SchedulerSide(block_size=4)
    # prompt (9 tokens) + first generated token: 10 tokens, 9 of them loaded
    req = FakeRequest("v2", kv.decode_params("r", 3, 9), 10, 10)
    assert side.get_num_new_matched_tokens(req, 4) == (5, True)  # 4 cached locally
    assert side.get_num_new_matched_tokens(req, 4) == (5, True)  # side-effect free
    side.update_state_after_alloc(req, [20, 21, 22], 5)
    plan = side.build([], lambda _: [])
    (load,) = plan.loads
    assert load.plan == kv_layout.LoadPlan(src=range(1, 3), dst=(21, 22))
    assert (load.params.request_id, load.params.epoch) == ("r", 3)
    assert side.get_num_new_matched_tokens(req, 4) == (0, False)  # already loading
    assert side.request_finished(req) == (False, None)
    assert side.build([], lambda _: []).cancels == ["v2"]


def test_decode_load_names_the_blocks_its_local_cache_hit_holds() -> None:
    """The worker side checks a suffix-only KV against these: pdorch's chained digests of
    the request's own locally cached blocks."""
    side = SchedulerSide(block_size=4)
    prompt = list(range(100, 110))
    req = FakeRequest("v7", kv.decode_params("r", 1, 9), 10, 10, prompt)
    side.update_state_after_alloc(req, [20, 21, 22], 1)  # 8 tokens (2 blocks) cached
    (load,) = side.build([], lambda _: []).loads
    assert load.held == tuple(block_digests(prompt[:8], 4))
    cold = FakeRequest("v8", kv.decode_params("r", 1, 9), 10, 10, prompt)
    side.update_state_after_alloc(cold, [23, 24, 25], 9)
    assert side.build([], lambda _: []).loads[0].held == ()


def test_decode_load_leaves_the_last_token_to_compute() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("v3", kv.decode_params("r", 1, 50), 10, 10)  # claims more than it has
    assert side.get_num_new_matched_tokens(req, 0) == (9, True)
    full = FakeRequest("v4", kv.decode_params("r", 1, 8), 9, 9)
    assert side.get_num_new_matched_tokens(full, 8) == (0, False)  # all cached locally


def test_a_finished_load_is_not_cancelled() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("v5", kv.decode_params("r", 1, 4), 5, 5)
    side.update_state_after_alloc(req, [1, 2], 4)
    side.on_loads_finished({"v5"})
    side.request_finished(req)
    assert side.build([], lambda _: []).cancels == []


def test_a_loaded_request_that_vllm_preempts_recomputes_instead_of_loading_again() -> None:
    side = SchedulerSide(block_size=4)
    req = FakeRequest("v6", kv.decode_params("r", 1, 4), 5, 5)
    assert side.get_num_new_matched_tokens(req, 0) == (4, True)
    side.update_state_after_alloc(req, [1, 2], 4)
    side.on_loads_finished({"v6"})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
