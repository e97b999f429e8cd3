"""`cli.common.write_out`: a large text reaches a parent that reads it late, whole — where
`print` on an unbuffered stdout whose write comes back short drops the tail (a `bench load`
client's samples were cut at 65,536 bytes, a full pipe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]  # starts a Python process

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, os, sys
from orchestrator.cli.common import write_out
os.set_blocking(sys.stdout.fileno(), {blocking})  # as uvloop leaves stdio it watched
write_out(json.dumps({{"samples": ["x" * 100] * 3000}}))
"""


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
def test_a_large_text_arrives_whole_when_the_parent_reads_late(blocking: bool) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(blocking=blocking)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        time.sleep(0.5)  # the parent is busy with another client: the pipe fills
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert len(out) > 65536 * 4
    assert json.loads(out) == {"samples": ["x" * 100] * 3000}
