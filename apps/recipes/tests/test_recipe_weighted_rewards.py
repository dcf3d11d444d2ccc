"""A weighted sum of rewards: ``--reward "0.7*pickscore:model=A + 0.3*brightness"``.

As Flow-GRPO's ``multi_score(device, {"pickscore": 1.0, "aesthetic": 0.5})``: the reward is
``sum_i w_i r_i(images, prompts)``, each term resolved as the single reward it names.
Checked: the sum and its gradient are the weighted sum of the single rewards on the same
images (the built-in ones, and a file hook that gets the prompts); the weights as written
(none is 1, spaces, scientific notation, negative); a ``+`` without spaces and a ``*``
after the ``:`` stay part of a single reward's text (LAION's head file
``sac+logos+ava1-l14-linearMSE.pth``); each refusal is one line naming the term by its
position; the per-term means; the sum through the reward objective and the RL recipes'
per-sample rewards on a tiny VAE; and tiny reward and grpo recipe runs that log a finite
reward, and a resume that keeps a built-in-only sum without naming it again.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gradest_recipes.config import RecipeConfigError, config_from_argv  # noqa: E402
from gradest_recipes.families import tiny_vae  # noqa: E402
from gradest_recipes.reward_sums import WeightedReward, parse_reward_sum  # noqa: E402
from gradest_recipes.rewards import (  # noqa: E402
    brightness,
    color,
    contrast,
    decode_images,
    resolve_reward,
    reward_objective,
)
from gradest_recipes.rl_objectives import per_sample_reward  # noqa: E402
from gradest_recipes.train import saved_settings, script_main  # noqa: E402
from recipe_support import RECIPE_WARNINGS, records, rl_script, script  # noqa: E402

from gradest.errors import InvalidValue  # noqa: E402

pytestmark = RECIPE_WARNINGS

PROMPTS = ["a red fox", "a blue bird", "a green frog", "a grey cat"]


def _images(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(4, 3, 8, 8, generator=generator, requires_grad=True)


def _hook(folder: Path) -> Path:
    """A reward file whose function takes the prompts: the prompt's length times redness,
    so a term that got no prompts, or another batch's, scores otherwise."""
    hook = folder / "prompted_reward.py"
    hook.write_text(
        "import torch\n"
        "def redness(images, prompts):\n"
        "    lengths = torch.tensor([float(len(p)) for p in prompts]).to(images)\n"
        "    return lengths * (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2))\n"
        "def wide(images):\n"
        "    return images.mean(dim=(1, 2, 3))[:, None]\n"
    )
    return hook


def _refused(spec: str) -> str:
    """``resolve_reward(spec)`` refuses in one line naming the setting; the line."""
    with pytest.raises(RecipeConfigError) as caught:
        resolve_reward(spec)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"setting reward={spec!r}"), message
    return message


# -- the sum is the weighted sum of the single rewards ---------------------------------------


def test_the_sum_and_its_gradient_are_the_weighted_sum_of_the_single_rewards(tmp_path):
    hook = _hook(tmp_path)
    spec = f"0.5*brightness + -2e-1 * contrast + 1.5*color:r=0,g=1,b=0.5 + 3*{hook}:redness"
    weighted = resolve_reward(spec)
    assert isinstance(weighted, WeightedReward)
    redness = resolve_reward(f"{hook}:redness")
    green = color(r=0.0, g=1.0, b=0.5)

    images = _images()
    total = weighted(images, prompts=PROMPTS)
    (grad,) = torch.autograd.grad(total.sum(), images)

    expected_images = images.detach().clone().requires_grad_(True)
    expected = (
        0.5 * brightness(expected_images)
        + -0.2 * contrast(expected_images)
        + 1.5 * green(expected_images)
        + 3.0 * redness(expected_images, prompts=PROMPTS)
    )
    (expected_grad,) = torch.autograd.grad(expected.sum(), expected_images)
    assert total.shape == (4,) and total.dtype == torch.float32
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert grad.abs().sum() > 0


