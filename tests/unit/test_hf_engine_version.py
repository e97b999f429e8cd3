"""The reference engine refuses a transformers too old for it, saying what to install: an
older one ignores the engine's cache (it takes ``past_key_values``) and a prefill would hand
out a KV of zero tokens — seen running it from the vLLM extra's environment."""

from __future__ import annotations

import pytest
import transformers

from orchestrator.errors import ConfigError
from orchestrator.workers import hf_engine
from orchestrator.workers.model_files import tiny_engine


@pytest.mark.parametrize("version", ["5.24.0", "5.25.0", "5.30.0.dev0", "6.0.0rc1"])
def test_a_supported_transformers_is_taken(version: str) -> None:
    hf_engine.check_transformers(version)


@pytest.mark.parametrize("version", ["5.19.0", "4.57.1", "5.23.9"])
def test_an_older_transformers_is_refused_with_what_to_install(version: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"transformers>=5\.24, found {version}.*pdorch\[engine\]"
    ):
        hf_engine.check_transformers(version)


def test_the_engine_checks_the_transformers_it_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    tiny_engine()  # the installed one is supported
    monkeypatch.setattr(transformers, "__version__", "5.19.0")
    with pytest.raises(ConfigError, match=r"found 5\.19\.0"):
        tiny_engine()
