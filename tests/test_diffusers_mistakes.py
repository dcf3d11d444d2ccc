"""The common diffusers mistakes fail in one line that names the fix (tiny models).

* forgetting ``cond`` for a text-conditioned SD3 / Flux transformer, or the labels of a
  class-conditional DiT: the missing keys are named;
* a diffusers scheduler passed as the sampler: ``sampler_from_scheduler`` (flow matching) or
  ``gradest.DDIM.from_scheduler`` (DDIM / DDPM) is named;
* the bare transformer passed as the model (also inside DDP): ``DiffusersVelocity`` is named.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
diffusers = pytest.importorskip("diffusers")

from diffusers_support import tiny_transformer  # noqa: E402

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
        (lambda: diffusers.DDIMScheduler(), "gradest.DDIM.from_scheduler(scheduler"),
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
    with pytest.raises(InvalidType, match="sampler_from_scheduler|DDIM.from_scheduler"):
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
