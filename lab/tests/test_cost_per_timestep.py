"""Pricing Flow-GRPO's per-timestep backward (``training_step_cost(per_timestep=True)``,
``gradest cost --objective stepwise --per-timestep``): the same FLOPs as one surrogate over
the path, one step's graph retained, and refused in one line where it would change the
gradient or cannot cut the path."""

from __future__ import annotations

import pytest
import torch
from gradest_lab.cost.training_cost import training_step_cost

import gradest
import gradest.models

STEPS = 8


def _cost(per_timestep: bool, *, device: str = "meta", spec: str = "exact", sampler=None):
    torch.manual_seed(0)
    model = gradest.models.MLPVelocity(dim=16, hidden=64).to(device)
    objective = gradest.StepwiseObjective(lambda k, v, trajectory: v.float().square().mean())
    return training_step_cost(
        gradest.estimator(spec), model, sampler or gradest.FlowSDE(steps=STEPS, noise_level=0.7),
        objective, noise=torch.zeros(4, 16, device=device), per_timestep=per_timestep,
    )  # fmt: skip


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_one_step_at_a_time_keeps_the_flops_and_holds_one_steps_graph(device):
    """Deterministic counts: equal FLOPs; the retained peak of the per-step loop times the
    step count is within what one step saves whatever its batch (here 1.28x) of the whole
    path's, and far below it."""
    together, apart = _cost(False, device=device), _cost(True, device=device)
    assert apart.flops == together.flops
    assert apart.retained_bytes * STEPS < 1.3 * together.retained_bytes
    assert apart.retained_bytes * 4 < together.retained_bytes
    assert apart.peak_bytes < together.peak_bytes


def test_per_timestep_is_refused_where_it_would_change_the_gradient_or_cannot_cut():
    with pytest.raises(gradest.InvalidValue, match="separable over steps .exact. only; .*sdo"):
        _cost(True, spec="sdo")
    with pytest.raises(gradest.InvalidValue, match="cuts a FlowSDE path .* RectifiedFlow"):
        _cost(True, sampler=gradest.RectifiedFlow(steps=STEPS))
    model = gradest.models.MLPVelocity(dim=16, hidden=64).to("meta")
    with pytest.raises(gradest.InvalidValue, match="a terminal objective's steps share"):
        training_step_cost(
            gradest.estimator("exact"), model, gradest.FlowSDE(steps=STEPS),
            gradest.TerminalObjective(lambda z: z.square().mean()),
            noise=torch.zeros(4, 16, device="meta"), per_timestep=True,
        )  # fmt: skip


def _command(tmp_path, *options: str) -> dict:
    import json

    from gradest.cli import main

    out = tmp_path / f"cost{len(list(tmp_path.iterdir()))}.json"
    argv = ["cost", "--model", "mlp", "--steps", "6", "--objective", "stepwise", "--quiet"]
    assert main([*argv, "--json", str(out), *options]) == 0
    return json.loads(out.read_text())