def test_a_learned_term_with_a_plus_in_its_head_path(tmp_path):
    """A learned reward (a tiny CLIP aesthetic predictor saved as transformers saves it),
    its head given as LAION names it, ``sac+logos+ava1-l14-linearMSE.pth``: the term is
    that reward alone, weighted, and its gradient reaches the pixels."""
    transformers = pytest.importorskip("transformers")
    from gradest_recipes.learned_rewards import AESTHETIC_HEAD, ScoreMLP

    folder = tmp_path / "clip"
    torch.manual_seed(0)
    clip = transformers.CLIPConfig(
        text_config=dict(vocab_size=80, hidden_size=32, intermediate_size=37,
                         num_hidden_layers=1, num_attention_heads=2),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=16,
    )  # fmt: skip
    transformers.CLIPModel(clip).save_pretrained(folder)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(folder)
    torch.save(ScoreMLP(16).state_dict(), folder / AESTHETIC_HEAD)
    aesthetic = f"aesthetic:model={folder},head={folder / AESTHETIC_HEAD}"
    assert "+" in AESTHETIC_HEAD

    weighted = resolve_reward(f"0.5*{aesthetic} + brightness")
    alone = resolve_reward(aesthetic)
    images = _images(5)
    total = weighted(images, prompts=PROMPTS)
    (grad,) = torch.autograd.grad(total.sum(), images)
    expected = 0.5 * alone(images) + brightness(images)
    (expected_grad,) = torch.autograd.grad(expected.sum(), images)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert [term.label for term in weighted.terms] == ["aesthetic", "brightness"]


def test_each_term_is_resolved_as_its_single_reward():
    """A term gets the same reward (options read the same way) the setting alone gets."""
    weighted = resolve_reward("2*color:g=1 , r=0 + contrast")
    assert isinstance(weighted, WeightedReward)
    images = _images(1)
    alone = resolve_reward("color:g=1 , r=0")
    torch.testing.assert_close(
        weighted(images, prompts=PROMPTS), 2 * alone(images) + resolve_reward("contrast")(images)
    )


def test_a_single_reward_is_resolved_as_before():
    """No ``+`` between spaces and no ``WEIGHT*``: the reward itself, not a sum of one."""
    assert resolve_reward("brightness") is brightness
    assert resolve_reward(" contrast ") is contrast
    assert not isinstance(resolve_reward("color:r=0,g=1,b=0"), WeightedReward)


# -- the weights as written ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "terms"),
    [
        ("0.5*brightness", [(0.5, "brightness")]),
        ("brightness + contrast", [(1.0, "brightness"), (1.0, "contrast")]),
        ("  0.25 *  brightness   +\tcontrast ", [(0.25, "brightness"), (1.0, "contrast")]),
        ("1e-3*brightness + 2.5E2 * contrast", [(1e-3, "brightness"), (250.0, "contrast")]),
        ("brightness + -0.1*contrast", [(1.0, "brightness"), (-0.1, "contrast")]),
        ("1*color:r=0,g=1 + 0*contrast", [(1.0, "color:r=0,g=1"), (0.0, "contrast")]),
    ],
)
def test_weights_are_read_as_written(spec, terms):
    weighted = resolve_reward(spec)
    assert isinstance(weighted, WeightedReward)
    assert [(term.weight, term.spec) for term in weighted.terms] == terms


def test_a_plus_inside_a_name_and_a_star_after_the_colon_belong_to_the_reward():
    """LAION's aesthetic head is ``sac+logos+ava1-l14-linearMSE.pth``: a ``+`` touching
    text is part of the path, a ``*`` after the reward's ``:`` part of an option value."""
    head = "/models/sac+logos+ava1-l14-linearMSE.pth"
    assert parse_reward_sum(f"aesthetic:model=/models/clip,head={head}") is None
    assert parse_reward_sum("aesthetic:model=/models/clip*") is None
    terms = parse_reward_sum(f"0.5*aesthetic:model=/m/*/clip,head={head} + brightness")
    assert terms is not None
    assert [(t.weight, t.spec) for t in terms] == [
        (0.5, f"aesthetic:model=/m/*/clip,head={head}"),
        (1.0, "brightness"),
    ]


