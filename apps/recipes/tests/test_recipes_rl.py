"""The RL recipes (examples/recipes/{sd3,flux}_{grpo,adjoint_matching}.py) with tiny random
models on CPU: end to end with exact and sdo, bare resume bit for bit, diffusers-loadable
LoRA in every checkpoint, the KL reference / base model is the adapters-off model, and the
settings refused with their names."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from recipe_support import (
    RECIPE_WARNINGS,
    assert_lora_loads_into_fresh_denoiser,
    comparable,
    lora_export,
    lora_file,
    lora_scale,
    records,
    rl_script,
    script,
)

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

pytestmark = RECIPE_WARNINGS

RL_FAMILIES = ["sd3", "flux"]
OBJECTIVES = ["grpo", "adjoint_matching"]
KL_KEY = {"grpo": "kl", "adjoint_matching": "path_kl"}


def _run(family: str, objective: str, out: Path, *extra: str) -> None:
    argv = ["--tiny", "--out", str(out), "--report_to", "none", *extra]
    assert rl_script(family, objective).main(argv) == 0


@pytest.mark.parametrize("estimator", ["exact", "sdo"])
@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("family", RL_FAMILIES)
def test_rl_recipe_two_steps_end_to_end(family, objective, estimator, tmp_path):
    """2 steps through the script's main: log records with the reward, the full objective
    value, the KL to the adapters-off model (exactly 0 at step 1, where every lora_B is
    zero, > 0 after a step), lr and the work; LoRA trained, base weights not; a checkpoint
    and the final export in diffusers' format, loadable with load_lora_adapter."""
    out = tmp_path / "run"
    _run(family, objective, out, "--estimator", estimator, "--lr", "1e-3")
    rows = records(out)
    assert [row["step"] for row in rows] == [1, 2]
    key = KL_KEY[objective]
    for row in rows:
        for name in ("reward", "loss", "grad_norm", "lr", "model_forwards", key):
            assert math.isfinite(row[name]), (name, row)
        assert row["lr"] == 1e-3 and row["grad_norm"] > 0
        assert row["objective_model_units"] == (6.0 if objective == "grpo" else 9.0)
    assert rows[0][key] == 0.0  # the LoRA model is the base model before the first step
    assert rows[1][key] > 0.0
    config = (out / "config.toml").read_text()
    assert f'objective = "{objective}"' in config
    checkpoint = out / "checkpoints" / "step_000002"
    trained = lora_file(checkpoint)
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    scale = lora_scale(out)
    assert scale == (2.0 if objective == "grpo" else 1.0)  # Flow-GRPO's alpha = 2 rank
    assert_lora_loads_into_fresh_denoiser(family, checkpoint, trained, scale)
    assert_lora_loads_into_fresh_denoiser(family, out / "lora", trained, scale)
    assert (out / "samples" / "step_000002.png").is_file()


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("family", RL_FAMILIES)
def test_rl_recipe_bare_resume_equals_uninterrupted(family, objective, tmp_path):
    """2 steps, then ``--resume_from_checkpoint latest --output_dir OUT --max_train_steps 3``
    alone, equals 3 straight steps bit for bit (log records, LoRA checkpoint and export);
    sdo's random step draws, the SDE noise and the group prompts all repeat. Every
    checkpoint's LoRA export loads into a fresh tiny denoiser."""
    settings = ["--estimator", "sdo", "--lr", "1e-2", "--seed", "5",
                "--checkpointing_steps", "1", "--checkpoints_total_limit", "0"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(family, objective, straight, *settings, "--max_train_steps", "3")
    _run(family, objective, resumed, *settings, "--max_train_steps", "2")
    main = rl_script(family, objective).main
    assert (
        main(["--resume_from_checkpoint", "latest", "--output_dir", str(resumed),
              "--max_train_steps", "3"]) == 0
    )  # fmt: skip
    assert comparable(records(resumed)) == comparable(records(straight))
    for step in (1, 2, 3):
        name = f"step_{step:06d}"
        a, b = lora_file(straight / "checkpoints" / name), lora_file(resumed / "checkpoints" / name)
        assert set(a) == set(b)
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
        assert_lora_loads_into_fresh_denoiser(
            family, resumed / "checkpoints" / name, b, lora_scale(resumed)
        )
    export_a, export_b = lora_export(straight / "lora"), lora_export(resumed / "lora")
    assert set(export_a) == set(export_b)
    assert all(torch.equal(export_a[k], export_b[k]) for k in export_a)


def _tiny_family(family: str, objective: str, *, perturb: bool):
    from accelerate.utils import set_seed
    from gradest_recipes.config import load_config
    from gradest_recipes.embeddings import tiny_embeddings
    from gradest_recipes.families import build_family

    config = load_config(family, overrides={"tiny": True, "objective": objective})
    set_seed(0)
    embeddings = tiny_embeddings(family)
    built = build_family(family, config, embeddings)
    if perturb:  # a LoRA model that is not its base model
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, parameter in built.denoiser.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    return config, embeddings, built


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("family", RL_FAMILIES)
def test_kl_reference_is_the_adapters_off_model(family, objective):
    """The SDE sampler is sampler_from_scheduler(sde_noise_level=0.7) on the recipe's grid for grpo,
    gradest.rl.memoryless_flow on that grid for adjoint matching; with trained (non-zero)
    LoRA the logged KL is the KL to the model without adapters (a fresh build, lora_B = 0:
    the base model), not zero,
    and the adapters are on again afterwards (the rollout repeats bitwise)."""
    from gradest_recipes.rewards import brightness
    from gradest_recipes.rl_objectives import RLObjective, per_sample_reward

    import gradest
    from gradest.rl import MEMORYLESS_NOISE_LEVEL, memoryless_flow, reference_velocities

    config, embeddings, policy = _tiny_family(family, objective, perturb=True)
    _, _, base = _tiny_family(family, objective, perturb=False)
    rl = RLObjective(policy, config)
    assert isinstance(rl.sampler, gradest.FlowSDE)
    assert torch.equal(rl.sampler.times, policy.sampler.times)
    if objective == "grpo":
        assert type(rl.sampler) is gradest.FlowSDE and rl.sampler.noise_level == 0.7
    else:  # the library's memoryless sampler on the scheduler's grid
        want_sampler = memoryless_flow(times=policy.sampler.times)
        assert type(rl.sampler) is type(want_sampler)
        assert rl.sampler.noise_level == pytest.approx(MEMORYLESS_NOISE_LEVEL)
        for mine, theirs in zip(
            rl.sampler.coefficients(), want_sampler.coefficients(), strict=True
        ):
            assert torch.equal(mine, theirs)
    index = rl.prompt_index(torch.Generator().manual_seed(0), embeddings.count, 2)
    if objective == "grpo":  # one group: one prompt repeated
        assert index[0] == index[1]
    cond = policy.make_cond(embeddings, index, torch.device("cpu"))
    noise = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(2))
    rewards = per_sample_reward(brightness, policy.vae, policy.to_vae_latents, ["a", "b"])

    def prepare():
        return rl.prepare(policy.velocity, noise, cond, rewards,
                          torch.Generator().manual_seed(3))  # fmt: skip

    first = prepare()
    path = first.trajectory
    with torch.no_grad():
        want = reference_velocities(base.velocity, rl.sampler, path, cond)
    assert not torch.allclose(path.velocities, want)  # the policy is not the base model
    key = KL_KEY[objective]
    assert first.metrics[key] == pytest.approx(rl.path_kl(path.velocities, want), rel=1e-6)
    assert first.metrics[key] > 0
    again = prepare()  # the adapters are back on: the same rollout
    assert torch.equal(again.trajectory.states, path.states)
    assert again.metrics[key] == first.metrics[key]


