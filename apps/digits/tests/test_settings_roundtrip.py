"""The digits application under gradest's rules for settings, integers and surrogates.

* What ``gradest finetune`` writes as its settings (``settings.json``) reads back by
  ``--resume`` as the same settings, for any text in any string setting (a property).
* Integer settings follow gradest's one rule (:mod:`gradest.integers`) from a
  ``--config`` file as on the command line, and from Python (no seed beyond int64).
* A plugin's surrogate that is not a scalar loss is one line naming the plugin in the
  training loop (:func:`gradest_digits.finetune_run.surrogate_loss`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import attrs
import pytest
import torch
from gradest_digits.finetune_cli import RUN_SETTINGS, recorded_settings, write_settings
from gradest_digits.finetune_config import FinetuneConfig
from gradest_digits.finetune_run import surrogate_loss
from hypothesis import given
from hypothesis import strategies as st

import gradest
from gradest.cli import main
from gradest.errors import GradestError, InvalidValue
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import _hypothesis_profiles  # noqa: E402  (gradest's profiles: ci / long)

TEXT = st.text(max_size=24)  # any text, lone surrogates included (JSON escapes them)
STRING_SETTINGS = ("estimator", "mode", "optimizer", "log_prob_reduction", "labels", "device")


def _defaults() -> dict:
    config = FinetuneConfig()
    settings = {name: getattr(config, name) for name in FinetuneConfig.names()}
    return {**settings, "target": 3, "labels": "null", "lora_rank": 0, "device": "cpu"}


@_hypothesis_profiles.examples(25)
@given(
    texts=st.fixed_dictionaries({name: TEXT for name in STRING_SETTINGS}),
    numbers=st.fixed_dictionaries(
        {
            "lr": st.floats(allow_nan=False),
            "seed": st.integers(min_value=0, max_value=2**63 - 1),
            "max_grad_norm": st.none() | st.floats(allow_nan=False),
        }
    ),
)
def test_written_settings_read_back_as_the_same_settings(tmp_path_factory, texts, numbers):
    settings = {**_defaults(), **texts, **numbers}
    assert set(RUN_SETTINGS) <= set(settings)
    out = tmp_path_factory.mktemp("run")
    write_settings(out, settings)
    assert recorded_settings(out) == {name: settings[name] for name in RUN_SETTINGS}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps = 0\n", "steps = 0 in .*: must be a whole number >= 1, got 0"),
        ("seed = -1\n", "seed = -1 in .*: must be a whole number >= 0, got -1"),
        ("batch_size = 99999999999999999999\n", "of at most 2\\*\\*63 - 1 in size"),
        ("group_size = 1\n", "group_size = 1 in .*: must be a whole number >= 2"),
        ("target = 10\n", "--target must be a digit 0..9, got 10"),
        ("target = -1\n", "target = -1 in .*: must be a whole number >= 0, got -1"),
    ],
)
def test_an_integer_in_a_config_file_follows_its_flags_rule(tmp_path, capsys, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text)
    code = main(["finetune", "--config", str(config), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "x").exists()


def test_a_seed_beyond_int64_is_refused_from_python_too():
    with pytest.raises(InvalidValue, match=r"seed must be at most 2\*\*63 - 1"):
        FinetuneConfig(seed=2**63)


class _VectorSurrogate:
    """A plugin whose surrogate loss is a vector (exact's, times three ones)."""

    name = "vector_surrogate"
    objectives = ("terminal",)

    def estimate(self, model, sampler, objective, **inputs):
        return gradest.estimator("exact").estimate(model, sampler, objective, **inputs)

    def surrogate(self, model, sampler, objective, **inputs):
        sur = gradest.estimator("exact").surrogate(model, sampler, objective, **inputs)
        return attrs.evolve(sur, loss=sur.loss * torch.ones(3))


_VectorSurrogate.__module__ = "a_plugin"


def test_a_plugins_vector_surrogate_names_the_plugin_in_the_training_loop():
    model = tiny_mlp(3)
    with pytest.raises(GradestError) as info:
        surrogate_loss(
            _VectorSurrogate(),
            model,
            gradest.RectifiedFlow(steps=2),
            smooth_terminal_objective(3),
            noise=seeded_normal((2, 3), 0),
        )
    message = str(info.value)
    assert message.startswith("estimator 'vector_surrogate' (a_plugin._VectorSurrogate)")
    assert "shape (3,)" in message and "\n" not in message
