"""``$PDORCH_REDIS_URL_FILE``: the Redis URL (password included) read once at start from a
file, as the Kubernetes operator mounts it from its Secret (never an environment variable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import build_parser
from orchestrator.cli.common import REDIS_URL_ENV, CommandError, resolve_redis
from orchestrator.core.environment import REDIS_URL_FILE_ENV

URL = "rediss://pdorch:s3cr%3At@redis.example:6380/2"
WORKER = ("worker", "--role", "decode", "--model", "tiny")


def _url_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "url"
    path.write_text(text, encoding="utf-8")
    return path


def _resolved(env: dict[str, str], *argv: str) -> str:
    args = build_parser(env).parse_args([*WORKER, *argv])
    resolve_redis(args, env)
    return str(args.redis)


def test_the_url_comes_from_the_file(tmp_path: Path) -> None:
    path = _url_file(tmp_path, URL + "\n")  # a Secret's value often ends in a newline
    assert _resolved({REDIS_URL_FILE_ENV: str(path)}) == URL


def test_the_password_file_still_applies_to_the_files_url(tmp_path: Path) -> None:
    path = _url_file(tmp_path, "redis://pdorch@redis:6379/0")
    secret = tmp_path / "password"
    secret.write_text("pw\n", encoding="utf-8")
    env = {REDIS_URL_FILE_ENV: str(path)}
    assert _resolved(env, "--redis-password-file", str(secret)) == "redis://pdorch:pw@redis:6379/0"


def test_both_environment_variables_is_an_error(tmp_path: Path) -> None:
    env = {REDIS_URL_FILE_ENV: str(_url_file(tmp_path, URL)), REDIS_URL_ENV: "redis://r:1/0"}
    with pytest.raises(CommandError, match="not both"):
        _resolved(env)


def test_a_different_redis_flag_is_an_error_not_a_silent_choice(tmp_path: Path) -> None:
    env = {REDIS_URL_FILE_ENV: str(_url_file(tmp_path, URL))}
    with pytest.raises(CommandError, match="give one"):
        _resolved(env, "--redis", "redis://elsewhere:6379/0")
    assert _resolved(env, "--redis", URL) == URL  # the same URL twice is no conflict


@pytest.mark.parametrize("text", ["", "\n", "http://not-redis/0"])
def test_an_empty_or_bad_file_is_an_error_without_its_content(tmp_path: Path, text: str) -> None:
    env = {REDIS_URL_FILE_ENV: str(_url_file(tmp_path, text))}
    with pytest.raises(CommandError, match=REDIS_URL_FILE_ENV) as caught:
        _resolved(env)
    assert "s3cr" not in str(caught.value)


def test_a_bad_url_in_the_file_is_shown_redacted(tmp_path: Path) -> None:
    env = {REDIS_URL_FILE_ENV: str(_url_file(tmp_path, "ftp://u:s3cr3t@h/0"))}
    with pytest.raises(CommandError, match=REDIS_URL_FILE_ENV) as caught:
        _resolved(env)
    assert "s3cr3t" not in str(caught.value)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="No such file"):
        _resolved({REDIS_URL_FILE_ENV: str(tmp_path / "absent")})


def test_without_the_variable_nothing_changes() -> None:
    assert _resolved({}, "--redis", "redis://r:1/0") == "redis://r:1/0"
