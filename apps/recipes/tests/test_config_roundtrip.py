"""A recipe's saved ``config.toml`` reads back as the same settings, whatever its strings.

``to_toml`` writes every string as a TOML basic string with TOML's escapes (a newline in
a validation prompt used to end the line: invalid TOML); the property runs over
arbitrary text (newlines, quotes, backslashes, every control character, any unicode) in
every free-text setting at once. Config files are read by gradest's one rule for files
read back (:func:`gradest_lab.storage.files.read_text`): a regular file of UTF-8 text, else
one line.
"""

from __future__ import annotations

import os
import signal
import sys
import tomllib
from pathlib import Path

import pytest
from gradest_recipes.config import (
    NOT_SAVED,
    RecipeConfig,
    RecipeConfigError,
    load_config,
    read_toml,
    to_toml,
)
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import _hypothesis_profiles  # noqa: E402  (gradest's profiles: ci / long)

# Settings whose value is any text the user gives (the others are numbers, flags or one
# of a few choices).
FREE_TEXT = (
    "pretrained",
    "variant",
    "embeddings",
    "out",
    "estimator",
    "reward",
    "validation_prompt",
    "lr_step_rules",
)
# Any text UTF-8 can hold (control characters and all of unicode; no lone surrogates),
# not blank: the settings refuse blank names.
TEXT = st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=24).filter(str.strip)
AWKWARD = ["a\nb", 'say "hi"', "C:\\path\\", "tab\there", "\x00\x1f\x7f", "é 中 🙂", "'''", '"""']


def _saved(config: RecipeConfig) -> dict:
    return {
        key: value
        for key, value in config.to_dict().items()
        if value is not None and key not in NOT_SAVED
    }


def _round_trip(config: RecipeConfig, folder: Path) -> None:
    text = to_toml(config)
    assert tomllib.loads(text) == _saved(config)
    path = folder / "config.toml"
    path.write_text(text, encoding="utf-8")
    assert read_toml(path) == _saved(config)
    assert load_config("sd3", file=path) == config


@_hypothesis_profiles.examples(25)
@given(
    values=st.fixed_dictionaries(
        {key: st.one_of(TEXT, st.sampled_from(AWKWARD)) for key in FREE_TEXT}
    ),
    targets=st.lists(st.one_of(TEXT, st.sampled_from(AWKWARD)), min_size=1, max_size=3),
)
def test_every_string_setting_reads_back_as_written(tmp_path_factory, values, targets):
    config = RecipeConfig(tiny=True, lora_targets=tuple(targets), **values)
    _round_trip(config, tmp_path_factory.mktemp("saved"))


def test_a_validation_prompt_with_a_newline_reads_back(tmp_path):
    config = RecipeConfig(tiny=True, validation_prompt='a red "cube"\non a \\ table')
    assert 'validation_prompt = "a red \\"cube\\"\\non a \\\\ table"' in to_toml(config)
    _round_trip(config, tmp_path)


def test_a_setting_with_bytes_that_are_not_utf8_is_refused():
    """Undecodable command-line bytes arrive as lone surrogates, which config.toml (UTF-8)
    could not hold: refused when the config is built, not when it is saved."""
    with pytest.raises(RecipeConfigError, match="validation_prompt=.*not UTF-8 text"):
        RecipeConfig(tiny=True, validation_prompt="caf\udce9")


def test_a_config_file_that_is_not_utf8_or_not_a_file_is_one_line(tmp_path):
    latin = tmp_path / "run.toml"
    latin.write_bytes('validation_prompt = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(RecipeConfigError) as info:
        read_toml(latin)
    message = str(info.value)
    assert "\n" not in message and str(latin) in message and "not UTF-8 text" in message
    pipe = tmp_path / "pipe.toml"
    os.mkfifo(pipe)
    signal.alarm(20)  # a read of a FIFO would wait for a writer forever
    try:
        with pytest.raises(RecipeConfigError, match="FIFO"):
            read_toml(pipe)
    finally:
        signal.alarm(0)
    with pytest.raises(RecipeConfigError, match="does not exist"):
        read_toml(tmp_path / "none.toml")
