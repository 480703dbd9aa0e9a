"""The bundled model pair (see MODEL_CARD.md): tiny-maverick, a Llama 4 style MoE target trained by
`warpspec train-target` on Debian's documentation, its EAGLE-3 draft trained by `warpspec
train-draft`, and held-out prompts from documents neither saw in training. Installed with the
package, so `warpspec demo` and `warpspec bench compare` work from a plain `pip install`."""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).parent
BUNDLED_TARGET = ASSETS / "tiny-maverick"
BUNDLED_DRAFT = ASSETS / "tiny-maverick-eagle3"
PROMPTS = ASSETS / "held_out_prompts.json"


def held_out_prompts() -> list[list[int]]:
    """Equal-length token-id prompts (BOS + 32 tokens) cut from validation documents."""
    return json.loads(PROMPTS.read_text())["prompt_token_ids"]


def held_out_texts() -> list[str]:
    return json.loads(PROMPTS.read_text())["text"]