def test_terms_are_labelled_for_the_log_and_their_means_taken(tmp_path):
    hook = _hook(tmp_path)
    weighted = resolve_reward(f"color:r=1 + 2*color:g=1,r=0 + -1*{hook}:redness")
    assert isinstance(weighted, WeightedReward)
    assert [term.label for term in weighted.terms] == ["color_1", "color_2", "redness"]
    first, second = _images(2), _images(3)
    with torch.no_grad():
        weighted(first, prompts=PROMPTS)
        weighted(second, prompts=PROMPTS)
    both = torch.cat([first, second]).detach()
    means = weighted.take_term_means()
    redness = resolve_reward(f"{hook}:redness")
    expected = {
        "color_1": color(1.0, 0.0, 0.0)(both).mean(),  # unweighted
        "color_2": color(0.0, 1.0, 0.0)(both).mean(),
        "redness": redness(both, prompts=PROMPTS * 2).mean(),
    }
    assert means.keys() == expected.keys()
    for label, value in expected.items():
        assert math.isclose(means[label], float(value), rel_tol=1e-5), label
    assert weighted.take_term_means() == {}  # taken: reset


# -- refusals: one line naming the term ----------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("brightness + ", "term 2 of 2 is empty; join rewards as [WEIGHT*]REWARD with ' + '"),
        ("+ brightness", "term 1 of 2 is empty"),
        ("brightness +  + contrast", "term 2 of 3 is empty"),
        ("*brightness", "term 1 '*brightness' has no weight before '*'; write WEIGHT*REWARD"),
        ("nan*brightness", "term 1 'nan*brightness' has weight nan, not a finite number"),
        ("contrast + inf * brightness", "term 2 'inf * brightness' has weight inf, not a finite"),
        ("half*brightness", "term 1 'half*brightness' has weight 'half', not a number"),
        ("0.5*", "term 1 '0.5*' names no reward after '*'"),
        ("0*brightness + 0*contrast", "every term has weight 0"),
        (
            "0.5*brightness + 0.25*sparkle",
            "term 2 '0.25*sparkle' is invalid: not a built-in reward and not of the form "
            "module:function",
        ),
        ("brightness + color:q=1", "term 2 'color:q=1' is invalid: 'color' takes options r, g, b"),
        ("brightness + color:r=1,r=0", "term 2 'color:r=1,r=0' sets option 'r' twice"),
        ("contrast + color:r=red", "term 2 'color:r=red' is invalid: option r='red' is not a"),
        ("brightness + no_such_module:f", "term 2 'no_such_module:f' is invalid: cannot import"),
        (
            "0.5*brightness + contrast + 0.25 * brightness",
            "terms 1 and 3 are the same reward 'brightness'; give it once, with the summed "
            "weight: '0.75*brightness'",
        ),
        ("color:g=0,r=1 + color:r=1.0,g=0", "terms 1 and 2 are the same reward"),
        ("brightness+contrast", "put spaces around the '+': 'brightness + contrast'"),
    ],
)
def test_a_bad_sum_is_refused_in_one_line_naming_the_term(spec, says):
    assert says in _refused(spec)


def test_a_term_of_the_wrong_shape_is_named(tmp_path):
    """``[B, 1]`` would broadcast the sum to ``[B, B]``: refused, naming the term."""
    hook = _hook(tmp_path)
    weighted = resolve_reward(f"brightness + {hook}:wide")
    with pytest.raises(InvalidValue, match=r"reward term 2 '.*:wide' returned Tensor of shape"):
        weighted(_images(), prompts=PROMPTS)


