"""The common diffusers mistakes fail in one line that names the fix (tiny models).

* forgetting ``cond`` for a text-conditioned SD3 / Flux transformer, or the labels of a
  class-conditional DiT: the missing keys are named;
* a diffusers scheduler passed as the sampler: ``sampler_from_scheduler`` (flow matching) or
  ``sampler_from_scheduler`` (flow matching, DDIM / DDPM) is named;
* the bare transformer passed as the model (also inside DDP): ``DiffusersVelocity`` is named;
* an SDXL-style UNet without its ``added_cond_kwargs`` (or one of their keys): they are
  named; a cond tensor with another number of rows than the batch, at any depth, or on
  another device: its path is named when the model fails on it;
* a plain ``DiffusersVelocity`` under a DDIM sampler whose scheduler calls the UNet at
  other timesteps: refused, naming ``DiffusersVelocity.for_sampler``.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
diffusers = pytest.importorskip("diffusers")

from diffusers_support import tiny_sdxl_unet, tiny_transformer  # noqa: E402

import gradest  # noqa: E402
from gradest.errors import InvalidType, InvalidValue  # noqa: E402
from gradest.integrations import DiffusersVelocity, sampler_from_scheduler  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:There are modules:UserWarning")

OBJECTIVE = gradest.TerminalObjective(lambda z: z.pow(2).mean())


def flow():
    return sampler_from_scheduler(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), 2)


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("kind", "shape", "cond", "missing"),
    [
        ("sd3", (2, 2, 4, 4), {}, ["encoder_hidden_states", "pooled_projections"]),
        (
            "sd3",
            (2, 2, 4, 4),
            {"encoder_hidden_states": torch.zeros(2, 3, 6)},
            ["pooled_projections"],
        ),
        ("flux", (2, 4, 4), {}, ["encoder_hidden_states", "pooled_projections"]),
        ("dit", (2, 2, 4, 4), {}, ["class_labels"]),
    ],
)
def test_missing_cond_names_the_keys(kind, shape, cond, missing):
    model = DiffusersVelocity(tiny_transformer(kind, dtype=torch.float32))
    cond = {k: v.float() for k, v in cond.items()}
    with pytest.raises(InvalidValue) as err:
        gradest.estimator("sdo").surrogate(
            model, flow(), OBJECTIVE, noise=torch.randn(shape), cond=cond
        )
    message = one_line(err)
    assert f"needs {', '.join(missing)} in cond" in message
    assert "NoneType" not in message


def test_full_cond_passes_the_check():
    model = DiffusersVelocity(tiny_transformer("sd3", dtype=torch.float32))
    cond = {"encoder_hidden_states": torch.randn(2, 3, 6), "pooled_projections": torch.randn(2, 5)}
    sur = gradest.estimator("sdo").surrogate(
        model, flow(), OBJECTIVE, noise=torch.randn(2, 2, 4, 4), cond=cond
    )
    assert torch.isfinite(sur.loss)


@pytest.mark.parametrize(
    ("scheduler", "fix"),
    [
        (
            lambda: diffusers.FlowMatchEulerDiscreteScheduler(),
            "gradest.integrations.sampler_from_scheduler(scheduler, num_inference_steps)",
        ),
        (
            lambda: diffusers.DDIMScheduler(),
            "gradest.integrations.sampler_from_scheduler(scheduler, num_inference_steps)",
        ),
    ],
)
def test_scheduler_as_sampler_names_the_fix(scheduler, fix):
    model = DiffusersVelocity(tiny_transformer("dit", dtype=torch.float32))
    with pytest.raises(InvalidType) as err:
        gradest.estimator("exact").estimate(
            model,
            scheduler(),
            OBJECTIVE,
            noise=torch.randn(2, 2, 4, 4),
            cond={"class_labels": torch.tensor([0, 1])},
        )
    message = one_line(err)
    assert fix in message and "{" not in message  # no JSON dump of the config
    with pytest.raises(InvalidType, match="sampler_from_scheduler"):
        gradest.rollout(
            model, scheduler(), torch.randn(2, 2, 4, 4), cond={"class_labels": torch.tensor([0, 1])}
        )


def test_bare_transformer_as_model_names_the_wrapper():
    transformer = tiny_transformer("sd3", dtype=torch.float32)
    cond = {"encoder_hidden_states": torch.randn(2, 3, 6), "pooled_projections": torch.randn(2, 5)}
    for model in (transformer, torch.nn.DataParallel(transformer)):
        with pytest.raises(InvalidType) as err:
            gradest.estimator("sdo").surrogate(
                model, flow(), OBJECTIVE, noise=torch.randn(2, 2, 4, 4), cond=cond
            )
        message = one_line(err)
        assert "gradest.integrations.DiffusersVelocity(transformer)" in message
        assert "multiple values" not in message


def test_a_user_module_holding_a_transformer_is_not_refused():
    class Mine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = DiffusersVelocity(tiny_transformer("dit", dtype=torch.float32))

        def forward(self, z, t, **cond):
            return self.module(z, t, **cond)

    sur = gradest.estimator("sdo").surrogate(
        Mine(),
        flow(),
        OBJECTIVE,
        noise=torch.randn(2, 2, 4, 4),
        cond={"class_labels": torch.tensor([0, 1])},
    )
    assert torch.isfinite(sur.loss)


# -- an SDXL-style UNet: nested conditioning and its DDIM timesteps -------------------------

SDXL_BATCH, SDXL_POOLED = 2, 8


def sdxl_cond(rows=SDXL_BATCH, nested_rows=SDXL_BATCH):
    return {
        "encoder_hidden_states": torch.randn(rows, 3, 6),
        "added_cond_kwargs": {
            "text_embeds": torch.randn(nested_rows, SDXL_POOLED),
            "time_ids": torch.tensor([[8.0, 8, 0, 0, 8, 8]]).repeat(nested_rows, 1),
        },
    }


def ddim(steps_offset=1):
    scheduler = diffusers.DDIMScheduler(clip_sample=False, steps_offset=steps_offset)
    return sampler_from_scheduler(scheduler, 3)


@pytest.fixture(scope="module")
def sdxl_velocity():
    return DiffusersVelocity.for_sampler(tiny_sdxl_unet(SDXL_POOLED, torch.float32), ddim())


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        (
            ("added_cond_kwargs",),
            "needs cond['added_cond_kwargs'], a dict with text_embeds, time_ids",
        ),
        (("added_cond_kwargs", "time_ids"), "needs time_ids in cond['added_cond_kwargs']"),
    ],
)
def test_an_sdxl_unet_names_its_missing_added_conditions(sdxl_velocity, drop, named):
    cond = sdxl_cond()
    holder = cond
    for key in drop[:-1]:
        holder = holder[key]
    del holder[drop[-1]]
    with pytest.raises(InvalidValue) as err:
        gradest.estimator("exact").estimate(
            sdxl_velocity, ddim(), OBJECTIVE, noise=torch.randn(SDXL_BATCH, 2, 8, 8), cond=cond
        )
    message = one_line(err)
    assert named in message and "addition_embed_type='text_time'" in message
    assert "NoneType" not in message


@pytest.mark.parametrize(
    ("rows", "nested_rows", "path"),
    [
        (3, SDXL_BATCH, "cond['encoder_hidden_states'] has 3 rows"),
        (SDXL_BATCH, 3, "cond['added_cond_kwargs']['text_embeds'] has 3 rows"),
    ],
)
@pytest.mark.parametrize("spec", ["exact", "sdo:samples=2"])
def test_a_cond_tensor_with_other_rows_is_named_by_its_path(
    sdxl_velocity, rows, nested_rows, path, spec
):
    """Such a tensor is passed unrepeated (a shared leaf, by the conditioning rule), so the
    model fails inside; the error then names the leaf, its rows and the batch's."""
    with pytest.raises(InvalidValue) as err:
        gradest.estimator(spec).estimate(
            sdxl_velocity,
            ddim(),
            OBJECTIVE,
            noise=torch.randn(SDXL_BATCH, 2, 8, 8),
            cond=sdxl_cond(rows, nested_rows),
        )
    message = one_line(err)
    assert f"{path} (shape (3, " in message and f"where the batch has {SDXL_BATCH}" in message
    assert "Check that the noise" not in message  # the generic hint gives way to the named one


