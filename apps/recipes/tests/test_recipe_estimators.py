"""Every recipe trains with every kind of estimator, chosen by its spec string.

Tiny random models on CPU (``tiny = true``: 3 sampling steps), one optimizer step each.
Each run must produce a finite reward and a non-zero LoRA gradient, and the spec must be
the one that ran: ``truncated:k=N`` over all ``N`` steps is ``exact``'s gradient (same
seed, same noise), while the approximate estimators give other gradients (jagg over
all 3 steps, interpolating the middle one, with ``tau=-1`` so that its gate never falls
back: on these random models it falls back to exact at the default ``tau``; with
``window=2`` every step is a node and jagg is exact).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

from recipe_support import RECIPE_WARNINGS  # noqa: E402

pytestmark = RECIPE_WARNINGS

from gradest_recipes import load_config  # noqa: E402
from gradest_recipes.train import train  # noqa: E402

FAMILIES = ["sd3", "flux", "sd_unet", "sdxl"]
TINY_STEPS = 3  # the tiny configs' num_inference_steps
APPROXIMATE = ["jagg:window=3,tau=-1", "sdo", "truncated:k=1", "telescope:mean_depth=2", "draft_lv"]


def first_record(family: str, estimator: str, out: Path) -> dict:
    config = load_config(
        family,
        overrides={"tiny": True, "out": str(out), "steps": 1, "estimator": estimator},
    )
    assert config.num_inference_steps == TINY_STEPS
    run = train(family, config)
    (line,) = (run.out / "log.jsonl").read_text().splitlines()
    return json.loads(line)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_estimator_trains_each_recipe(family, tmp_path):
    exact = first_record(family, "exact", tmp_path / "exact")
    full = first_record(family, f"truncated:k={TINY_STEPS}", tmp_path / "full")
    assert math.isfinite(exact["reward"]) and exact["grad_norm"] > 0
    # Same seed, same noise: truncation over every step is the exact gradient.
    assert full["reward"] == exact["reward"]
    assert full["grad_norm"] == pytest.approx(exact["grad_norm"], rel=1e-5)
    for spec in APPROXIMATE:
        record = first_record(family, spec, tmp_path / spec.replace(":", "_").replace("=", "_"))
        assert math.isfinite(record["reward"]), spec
        assert record["grad_norm"] > 0 and math.isfinite(record["grad_norm"]), spec
        # The reward is logged from the step's own samples, before the update: the same
        # noise gives the same reward whatever the estimator (draft_lv included) ...
        assert record["reward"] == pytest.approx(exact["reward"], rel=1e-6), spec
        # "loss" is the estimator's objective: draft_lv's is on re-noised copies.
        if spec == "draft_lv":
            assert record["loss"] != pytest.approx(-record["reward"], rel=1e-7), spec
        else:
            assert record["loss"] == pytest.approx(-record["reward"], rel=1e-6), spec
        # ... while the gradient is the estimator's own.
        assert record["grad_norm"] != pytest.approx(exact["grad_norm"], rel=1e-4), spec
