"""``--transport``: one list of choices (`transport.backend_names.BACKENDS`, ``ucx-read``
included) on every command that takes it, what each name builds, which pairs work, the
worker's default (tcp for simulated workers unless named) and the chaos tool's override."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import yaml

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.runner import ChaosRunner, shareable
from orchestrator.cli import build_parser, chaos, main, worker
from transport.backend_names import (
    BACKENDS,
    DEFAULT,
    UCX_READ,
    needs_ucx,
    receiver_takes,
)
from transport.backends import make_data_plane, make_receiver, make_sender

NO_ENV: dict[str, str] = {}
TAKING = [("worker", "--role", "decode"), ("up",), ("demo",)]
"""Commands with ``--transport`` (and what they need besides)."""


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(NO_ENV).parse_args(argv)


def _choices(*path: str) -> tuple[str, ...]:
    parser = build_parser(NO_ENV)
    for name in path:
        (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    (flag,) = (a for a in parser._actions if "--transport" in a.option_strings)
    assert flag.choices is not None
    return tuple(flag.choices)


def test_ucx_read_is_a_choice_everywhere() -> None:
    assert BACKENDS == ("ucx", "ucx-read", "tcp")
    assert BACKENDS[0] == DEFAULT
    for argv in TAKING:
        assert _choices(argv[0]) == BACKENDS
        assert parse(*argv, "--transport", "ucx-read").transport == UCX_READ
    assert _choices("chaos", "run") == ("auto", *BACKENDS) == sc.TRANSPORTS == chaos.TRANSPORTS


@pytest.mark.parametrize("argv", TAKING, ids=" ".join)
@pytest.mark.parametrize("junk", ["rdma", "UCX", "ucx_read", "ucx-write", ""])
def test_other_names_are_usage_errors(
    argv: tuple[str, ...], junk: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv, "--transport", junk)
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_the_help_explains_ucx_read() -> None:
    parser = build_parser(NO_ENV)
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("worker", "up", "demo"):
        help_text = " ".join(sub.choices[name].format_help().split())
        assert "ucx-read (UCX one-sided reads" in help_text, name
        assert "(default ucx" in help_text, name


def test_worker_default_is_ucx_and_tcp_for_simulated_workers() -> None:
    base = ("worker", "--role", "decode")
    assert worker.transport(parse(*base)) == "ucx"
    assert worker.transport(parse(*base, "--sim", "llama-3-8b@L4")) == "tcp"
    for name in BACKENDS:  # a named transport is honoured, simulated or not
        assert worker.transport(parse(*base, "--transport", name)) == name
        assert worker.transport(parse(*base, "--sim", "llama-3-8b@L4", "--transport", name)) == (
            name
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--port", "0", "--http-port", "0"],
        ["demo"],
        ["worker", "--role", "decode", "--redis", "redis://127.0.0.1:1/0"],
        [
            "worker",
            "--role",
            "prefill",
            "--sim",
            "llama-3-8b@L4",
            "--redis",
            "redis://127.0.0.1:1/0",
        ],
    ],
    ids=" ".join,
)
def test_ucx_read_without_ucxx_is_refused_before_anything_starts(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """A machine without the ucx extra (UCXX is installed here: its absence is simulated)."""
    monkeypatch.setenv("PDORCH_STATE", str(tmp_path / "none.json"))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a)
    )
    try:
        code = main([*argv, "--transport", "ucx-read"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 1
    assert "--transport ucx-read: UCXX is not installed" in capsys.readouterr().err


def test_each_name_builds_its_data_plane() -> None:
    planes = {name: make_data_plane(name) for name in BACKENDS}
    assert {name: (p.name, p.one_sided) for name, p in planes.items()} == {
        "ucx": ("ucx", False),
        "ucx-read": ("ucx", True),
        "tcp": ("tcp", False),
    }
    assert make_sender(UCX_READ)._plane.one_sided
    assert not make_receiver(UCX_READ)._plane.one_sided  # a UCX receiver takes either
    with pytest.raises(ValueError, match="choose from ucx, ucx-read, tcp"):
        make_data_plane("rdma")


def test_which_receiver_takes_which_sender() -> None:
    table = {(r, s): receiver_takes(r, s) for r in BACKENDS for s in BACKENDS}
    assert table == {
        ("ucx", "ucx"): True,
        ("ucx", "ucx-read"): True,
        ("ucx", "tcp"): False,
        ("ucx-read", "ucx"): True,
        ("ucx-read", "ucx-read"): True,
        ("ucx-read", "tcp"): False,
        ("tcp", "ucx"): False,
        ("tcp", "ucx-read"): False,
        ("tcp", "tcp"): True,
    }
    assert [b for b in BACKENDS if needs_ucx(b)] == ["ucx", "ucx-read"]


def test_a_chaos_scenario_runs_on_another_transport() -> None:
    decode_kill = sc.load("decode-kill")
    assert sc.with_transport(decode_kill, UCX_READ).cluster.transport == UCX_READ
    assert sc.with_transport(decode_kill, UCX_READ).faults == decode_kill.faults
    with pytest.raises(sc.ScenarioError, match="choose from auto, ucx, ucx-read, tcp"):
        sc.with_transport(decode_kill, "rdma")
    kv_on_vllm = sc.parse(
        {
            "cluster": {"engine": "vllm", "model": "smollm2", "transport": "tcp"},
            "faults": [{"at": 1.0, "kind": "drop", "target": "link:kv"}],
            "duration_s": 5,
        }
    )
    with pytest.raises(sc.ScenarioError, match="need transport tcp"):
        sc.with_transport(kv_on_vllm, UCX_READ)
    text = "cluster: {transport: ucx-read}\nfaults: [{at: 1.0, kind: kill, target: decode:random}]"
    assert sc.parse(yaml.safe_load(text)).cluster.transport == UCX_READ


def test_kv_link_faults_on_ucx_read_go_through_the_injector(tmp_path: Path) -> None:
    """Over either UCX backend the payloads leave the control link: KV-link faults use the
    prefill workers' fault injector, not a proxy (which sees only control messages)."""
    shipped = sc.load("prefill-kill-transfer")
    assert "kv" in shipped.links()
    for transport, injector in ((UCX_READ, True), ("ucx", True), ("tcp", False)):
        scenario = sc.with_transport(shipped, transport)
        runner = ChaosRunner(scenario, seed=0, out_dir=tmp_path, pictures=False)
        assert runner.kv_injector is injector, transport
        assert shareable(scenario, runner.cluster) is injector, transport  # a proxy: not shared