def test_a_cond_tensor_on_another_device_is_named():
    from gradest.conditioning import suspect_leaves

    cond = {"a": {"b": [torch.zeros(2, 3, device="meta")]}, "shared": torch.zeros(1, 3)}
    (phrase,) = suspect_leaves(cond, 2, torch.device("cpu"))
    assert phrase.startswith("cond['a']['b'][0] is on meta, the state on cpu")
    assert suspect_leaves(cond, 2, torch.device("meta")) == [
        "cond['shared'] is on cpu, the state on meta: pass it .to('meta')"
    ]


def test_a_plain_wrapper_at_other_timesteps_than_the_ddim_scheduler_is_refused():
    """With ``steps_offset=0`` the scheduler's last timestep is 0, the grid is shifted by
    one training step, and only ``for_sampler`` knows it: the plain wrapper would call the
    UNet one timestep off at every step, silently."""
    unet, sampler = tiny_sdxl_unet(SDXL_POOLED, torch.float32), ddim(steps_offset=0)
    noise, cond = torch.randn(SDXL_BATCH, 2, 8, 8), sdxl_cond()
    for call in (
        lambda model: gradest.estimator("exact").estimate(
            model, sampler, OBJECTIVE, noise=noise, cond=cond
        ),
        lambda model: gradest.rollout(model, sampler, noise, cond=cond),
    ):
        with pytest.raises(InvalidValue) as err:
            call(DiffusersVelocity(unet))
        message = one_line(err)
        assert "DiffusersVelocity.for_sampler(model, sampler)" in message
        assert "timestep_shift=0" in message
        call(DiffusersVelocity.for_sampler(unet, sampler))  # the same call, built right
    # Where the plain wrapper's timesteps are the scheduler's (steps_offset=1), it is not
    # refused.
    gradest.rollout(DiffusersVelocity(unet), ddim(steps_offset=1), noise, cond=cond)
