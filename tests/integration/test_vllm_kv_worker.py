"""The connector's worker side without vLLM: two `WorkerSide`s over real TCP on loopback.

Paged caches are plain torch tensors in the CPU backend's layout ([blocks, kv_heads,
block_size, 2 * head_dim]); the test plays the model runner (bind, save each layer, wait for
the save; bind loads, poll transfer results) and checks which bytes land in which blocks.
Runs in the main venv (torch, no vLLM); each case takes well under a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from orchestrator.workers.vllm import kv, kv_layout
from orchestrator.workers.vllm.connector_scheduler import LoadSpec, SaveSpec, StepPlan
from orchestrator.workers.vllm.connector_worker import LayerViews, WorkerConfig, WorkerSide
from orchestrator.workers.vllm.kv_loop import LoopThread
from orchestrator.workers.vllm.kv_params import DecodeParams, PrefillParams
from transport.ucx import ucx_available

BS, HEADS, DIM, LAYERS, BLOCKS = 4, 2, 8, 3, 10
LOAD_TIMEOUT_S = 1.0
BACKENDS = [
    pytest.param(
        "ucx",
        marks=[
            pytest.mark.ucx,
            pytest.mark.skipif(not ucx_available(), reason="ucxx not installed"),
        ],
    ),
    "tcp",
]


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, HEADS, BS, 2 * DIM, generator=g)
        for i in range(LAYERS)
    }


@dataclass
class Pair:
    prefill: WorkerSide
    decode: WorkerSide
    src: dict[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    control: kv.DecodeKvControl
    control_loop: LoopThread
    kv_address: str

    def push(
        self,
        rid: str,
        epoch: int,
        blocks: tuple[int, ...],
        tokens: int,
        dtype: str = "",
        prefix: tuple[int, bytes] = (0, b""),
        layer_s: float = 0.0,
    ) -> dict[str, object]:
        """Push blocks ``blocks``, the forward taking ``layer_s`` to compute each layer."""
        params = PrefillParams(rid, epoch, self.kv_address, dtype, prefix[0], prefix[1].hex())
        spec = SaveSpec("v-" + rid, params, blocks, tokens)
        self.prefill.begin_step(StepPlan(saves=[spec]))
        for name, t in self.src.items():  # the forward: each layer saved as it is computed
            time.sleep(layer_s)
            self.prefill.save_layer(name, t)
        self.prefill.wait_for_save()
        return self.prefill.take_outcomes()["v-" + rid]

    def load(
        self,
        rid: str,
        epoch: int,
        tokens: int,
        block_ids: list[int],
        cancel: bool = False,
        held: tuple[bytes, ...] = (),
    ) -> tuple[set[str], set[str], float]:
        """Load into ``block_ids``, the first ``len(held)`` of them a local prefix-cache hit."""
        plan = kv_layout.load_plan(block_ids, len(held) * BS, tokens, BS)
        spec = LoadSpec("d-" + rid, DecodeParams(rid, epoch, tokens), plan, held)
        started = time.monotonic()
        self.decode.begin_step(StepPlan(loads=[spec]))
        if cancel:
            self.decode.begin_step(StepPlan(cancels=["d-" + rid]))
        deadline = started + LOAD_TIMEOUT_S + 5
        while True:
            finished, failed = self.decode.transfer_results()
            if finished:
                return finished, failed, time.monotonic() - started
            assert time.monotonic() < deadline, "the load never ended"
            time.sleep(0.01)  # the model runner polls once per engine step


@contextlib.contextmanager
def make_pair(backend: str = "tcp", hold_s: float = 30.0) -> Iterator[Pair]:
    """A prefill and a decode side; the decode side frees a KV nobody loads after ``hold_s``."""
    src, dst = caches(1), caches(2)
    prefill = WorkerSide(WorkerConfig("prefill", backend, "", "fp", 30.0, 5.0, ""), BS, 1000)
    prefill.register(src)
    control = kv.DecodeKvControl(poll_s=0.05)
    loop = LoopThread("test-control")
    loop.start()
    started = loop.submit(control.start(10))
    cfg = WorkerConfig(
        "decode", backend, "127.0.0.1:0", "fp", hold_s, LOAD_TIMEOUT_S, control.control_path
    )
    decode = WorkerSide(cfg, BS, 1000)
    decode.register(dst)
    try:
        yield Pair(prefill, decode, src, dst, control, loop, started.result(10))
    finally:
        prefill.shutdown()
        decode.shutdown()
        loop.stop(control.close())


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """TCP unless the test asks for a backend (indirect)."""
    with make_pair(getattr(request, "param", "tcp")) as p:
        yield p


def _kv(c: dict[str, torch.Tensor], layer: int, block: int) -> torch.Tensor:
    return list(c.values())[layer][block]


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_pushed_blocks_land_in_the_decodes_blocks(pair: Pair) -> None:
    untouched = _kv(pair.dst, 0, 0).clone()
    outcome = pair.push("r1", 1, blocks=(3, 7), tokens=6)
    assert outcome["ok"], outcome
    assert outcome["kv_bytes"] == LAYERS * 2 * 2 * HEADS * BS * DIM * 4
    finished, failed, _ = pair.load("r1", 1, 6, [5, 1, 9])
    assert finished == {"d-r1"}
    assert not failed
    for layer in range(LAYERS):
        assert torch.equal(_kv(pair.dst, layer, 5), _kv(pair.src, layer, 3))
        assert torch.equal(_kv(pair.dst, layer, 1), _kv(pair.src, layer, 7))
    assert torch.equal(_kv(pair.dst, 0, 0), untouched)  # no other block written


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_a_forward_slower_than_the_decodes_idle_deadline_still_lands(pair: Pair) -> None:
    """Each layer takes 3× the decode receiver's idle deadline to compute: the push keeps
    the link alive meanwhile (ALIVE every ``keepalive_s``), so the decode side does not
    take a slow prefill for a dead one (the push used to fail: "connection to peer lost")."""
    assert pair.decode._receiver is not None
    assert pair.prefill._sender is not None
    rx, tx = pair.decode._receiver, pair.prefill._sender
    # (The decode's transfer deadline is the test's 1 s load timeout: lifted, not the point.)
    rx.settings = dataclasses.replace(rx.settings, idle_timeout_s=0.2, transfer_timeout_s=30)
    tx.settings = dataclasses.replace(tx.settings, keepalive_s=0.05)
    outcome = pair.push("slow", 1, blocks=(2, 4), tokens=8, layer_s=0.6)
    assert outcome["ok"], outcome
    finished, failed, _ = pair.load("slow", 1, 8, [6, 8])
    assert (finished, failed) == ({"d-slow"}, set())
    for layer in range(LAYERS):
        assert torch.equal(_kv(pair.dst, layer, 6), _kv(pair.src, layer, 2))
        assert torch.equal(_kv(pair.dst, layer, 8), _kv(pair.src, layer, 4))


def test_fp16_on_the_wire_lands_within_its_rounding(pair: Pair) -> None:
    outcome = pair.push("r16", 1, blocks=(2,), tokens=3, dtype="float16")
    assert outcome["ok"], outcome
    assert outcome["kv_bytes"] == LAYERS * 2 * HEADS * BS * DIM * 2
    _, failed, _ = pair.load("r16", 1, 3, [4])
    assert not failed
    torch.testing.assert_close(_kv(pair.dst, 1, 4), _kv(pair.src, 1, 2), rtol=2**-10, atol=1e-6)


def test_a_kv_that_never_arrives_fails_the_load_at_its_timeout(pair: Pair) -> None:
    before = _kv(pair.dst, 0, 6).clone()
    finished, failed, took = pair.load("nobody", 1, 4, [6])
    assert finished == failed == {"d-nobody"}
    assert LOAD_TIMEOUT_S <= took < LOAD_TIMEOUT_S + 2
    assert torch.equal(_kv(pair.dst, 0, 6), before)


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_stale_epochs_are_refused_before_any_block_is_written(pair: Pair) -> None:
    assert pair.push("z", 5, blocks=(1,), tokens=4)["ok"]
    zombie = pair.push("z", 4, blocks=(2,), tokens=4)
    assert not zombie["ok"]
    assert "epoch" in str(zombie["error"])
    assert zombie["retryable"] is False
    before = _kv(pair.dst, 0, 8).clone()
    _, failed, _ = pair.load("z", 4, 4, [8])  # a decode of the old epoch
    assert failed == {"d-z"}
    assert torch.equal(_kv(pair.dst, 0, 8), before)
    _, failed, _ = pair.load("z", 5, 4, [8])  # the current epoch still loads
    assert not failed
    assert torch.equal(_kv(pair.dst, 0, 8), _kv(pair.src, 0, 1))


def test_a_cancelled_load_writes_nothing(pair: Pair) -> None:
    assert pair.push("c", 1, blocks=(4,), tokens=2)["ok"]
    before = _kv(pair.dst, 2, 3).clone()
    finished, failed, _ = pair.load("c", 1, 2, [3], cancel=True)
    assert finished == failed == {"d-c"}
    assert torch.equal(_kv(pair.dst, 2, 3), before)


def test_push_to_nowhere_fails_retryably(pair: Pair) -> None:
    pair.kv_address = "127.0.0.1:1"
    outcome = pair.push("lost", 1, blocks=(0,), tokens=1)
    assert not outcome["ok"]
    assert outcome["retryable"] is True


def test_release_frees_held_kv_and_respects_epochs(pair: Pair) -> None:
    outcome = pair.push("h", 2, blocks=(0, 1), tokens=8)
    assert outcome["ok"]
    deadline = time.monotonic() + 5
    while pair.control.held_bytes() != outcome["kv_bytes"]:
        assert time.monotonic() < deadline, pair.control.held_bytes()
        time.sleep(0.02)  # held bytes are polled every 50 ms here
    release = pair.control_loop.submit
    assert not release(pair.control.release("h", 1)).result(5)  # an older epoch frees nothing
    assert release(pair.control.release("h", 2)).result(5)
    while pair.control.held_bytes() != 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    _, failed, _ = pair.load("h", 2, 8, [2, 3])  # released: nothing to load
    assert failed == {"d-h"}


def test_layer_views_split_the_cpu_layout_into_k_and_v() -> None:
    c = caches(3)
    views = LayerViews(c, BS)
    t = next(iter(c.values()))
    assert views.layout.block_shape == (HEADS, BS, DIM)
    # K of (block 2, head 1) is the first BS rows of that (block, head)'s 2*BS rows of DIM.
    rows = t[2, 1].reshape(2 * BS, DIM)
    assert torch.equal(views.k[0][2, 1], rows[:BS])
    assert torch.equal(views.v[0][2, 1], rows[BS:])
    with pytest.raises(ValueError, match="unsupported"):
        LayerViews({"x": torch.zeros(4, 2, 8, 16)}, BS)


def _wait_held(pair: Pair, done: object, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done(pair.control.held_bytes()):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: held {pair.control.held_bytes()}"
        time.sleep(0.02)  # held bytes are polled every 50 ms here


def test_a_partial_kv_from_a_prefill_killed_mid_transfer_is_discarded(pair: Pair) -> None:
    """The prefill engine dies after one layer of three: the decode side frees what it had
    reserved and received, and a load of that KV fails without writing a block."""
    spec = SaveSpec("v-cut", PrefillParams("cut", 1, pair.kv_address, ""), (0, 1), 8)
    pair.prefill.begin_step(StepPlan(saves=[spec]))
    name, first = next(iter(pair.src.items()))
    pair.prefill.save_layer(name, first)
    _wait_held(pair, lambda held: held > 0, "the transfer never started")
    pair.prefill.shutdown()  # its process is gone: the connection breaks mid-transfer
    _wait_held(pair, lambda held: held == 0, "the partial KV is still held")
    before = [_kv(pair.dst, layer, 2).clone() for layer in range(LAYERS)]
    finished, failed, _ = pair.load("cut", 1, 8, [2, 3])
    assert finished == failed == {"d-cut"}
    assert all(torch.equal(_kv(pair.dst, i, 2), b) for i, b in enumerate(before))


HOLD_S = 0.4


def test_a_kv_whose_hold_lease_expired_is_never_loaded() -> None:
    """Nobody loads the pushed KV within its lease: the receiver frees it, and a load that
    comes later fails instead of reading freed memory."""
    with make_pair(hold_s=HOLD_S) as pair:
        outcome = pair.push("stale", 1, blocks=(5,), tokens=4)
        assert outcome["ok"], outcome
        _wait_held(pair, lambda held: held > 0, "the pushed KV never showed as held")
        _wait_held(pair, lambda held: held == 0, "the lease never freed the KV")
        before = _kv(pair.dst, 1, 7).clone()
        finished, failed, _ = pair.load("stale", 1, 4, [7])
        assert finished == failed == {"d-stale"}
        assert torch.equal(_kv(pair.dst, 1, 7), before)


def test_a_kv_arriving_after_its_load_gave_up_never_lands_in_its_blocks() -> None:
    """The load timed out (vLLM failed the request and may reuse its blocks); the KV pushed
    afterwards is held like any unclaimed KV, freed by its lease, and never copied."""
    with make_pair(hold_s=HOLD_S) as pair:
        before = _kv(pair.dst, 0, 9).clone()
        finished, failed, took = pair.load("late", 1, 4, [9])
        assert finished == failed == {"d-late"}
        assert took >= LOAD_TIMEOUT_S
        assert pair.push("late", 1, blocks=(6,), tokens=4)["ok"]
        _wait_held(pair, lambda held: held > 0, "the late KV never showed as held")
        _wait_held(pair, lambda held: held == 0, "the late KV is still held")
        assert pair.decode.transfer_results() == (set(), set())  # no load left to finish
        assert torch.equal(_kv(pair.dst, 0, 9), before)


PREFIX = hashlib.sha256(b"the decode's first block").digest()


def test_a_suffix_only_push_sends_the_blocks_after_the_decodes_prefix(pair: Pair) -> None:
    """Issue 20 item 3 with vLLM's blocks: the decode side holds the prompt's first block
    (its cache's events say so); the push leaves it out and the load lands the rest after it."""
    pair.decode.holds_prefix = PREFIX.__eq__
    whole = LAYERS * 2 * HEADS * BS * DIM * 4  # per block
    outcome = pair.push("s", 1, blocks=(3, 7, 2), tokens=10, prefix=(BS, PREFIX))
    assert outcome["ok"], outcome
    assert (outcome["prefix_tokens"], outcome["prefix_refused"]) == (BS, False)
    assert outcome["kv_bytes"] == 2 * whole  # 2 of the prompt's 3 blocks
    mine = _kv(pair.dst, 0, 5).clone()  # the decode's own cached block
    _, failed, _ = pair.load("s", 1, 10, [5, 1, 9], held=(PREFIX,))
    assert not failed
    assert torch.equal(_kv(pair.dst, 0, 5), mine)
    for layer in range(LAYERS):
        assert torch.equal(_kv(pair.dst, layer, 1), _kv(pair.src, layer, 7))
        assert torch.equal(_kv(pair.dst, layer, 9), _kv(pair.src, layer, 2))


def test_a_decode_lacking_the_prefix_refuses_and_gets_the_whole_kv(pair: Pair) -> None:
    outcome = pair.push("w", 1, blocks=(3, 7, 2), tokens=10, prefix=(BS, PREFIX))
    assert outcome["ok"], outcome
    assert (outcome["prefix_tokens"], outcome["prefix_refused"]) == (0, True)
    assert outcome["kv_bytes"] == 3 * LAYERS * 2 * HEADS * BS * DIM * 4
    _, failed, _ = pair.load("w", 1, 10, [5, 1, 9])
    assert not failed
    assert torch.equal(_kv(pair.dst, 2, 5), _kv(pair.src, 2, 3))


def test_a_suffix_extending_another_prefix_is_never_loaded(pair: Pair) -> None:
    """Accepted at its header, but the blocks vLLM's cache gave the request are other
    tokens (or fewer, evicted since): the load fails, nothing is written."""
    pair.decode.holds_prefix = PREFIX.__eq__
    assert pair.push("x", 1, blocks=(3, 7), tokens=8, prefix=(BS, PREFIX))["ok"]
    before = _kv(pair.dst, 1, 6).clone()
    other = hashlib.sha256(b"other").digest()
    _, failed, _ = pair.load("x", 1, 8, [4, 6], held=(other,))
    assert failed == {"d-x"}
    assert torch.equal(_kv(pair.dst, 1, 6), before)
    assert pair.push("y", 1, blocks=(3, 7), tokens=8, prefix=(BS, PREFIX))["ok"]
    _, failed, _ = pair.load("y", 1, 8, [4, 6])  # the prefix was evicted: no local hit
    assert failed == {"d-y"}
    assert torch.equal(_kv(pair.dst, 1, 6), before)
