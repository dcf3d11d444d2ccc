"""The fast paths of a call read what the slow ones read.

An estimate walks the model's modules once (``EstimationContext``) and hands that walk
to every check and reader; the step loops read the sampler's coefficients as host
floats computed once. These tests pin each fast path to the plain PyTorch reading it
replaces, on the structures that make the two differ if one is written carelessly:
tied parameters, frozen parameters, a parameter slot set to None, a module listed
twice, a model that overrides ``named_parameters``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradest
from gradest._checks import check_noise, trainable_parameters
from gradest.errors import GradestError
from gradest.trajectory import SamplerSteps, draw_step_noise, host_coefficients


class TiedAndFrozen(nn.Module):
    """Tied weights (one tensor under two names), a frozen layer, a None parameter slot
    and one module reachable under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 4)
        self.decode.weight = self.encode.weight  # tied: named_parameters lists it once
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(4, 4, bias=False)  # registers bias as None
        self.alias = self.shared  # the same module under a second name
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        del t
        return self.scale * self.decode(self.alias(self.frozen(self.encode(z))))


class RenamedParameters(TiedAndFrozen):
    """Overrides ``named_parameters`` (as FSDP's wrapper does): its names win."""

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield f"renamed.{name}", p


@pytest.mark.parametrize("model_class", [TiedAndFrozen, RenamedParameters])
def test_trainable_parameters_from_the_walk_are_named_parameters(model_class):
    model = model_class()
    walk = list(model.named_modules())
    plain = trainable_parameters(model)
    from_walk = trainable_parameters(model, walk)
    assert list(from_walk) == list(plain)  # the same names in the same order
    assert all(from_walk[name] is plain[name] for name in plain)  # the same tensors
    expected = [n for n, p in model.named_parameters() if p.requires_grad]
    assert list(plain) == expected


def test_check_noise_reads_the_walk_like_the_parameters():
    model = TiedAndFrozen().double()
    walk = list(model.named_modules())
    check_noise(model, torch.zeros(2, 4, dtype=torch.float64), named_modules=walk)
    wrong = torch.zeros(2, 4, dtype=torch.float32)
    with pytest.raises(GradestError) as plain:
        check_noise(model, wrong)
    with pytest.raises(GradestError) as through_walk:
        check_noise(model, wrong, named_modules=walk)
    assert str(through_walk.value) == str(plain.value)


class ParametersElsewhere(nn.Module):
    """Its ``named_parameters`` answers with tensors the module walk does not hold (as a
    wrapper that keeps the real parameters outside its registered slots does): a float32
    placeholder is registered, the float64 weights are the model's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.placeholder = nn.Parameter(torch.zeros((), dtype=torch.float32))
        self.__dict__["held"] = nn.Linear(4, 4).double()  # not a registered child

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        yield from self.held.named_parameters(prefix, recurse, remove_duplicate)

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        del t
        return self.held(z)


def test_check_noise_asks_an_overridden_named_parameters_as_trainable_parameters_does():
    model = ParametersElsewhere()
    walk = list(model.named_modules())
    assert list(trainable_parameters(model, walk)) == ["weight", "bias"]
    right = torch.zeros(2, 4, dtype=torch.float64)  # the dtype of the model's parameters
    check_noise(model, right)
    check_noise(model, right, named_modules=walk)  # not the placeholder's float32
    with pytest.raises(GradestError) as plain:
        check_noise(model, right.float())
    with pytest.raises(GradestError) as through_walk:
        check_noise(model, right.float(), named_modules=walk)
    assert str(through_walk.value) == str(plain.value)


@pytest.mark.parametrize("sampler", [gradest.RectifiedFlow(steps=5), gradest.FlowSDE(steps=5)])
def test_host_coefficients_are_the_tensors_values_and_lists_pass_through(sampler):
    coefficients = sampler.coefficients()
    host = host_coefficients(coefficients)
    assert host == tuple(c.tolist() for c in coefficients)
    assert host_coefficients(host) is host  # already host floats: not converted again
    steps = SamplerSteps(coefficients, sampler.times, None)
    assert steps.host_coefficients == host  # computed from the tensors when not given


@pytest.mark.parametrize("sampler", [gradest.RectifiedFlow(steps=5), gradest.FlowSDE(steps=5)])
def test_step_noise_drawn_from_host_sigma_is_the_tensor_draw(sampler):
    sigma = sampler.coefficients()[2]
    like = torch.zeros(3, 2, dtype=torch.float64)
    from_tensor = draw_step_noise(sigma, like, torch.Generator().manual_seed(7))
    from_host = draw_step_noise(sigma.tolist(), like, torch.Generator().manual_seed(7))
    if from_tensor is None:
        assert from_host is None and not bool((sigma != 0).any())
    else:
        assert from_host is not None
        assert torch.equal(from_host, from_tensor)
        assert from_host.shape == (sigma.numel(), *like.shape)