def test_the_command_prices_exact_one_timestep_at_a_time(tmp_path, capsys):
    """``gradest cost --objective stepwise --per-timestep``: exact alone by default, the
    setting recorded and printed, the FLOPs of one surrogate over the steps, less held."""
    apart = _command(tmp_path, "--per-timestep")
    together = _command(tmp_path, "--estimators", "exact")
    assert list(apart["estimators"]) == ["exact"]
    assert apart["settings"]["per_timestep"] is True
    assert together["settings"]["per_timestep"] is False
    assert "one backward per timestep" in capsys.readouterr().out
    mine, theirs = apart["estimators"]["exact"], together["estimators"]["exact"]
    assert mine["flops"] == theirs["flops"]
    assert mine["retained_bytes"] * 2 < theirs["retained_bytes"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--per-timestep", "--estimators", "exact,sdo"], "sdo chooses among the steps"),
        (["--per-timestep", "--estimators", "jagg:gate=off,sdo"], "jagg:gate=off, sdo choose"),
        (["--objective", "terminal", "--per-timestep"], "pass --objective stepwise"),
    ],
)
def test_the_command_refuses_per_timestep_where_it_would_not_be_exacts_loop(
    tmp_path, capsys, options, message
):
    from gradest.cli import main

    argv = ["cost", "--model", "mlp", "--steps", "6", "--objective", "stepwise", "--quiet"]
    assert main([*argv, *options]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# -- the grpo recipes' defaults ------------------------------------------------------------------


def _resolved(*argv: str):
    import argparse

    from gradest_lab.cost.command import add_arguments, resolve_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve_options(parser.parse_args(list(argv)))


@pytest.mark.parametrize(("model", "family"), [("sd3-medium", "sd3"), ("flux-dev", "flux")])
def test_recipe_defaults_grpo_prices_exact_one_timestep_at_a_time(model, family):
    """``--recipe-defaults grpo``: the stepwise objective, exact per timestep, LoRA 32 on
    the 8 projections of both streams, batch 4, fp32, nothing decoded; an estimator given
    that the recipe would train in one surrogate turns the per-timestep loop off."""
    from gradest_lab.cost.recipe_defaults import GRPO_RECIPE_DEFAULTS

    args = _resolved("--model", model, "--recipe-defaults", "grpo")
    assert (args.recipe_defaults, args.recipe_objective) == (family, "grpo")
    assert (args.objective, args.estimators, args.per_timestep) == ("stepwise", "exact", True)
    assert (args.lora_rank, args.batch, args.dtype, args.reward) == (32, 4, "fp32", "latent")
    assert args.lora_targets.split(",") == list(GRPO_RECIPE_DEFAULTS["lora_targets"])
    assert args.gradient_checkpointing is False and args.decoder_checkpointing is None
    assert not _resolved(
        "--model", model, "--recipe-defaults", "grpo", "--estimators", "sdo"
    ).per_timestep
    reward = _resolved("--model", model, "--recipe-defaults")
    assert (reward.recipe_objective, reward.objective, reward.per_timestep) == (
        "reward", "terminal", False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "sdxl-unet", "--recipe-defaults", "grpo"], "sdxl family has no grpo recipe"),
        (
            ["--model", "sd3-medium", "--recipe-defaults", "grpo", "--objective", "terminal"],
            "--recipe-defaults grpo prices the grpo recipes (the stepwise objective)",
        ),
        (["--model", "sd3-medium", "--lora-targets", "to_q"], "with --lora-rank"),
        (
            ["--model", "sd3-medium", "--lora-rank", "4", "--lora-targets", "to_q,,to_v"],
            "none empty",
        ),
        (
            ["--model", "sd3-medium", "--lora-rank", "4", "--lora-targets", "to_q,attn.nope"],
            "lora_targets attn.nope name no module of SD3Transformer2DModel",
        ),
        (["--model", "sd3-medium", "--recipe-defaults", "adjoint"], "invalid choice"),
    ],
)
def test_recipe_and_lora_target_options_are_refused_in_one_line(capsys, argv, message):
    from gradest.cli import main

    assert main(["cost", *argv, "--reward", "latent", "--steps", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) <= 2, err


def test_lora_targets_change_what_trains():
    """The 8 projections of both streams train more parameters than the 4 of the image
    stream (the context stream's adapters), on a tiny SD3 config traced on meta."""
    from gradest_lab.cost.command import model_setup

    image = model_setup("sd3-medium", steps=2, height=128, width=128, lora_rank=4)
    both = model_setup(
        "sd3-medium", steps=2, height=128, width=128, lora_rank=4,
        lora_targets="to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out",
    )  # fmt: skip

    def trained(setup) -> int:
        return sum(p.numel() for p in setup.velocity.parameters() if p.requires_grad)

    assert trained(both) > trained(image) > 0
    assert both.settings["lora_targets"].startswith("to_q,to_k")
    assert "lora_targets" not in image.settings or image.settings["lora_targets"] is None
