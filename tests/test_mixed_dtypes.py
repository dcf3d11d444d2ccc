"""A bfloat16 model with a float32 adapter, called outside autocast: one line naming the
dtypes and the fix (autocast, ``mixed_precision``), not torch's error read as a noise-shape
problem (gradest.mixed_dtypes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradest
from gradest.errors import InvalidValue
from gradest.mixed_dtypes import dtypes_named


class BaseWithAdapter(nn.Module):
    """A frozen bf16 layer plus a trainable fp32 one beside it (LoRA's layout, no peft)."""

    def __init__(self, dim: int = 4, base_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.base = nn.Linear(dim + 1, dim).to(base_dtype).requires_grad_(False)
        self.adapter = nn.Linear(dim + 1, dim, bias=False)  # float32, trainable

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = torch.cat([z, t[:, None].to(z.dtype)], dim=-1)
        return self.base(x) + self.adapter(x)


def objective() -> gradest.TerminalObjective:
    return gradest.TerminalObjective(lambda z: z.float().square().mean())


@pytest.mark.parametrize("noise_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("call", ["surrogate", "estimate", "rollout", "recorded"])
def test_a_bf16_model_with_an_fp32_adapter_names_autocast_and_mixed_precision(noise_dtype, call):
    model, flow = BaseWithAdapter(), gradest.RectifiedFlow(steps=3)
    noise = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(noise_dtype)
    exact = gradest.estimator("exact")
    with pytest.raises(InvalidValue) as raised:
        if call == "rollout":
            gradest.rollout(model, flow, noise)
        elif call == "recorded":  # the estimate's own first call, on a path recorded in bf16
            with torch.autocast("cpu", dtype=torch.bfloat16):
                path = gradest.rollout(model, flow, noise.to(torch.bfloat16))
            exact.surrogate(model, flow, objective(), trajectory=path)
        else:
            getattr(exact, call)(model, flow, objective(), noise=noise)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("model(z, t, **cond) mixes floating-point dtypes on a state of")
    assert "its frozen parameters are torch.bfloat16, its trainable ones torch.float32" in message
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in message
    assert "--mixed_precision bf16" in message and "mixed_precision='bf16'" in message
    assert "noise has the shape" not in message  # the old, unrelated hint
    assert isinstance(raised.value.__cause__, RuntimeError)  # torch's own error, kept


def test_the_fix_it_names_works():
    model, flow = BaseWithAdapter(), gradest.RectifiedFlow(steps=3)
    noise = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sur = gradest.estimator("exact").surrogate(model, flow, objective(), noise=noise)
    sur.loss.backward()
    assert model.adapter.weight.grad is not None and model.adapter.weight.grad.abs().sum() > 0


def test_float32_against_float64_names_a_cast_not_autocast():
    model, flow = BaseWithAdapter(base_dtype=torch.float64), gradest.RectifiedFlow(steps=3)
    with pytest.raises(InvalidValue, match="mixes floating-point dtypes") as raised:
        gradest.rollout(model, flow, torch.randn(2, 4))
    assert "give the model and the noise one dtype" in str(raised.value)
    assert "autocast" not in str(raised.value)


def test_a_shape_error_keeps_its_shape_hint():
    model, flow = BaseWithAdapter(base_dtype=torch.float32), gradest.RectifiedFlow(steps=3)
    with pytest.raises(InvalidValue, match="noise has the shape the model expects"):
        gradest.rollout(model, flow, torch.randn(2, 5))


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("mat1 and mat2 must have the same dtype, but got Float and BFloat16", 2),
        ("expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float", 2),
        ("expected scalar type Float but found BFloat16", 2),
        ("Input type (c10::Half) and bias type (float) should be the same", 2),
        (
            "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the "
            "same or input should be a MKLDNN tensor and weight is a dense tensor",
            1,
        ),  # devices
        ("mat1 and mat2 shapes cannot be multiplied (2x6 and 5x4)", 0),
    ],
)
def test_torch_messages_that_name_two_dtypes(text, named):
    assert len(dtypes_named(RuntimeError(text))) == named