def test_the_recipe_refuses_a_bad_sum_before_the_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--tiny", "--report_to", "none", "--max_train_steps", "1", "--output_dir", str(out)]
    capsys.readouterr()
    status = script_main("sd3", [*argv, "--reward", "brightness + nan*contrast"])
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert status == 2 and len(errors) == 1, errors
    assert "term 2 'nan*contrast' has weight nan" in errors[0]
    assert not out.exists()


# -- through the objectives and the recipes ------------------------------------------------------


def test_the_sum_through_the_reward_objective_and_the_per_sample_rewards():
    """On a tiny VAE: the reward objective's loss is minus the mean of the sum, and the RL
    recipes' per-sample rewards are the sum per image, differentiable in the latents."""
    vae = tiny_vae().requires_grad_(False)
    spec = "0.7*contrast + 0.3*brightness"
    weighted = resolve_reward(spec)
    z = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)

    per_sample = per_sample_reward(weighted, vae, lambda x: x, PROMPTS)(z)
    images = decode_images(vae, z)
    expected = 0.7 * contrast(images) + 0.3 * brightness(images)
    assert per_sample.shape == (4,)
    torch.testing.assert_close(per_sample, expected)

    loss = reward_objective(weighted, vae, lambda x: x, PROMPTS).loss_fn(z)
    torch.testing.assert_close(loss, -expected.mean())
    (grad,) = torch.autograd.grad(loss, z)
    (expected_grad,) = torch.autograd.grad(-expected.mean(), z)
    torch.testing.assert_close(grad, expected_grad)


def test_a_tiny_reward_run_with_a_weighted_reward_logs_a_finite_reward(tmp_path):
    out = tmp_path / "run"
    spec = "0.7*contrast + 0.3*color:r=0,g=1,b=0"
    argv = ["--tiny", "--report_to", "none", "--steps", "1", "--out", str(out)]
    assert script("sd3").main([*argv, "--reward", spec]) == 0
    rows = records(out)
    assert [row["step"] for row in rows] == [1]
    assert math.isfinite(rows[0]["reward"]) and rows[0]["grad_norm"] > 0
    assert f"reward = {spec!r}".replace("'", '"') in (out / "config.toml").read_text()
    # Each term's own reward is logged beside the total, which is their weighted sum (the
    # default estimator scores each sample once: the terms' means are over the same images).
    row = rows[0]
    assert {"reward_contrast", "reward_color"} <= set(row)
    weighted = 0.7 * row["reward_contrast"] + 0.3 * row["reward_color"]
    assert weighted == pytest.approx(row["reward"], rel=1e-5, abs=1e-7)

    # A sum of built-in rewards names no code: resumed without --reward, it is kept.
    resume = ["--resume", "latest", "--out", str(out), "--steps", "2", "--report_to", "none"]
    config, _ = config_from_argv("sd3", resume, saved_from=saved_settings)
    assert config.reward == spec
    assert script("sd3").main(resume) == 0
    assert [row["step"] for row in records(out)] == [1, 2]
    assert all(math.isfinite(row["reward"]) for row in records(out))


def test_a_resumed_sum_with_a_code_term_asks_for_the_reward_again(tmp_path):
    """A term that names code is not imported from the run's files, as a single
    ``module:function`` is not; the line gives the sum quoted, ready to paste."""
    spec = f"brightness + 0.5*{_hook(tmp_path)}:redness"
    saved = {"reward": spec}  # the check runs on the saved settings, before any is read
    with pytest.raises(RecipeConfigError) as caught:
        config_from_argv("sd3", ["--resume", str(tmp_path)], saved_from=lambda _: saved)
    assert f"pass --reward '{spec}' (the same reward)" in str(caught.value)


def test_a_tiny_grpo_run_with_a_weighted_reward_logs_a_finite_reward(tmp_path):
    out = tmp_path / "run"
    argv = ["--tiny", "--report_to", "none", "--steps", "1", "--out", str(out)]
    assert rl_script("sd3", "grpo").main([*argv, "--reward", "brightness + -0.5*contrast"]) == 0
    rows = records(out)
    assert [row["step"] for row in rows] == [1]
    assert math.isfinite(rows[0]["reward"])
