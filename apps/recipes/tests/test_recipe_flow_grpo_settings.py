"""The grpo recipe trains as Flow-GRPO's ``scripts/train_sd3.py`` does, by default.

* LoRA rank 32, alpha 64, ``init_lora_weights="gaussian"`` on the 8 attention projections
  of both streams (image and context);
* the EMA of the LoRA weights: decay 0.9, updated every 8 optimizer steps with Flow-GRPO's
  warm-up ``min((1 + s) / (10 + s), 0.9)`` (:class:`gradest_recipes.ema.IntervalEMA`,
  checked against Flow-GRPO's update rule written out here);
* CFG with the unconditional half detached.

The reward recipes keep their own defaults (peft's init, 4 image-stream projections, no
EMA, CFG trained through both halves), and every setting can be changed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from gradest_recipes.config import FLOW_GRPO_LORA_TARGETS, config_from_argv  # noqa: E402
from gradest_recipes.ema import IntervalEMA, ema_decay_at  # noqa: E402
from gradest_recipes.errors import RecipeConfigError  # noqa: E402

FLOW_GRPO = {
    "lora_rank": 32,
    "lora_alpha": 64.0,
    "lora_init": "gaussian",
    "lora_targets": FLOW_GRPO_LORA_TARGETS,
    "use_ema": True,
    "ema_decay": 0.9,
    "ema_every": 8,
    "detach_unconditional": True,
}


def test_the_grpo_defaults_are_flow_grpos():
    config, _ = config_from_argv(
        "sd3", ["--pretrained", "/models/sd3", "--embeddings", "p.pt"], objective="grpo"
    )
    assert {key: getattr(config, key) for key in FLOW_GRPO} == FLOW_GRPO
    assert set(FLOW_GRPO_LORA_TARGETS) == {
        f"attn.{name}"
        for name in ("to_q", "to_k", "to_v", "to_out.0")
        + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    }
    # tiny keeps Flow-GRPO's alpha / rank of 2 at its small rank
    tiny, _ = config_from_argv("sd3", ["--tiny"], objective="grpo")
    assert tiny.lora_alpha / tiny.lora_rank == 2.0


def test_the_reward_recipes_keep_their_defaults_and_every_setting_can_change():
    config, _ = config_from_argv("sd3", ["--pretrained", "/models/sd3", "--embeddings", "p.pt"])
    assert config.lora_init == "default" and not config.use_ema
    assert not config.detach_unconditional and config.ema_every == 1
    changed, _ = config_from_argv(
        "sd3",
        ["--tiny", "--no-detach-unconditional", "--lora-init", "default", "--ema-every", "3"],
        objective="grpo",
    )
    assert not changed.detach_unconditional and changed.lora_init == "default"
    assert changed.ema_every == 3


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--lora-init", "uniform"], "lora_init='uniform'"),
        (["--ema-every", "0"], "ema_every=0"),
    ],
)
def test_bad_values_are_one_line(argv, fragment):
    with pytest.raises((RecipeConfigError, SystemExit)) as caught:
        config_from_argv("sd3", argv, objective="grpo")
    if caught.type is not SystemExit:
        assert fragment in str(caught.value) and "\n" not in str(caught.value)


def flow_grpo_ema(params, steps_of_updates, decay=0.9, every=8):
    """Flow-GRPO's EMAModuleWrapper.step(params, global_step) after each optimizer step
    (global_step: the steps taken so far), written out: the reference."""
    ema = [p.detach().clone() for p in params]
    for global_step, values in steps_of_updates:
        for p, v in zip(params, values, strict=True):
            p.data.copy_(v)
        one_minus = 1 - min((1 + global_step) / (10 + global_step), decay)
        if (global_step + 1) % every == 0:
            for e, p in zip(ema, params, strict=True):
                e.add_(one_minus * (p - e))
    return ema


@pytest.mark.parametrize("every", [1, 8])
def test_the_ema_is_flow_grpos(every):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    trajectory = [
        (s, [torch.randn_like(p) for p in params]) for s in range(1, 42)
    ]  # global_step after each optimizer step
    want = flow_grpo_ema([torch.nn.Parameter(p.detach().clone()) for p in params], trajectory,
                         every=every)  # fmt: skip
    ema = IntervalEMA(params, 0.9, every)
    for _, values in trajectory:
        for p, v in zip(params, values, strict=True):
            p.data.copy_(v)
        ema.step(params)
    assert ema.optimization_step == len(trajectory)
    for got, expected in zip(ema.shadow_params, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert ema_decay_at(7, 0.9) == pytest.approx(8 / 17)
    assert ema_decay_at(200, 0.9) == 0.9


def test_the_ema_survives_its_state_dict():
    params = [torch.nn.Parameter(torch.randn(2, 2))]
    ema = IntervalEMA(params, 0.9, 8)
    for _ in range(11):
        params[0].data.add_(1.0)
        ema.step(params)
    again = IntervalEMA([torch.nn.Parameter(torch.zeros(2, 2))], 0.9, 8)
    again.load_state_dict(ema.state_dict())
    assert again.optimization_step == 11
    torch.testing.assert_close(again.shadow_params[0], ema.shadow_params[0])
