"""The RL-objectives digits benchmark: its mode specs and its path-KL metric."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from gradest_digits import rl_objectives_benchmark as bench
from gradest_digits.assets import load_pretrained_dit


def test_mode_specs_parse_and_bad_ones_are_refused():
    assert bench.parse_mode("reward") == ("reward", {})
    assert bench.parse_mode("grpo:kl=0.1,lr=3e-4") == ("grpo", {"kl": "0.1", "lr": "3e-4"})
    assert bench.parse_mode("adjoint_matching:est=jagg:window=5") == (
        "adjoint_matching",
        {"est": "jagg:window=5"},
    )
    for bad in ("grpo:beta=1", "grpo:kl=", "grpo:kl"):
        with pytest.raises(SystemExit, match="keys must be kl, lr, est"):
            bench.parse_mode(bad)


def test_path_kl_is_zero_for_the_base_and_grows_with_the_change():
    args = argparse.Namespace(sampler_steps=4, eval_samples=16)
    base = load_pretrained_dit()
    assert bench.path_kl(base, base, args) == 0.0
    kls = []
    for scale in (1e-3, 2e-3):
        moved = copy.deepcopy(base)
        with torch.no_grad():
            for parameter in moved.parameters():
                parameter.add_(scale * torch.ones_like(parameter))
        kls.append(bench.path_kl(moved, base, args))
    # A KL is quadratic in a small change of the means: doubling the change about
    # quadruples it (not exactly: the rollouts themselves move too).
    assert 0 < kls[0] < kls[1]
    assert 3.0 < kls[1] / kls[0] < 5.0
