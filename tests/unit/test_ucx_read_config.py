"""Which UCX contexts give one-sided reads peer error handling (`transport.ucx`): those in
which CMA stays eligible for error-handling endpoints."""

from __future__ import annotations

import pytest

from transport.ucx import _reads_keep_cma


def test_cma_claiming_invalidation_or_rendezvous_off_keeps_cma(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("UCX_CMA_MEMORY_INVALIDATE", raising=False)
    monkeypatch.setenv("UCX_RNDV_THRESH", "8192")  # what `import ucxx` sets
    assert _reads_keep_cma({"CMA_MEMORY_INVALIDATE": "y"})
    assert not _reads_keep_cma({})
    assert not _reads_keep_cma({"CMA_MEMORY_INVALIDATE": "n"})
    assert _reads_keep_cma({"CMA_MEMORY_INVALIDATE": "n", "RNDV_THRESH": "inf"})


def test_ucxx_init_options_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_CMA_MEMORY_INVALIDATE", "y")
    monkeypatch.setenv("UCX_RNDV_THRESH", "8192")
    assert _reads_keep_cma({})
    assert not _reads_keep_cma({"CMA_MEMORY_INVALIDATE": "n"})
