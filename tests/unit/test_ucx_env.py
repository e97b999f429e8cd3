"""A reference UCX program the bench starts (NIXL) gets the environment without the UCX
defaults ``import ucxx`` set in our process (`transport.ucx_env`): with ucxx's
``UCX_RNDV_THRESH=8192`` NIXL's reads fell back to emulation over tcp/lo (~5× slower)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ucx

PROBE = """
import json, os
from transport import ucx, ucx_env
ucx._import_ucxx()
child = ucx_env.for_child()
print(json.dumps({"ours": os.environ.get("UCX_RNDV_THRESH"),
                  "child": child.get("UCX_RNDV_THRESH"),
                  "other": child.get("PDORCH_PROBE")}))
"""


def _probe(**extra: str) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(extra, PDORCH_PROBE="kept")
    argv = [sys.executable, "-c", PROBE]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, str | None] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_child_does_not_inherit_ucxx_defaults() -> None:
    pytest.importorskip("ucxx")
    assert _probe() == {"ours": "8192", "child": None, "other": "kept"}


def test_a_value_the_user_set_is_kept() -> None:
    pytest.importorskip("ucxx")
    assert _probe(UCX_RNDV_THRESH="inf") == {"ours": "inf", "child": "inf", "other": "kept"}
