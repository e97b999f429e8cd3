"""What the demo's table shows of an output (`orchestrator.demo.shown`)."""

from __future__ import annotations

import pytest

from orchestrator.demo import TRUNCATED, shown


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Paris.", "Paris."),
        ("  Hello\n\nworld  ", "Hello world"),
        ("Hello 🌍🌍\ufffd", f"Hello 🌍🌍{TRUNCATED}"),  # a character cut by --max-tokens
        ("x" * 120, "x" * 100 + TRUNCATED),
        ("x" * 99 + "\ufffd" + "y", "x" * 99 + TRUNCATED),
    ],
)
def test_an_output_is_one_line_without_a_broken_character(text: str, expected: str) -> None:
    assert shown(text) == expected
