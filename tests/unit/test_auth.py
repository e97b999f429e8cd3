"""Bearer tokens (`core.auth`), the tokens file's reloading (`control.tokens`) and Redis URL
redaction (`store.url`): pure rules and one small file, no sockets."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from orchestrator import errors
from orchestrator.control.tokens import TokenFile
from orchestrator.core.auth import (
    Caller,
    authenticate,
    bearer_token,
    parse_tokens,
    token_digest,
)
from orchestrator.store.url import has_password, redacted, with_password, without_password

TOKEN_A = "tok-a-0123456789"
TOKEN_B = "tok-b-0123456789"


def table_text(*entries: dict[str, object]) -> str:
    return json.dumps({"tokens": list(entries)})


def entry(token: str, tenant: str, **more: object) -> dict[str, object]:
    return {"sha256": token_digest(token), "tenant": tenant, **more}


def test_a_listed_token_proves_its_tenant_and_others_prove_nothing() -> None:
    table = parse_tokens(table_text(entry(TOKEN_A, "team-a", name="ci"), entry(TOKEN_B, "b")))
    assert table.lookup(TOKEN_A) == Caller("ci", "team-a")
    assert table.lookup(TOKEN_B) == Caller(f"token {token_digest(TOKEN_B)[:8]}", "b")
    for wrong in ("", "tok-a", TOKEN_A + " ", token_digest(TOKEN_A), "x" * 5000):
        assert table.lookup(wrong) is None


def test_the_file_holds_digests_not_tokens() -> None:
    text = table_text(entry(TOKEN_A, "team-a"))
    assert TOKEN_A not in text
    assert parse_tokens(text).lookup(TOKEN_A) is not None


def test_yaml_works_too() -> None:
    text = f"tokens:\n  - sha256: {token_digest(TOKEN_A).upper()}\n    tenant: team-a\n"
    assert parse_tokens(text).lookup(TOKEN_A) == Caller(
        f"token {token_digest(TOKEN_A)[:8]}", "team-a"
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("tokens: 3", "tokens file"),
        ("[1, 2]", "tokens file"),
        ("tokens: [", "tokens file"),
        (table_text({"sha256": "abc", "tenant": "t"}), "tokens[0].sha256"),
        (table_text({"sha256": token_digest("x")}), "tokens[0].tenant"),
        (table_text(entry("x", "t", tenants="u")), "tokens[0].tenants"),
        (table_text(entry("x", "t", tenants=["ok", ""])), "tokens[0].tenants[1]"),
        (table_text(entry("x", "t", extra=1)), "tokens[0]"),
        (table_text(entry("x", "t"), entry("x", "u")), "tokens[1].sha256"),
        (table_text(entry("x", "bad\ttenant")), "tokens[0].tenant"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_entry(text: str, where: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        parse_tokens(text)
    assert str(caught.value).startswith("tokens file")
    assert where in str(caught.value)


def test_the_tenant_comes_from_the_token_and_a_claim_may_only_narrow() -> None:
    caller = Caller("ci", "team-a", ("team-a-batch",))
    assert caller.tenant_for(None, "x-pdorch-tenant") == "team-a"
    assert caller.tenant_for("team-a-batch", "x-pdorch-tenant") == "team-a-batch"
    assert caller.tenant_for(" team-a ", "user") == "team-a"
    with pytest.raises(errors.PermissionDeniedError, match=r"x-pdorch-tenant.*'team-b'"):
        caller.tenant_for("team-b", "x-pdorch-tenant")
    with pytest.raises(errors.InvalidRequestError):
        caller.tenant_for("", "user")


@pytest.mark.parametrize(
    ("value", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer   abc ", "abc"),
        ("BEARER abc", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("abc", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_values(value: str | None, token: str | None) -> None:
    assert bearer_token(value) == token


def test_refusals_never_repeat_the_credential() -> None:
    table = parse_tokens(table_text(entry(TOKEN_A, "a")))
    with pytest.raises(errors.UnauthenticatedError, match="no credential"):
        authenticate(table, None)
    with pytest.raises(errors.UnauthenticatedError) as caught:
        authenticate(table, f"Bearer {TOKEN_B}")
    assert TOKEN_B not in str(caught.value)
    assert authenticate(table, f"Bearer {TOKEN_A}").tenant == "a"


def _write(path: Path, text: str, bump: int) -> None:
    path.write_text(text, encoding="utf-8")
    st = path.stat()  # a distinct mtime even within the filesystem's clock tick
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 1_000_000))


def test_the_file_is_reloaded_when_it_changes_and_a_bad_edit_keeps_the_last_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens.json"
    _write(path, table_text(entry(TOKEN_A, "a"), entry(TOKEN_B, "b")), 0)
    tokens = TokenFile(path)
    assert tokens.authenticate(f"Bearer {TOKEN_B}").tenant == "b"
    _write(path, table_text(entry(TOKEN_A, "a")), 1)  # B revoked
    with pytest.raises(errors.UnauthenticatedError):
        tokens.authenticate(f"Bearer {TOKEN_B}")
    with caplog.at_level(logging.ERROR):
        _write(path, "tokens: [", 2)  # a half-written edit
        assert tokens.authenticate(f"Bearer {TOKEN_A}").tenant == "a"
        assert tokens.authenticate(f"Bearer {TOKEN_A}").tenant == "a"
    assert len([r for r in caplog.records if "not reloaded" in r.message]) == 1
    path.unlink()
    assert tokens.authenticate(f"Bearer {TOKEN_A}").tenant == "a"
    _write(path, table_text(entry(TOKEN_B, "b")), 3)
    assert tokens.authenticate(f"Bearer {TOKEN_B}").tenant == "b"
    assert TOKEN_A not in caplog.text
    assert TOKEN_B not in caplog.text


def test_reload_forces_a_read(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    _write(path, table_text(entry(TOKEN_A, "a")), 0)
    tokens = TokenFile(path)
    st = path.stat()
    path.write_text(table_text(entry(TOKEN_B, "b")), encoding="utf-8")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same stamp but for the size
    tokens.reload()
    assert tokens.authenticate(f"Bearer {TOKEN_B}").tenant == "b"


def test_a_missing_or_malformed_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="--tokens-file"):
        TokenFile(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}", encoding="utf-8")
    with pytest.raises(errors.ConfigError, match="tokens"):
        TokenFile(bad)


@pytest.mark.parametrize(
    ("url", "shown", "bare"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@h:1/0", "redis://:***@h:1/0", "redis://h:1/0"),
        ("rediss://app:s3cret@h:1/0?ssl_ca_certs=/ca.pem", "rediss://app:***@h:1/0?ssl_ca_certs=/ca.pem",
         "rediss://app@h:1/0?ssl_ca_certs=/ca.pem"),
        ("redis://app@h:1/0", "redis://app@h:1/0", "redis://app@h:1/0"),
        ("redis://a:p%40ss@h/0", "redis://a:***@h/0", "redis://a@h/0"),
    ],
)  # fmt: skip
def test_redis_urls_are_shown_without_their_password(url: str, shown: str, bare: str) -> None:
    assert redacted(url) == shown
    assert without_password(url) == bare
    assert "s3cret" not in redacted(url)


def test_a_password_is_folded_in_percent_encoded() -> None:
    import redis.connection  # noqa: PLC0415

    url = with_password("rediss://app@h:6380/0", "p@ss:w/rd")
    assert has_password(url)
    assert "p@ss" not in redacted(url)
    parsed = redis.connection.parse_url(url)
    assert parsed["username"] == "app"
    assert parsed["password"] == "p@ss:w/rd"
    assert redis.connection.parse_url(with_password("redis://h:1/0", "x"))["password"] == "x"


def test_store_settings_never_show_the_password() -> None:
    from orchestrator.store.settings import StoreSettings  # noqa: PLC0415

    shown = repr(StoreSettings(url="redis://app:s3cret@h:1/0", prefix="p"))
    assert "s3cret" not in shown
    assert "url='redis://app:***@h:1/0'" in shown
    assert "prefix='p'" in shown