def test_rl_settings_refused_with_their_names(tmp_path):
    """A script runs its own objective; grpo needs whole groups; a terminal-only estimator
    is refused for the RL objectives; sd_unet has none; a grpo script does not resume a
    reward run."""
    from gradest_recipes.config import RecipeConfigError, config_from_argv, load_config

    with pytest.raises(RecipeConfigError, match="objective='grpo'.*sd3_reward.py"):
        script("sd3").main(["--tiny", "--objective", "grpo", "--out", str(tmp_path / "a")])
    with pytest.raises(RecipeConfigError, match="batch_size=3.*group_size=2"):
        config_from_argv("sd3", ["--tiny", "--batch_size", "3"], objective="grpo")
    with pytest.raises(RecipeConfigError, match="clip_range"):
        config_from_argv("sd3", ["--tiny", "--clip_range", "1.5"], objective="grpo")
    with pytest.raises(RecipeConfigError, match="objective='grpo'.*sd_unet"):
        load_config("sd_unet", overrides={"tiny": True, "objective": "grpo"})
    with pytest.raises(RecipeConfigError, match="estimator='draft_lv'.*terminal"):
        _run("flux", "grpo", tmp_path / "b", "--estimator", "draft_lv")
    config, _ = config_from_argv("flux", ["--tiny"], objective="grpo")
    assert (config.batch_size, config.group_size, config.noise_level) == (2, 2, 0.7)
    assert (config.clip_range, config.adv_clip_max, config.kl_weight) == (1e-4, 5.0, 0.04)
    reward_run = tmp_path / "reward"
    assert script("sd3").main(["--tiny", "--out", str(reward_run), "--report_to", "none",
                               "--max_train_steps", "1"]) == 0  # fmt: skip
    with pytest.raises(RecipeConfigError, match="objective='grpo' differs"):
        rl_script("sd3", "grpo").main(
            ["--resume_from_checkpoint", "latest", "--output_dir", str(reward_run),
             "--max_train_steps", "2"]
        )  # fmt: skip
