"""The model pdorch ships a name for — one place for it: the workers serve SmolLM2 under
`SMOLLM2_NAME` on either engine, the gateway also takes its `MODEL_ALIASES`."""

from __future__ import annotations

SMOLLM2_NAME = "smollm2-135m-instruct"
"""SmolLM2-135M-Instruct's served name, on the reference engine and on vLLM."""

MODEL_ALIASES = {"smollm2": SMOLLM2_NAME}
"""Other names a call may give it: ``smollm2`` is the name ``--model`` takes."""
