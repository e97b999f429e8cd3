"""free_port: ports that nothing else on the machine can take before our child binds them."""

from __future__ import annotations

import socket

import pytest

from orchestrator import ports
from orchestrator.ports import ephemeral_floor, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    floor = ephemeral_floor()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)  # never handed out twice
    assert all(20000 <= p < floor for p in ports)  # no bind(0) or connect() can take them
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # and free to bind


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draw lands on a port someone holds: the next draw is taken instead."""
    monkeypatch.delenv(ports.SLICE_ENV, raising=False)  # every port a draw
    held = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", held))
        # The held port, then the ports after it: another test process may hold one of
        # those too (xdist), so the draw goes on to the next (once: a StopIteration here).
        draws = iter(range(held - 20000, held - 20000 + 50))
        monkeypatch.setattr("orchestrator.ports.secrets.randbelow", lambda _n: next(draws))
        ports._recent_ports.clear()
        got = ports.free_port()
        assert got != held
        assert held < got < held + 50  # the next draws, in order, taken instead


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_slice_hands_out_only_its_own_ports(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes given different slices (parallel test workers) never pick the same port."""
    monkeypatch.setenv(ports.SLICE_ENV, f"{index}/3")
    got = [free_port() for _ in range(200)]
    assert {p % 3 for p in got} == {index}
    assert all(20000 <= p < ephemeral_floor() for p in got)


@pytest.mark.parametrize("raw", ["2/2", "x/2", "1", "-1/2"])
def test_a_malformed_slice_is_refused(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ports.SLICE_ENV, raw)
    with pytest.raises(ValueError, match="want i/n"):
        free_port()


def test_no_slice_is_every_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ports.SLICE_ENV, raising=False)
    assert ports.port_slice() == (0, 1)
    assert {free_port() % 2 for _ in range(200)} == {0, 1}
