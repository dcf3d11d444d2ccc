"""A repeated option key is refused wherever the recipes parse options.

``--reward aesthetic:model=A,model=B`` used to run with ``model=B`` (the last one won),
and ``--set lr=1e-4 --set lr=2e-4`` with ``2e-4``, as if the first were never written.
Each is now one line naming the setting, the key and the fix (give it once), exit status
2, before the run folder is created, as gradest's own estimator specs already refuse
``jagg:window=2,window=4``. The recipe runs in-process through ``script_main``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gradest_recipes.config import RecipeConfigError, config_from_argv  # noqa: E402
from gradest_recipes.rewards import resolve_reward  # noqa: E402
from gradest_recipes.train import script_main  # noqa: E402
from recipe_support import RECIPE_WARNINGS  # noqa: E402

pytestmark = RECIPE_WARNINGS

TINY = ["--tiny", "--report_to", "none", "--max_train_steps", "1"]


def refusal(capsys: pytest.CaptureFixture[str], out: Path, *argv: str) -> str:
    """``sd3_reward.py ARGV --output_dir OUT`` in-process, refused: its one error line
    (the run folder is not created)."""
    capsys.readouterr()
    status = script_main("sd3", [*TINY, *argv, "--output_dir", str(out)])
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if ": error: " in line]
    assert status == 2 and len(errors) == 1, err
    assert not out.exists()
    return errors[0]


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ("color:r=1,r=0", "r"),
        ("color:r=1, g=0,r =0.5", "r"),
        ("aesthetic:model=A,model=B", "model"),
        ("hpsv2:version=2.0,download=0,version=2.1", "version"),
    ],
)
def test_a_reward_option_given_twice_is_refused(tmp_path, capsys, spec, key):
    line = refusal(capsys, tmp_path / "run", "--reward", spec)
    assert f"setting reward={spec!r} sets option {key!r} twice" in line
    assert "give each option once" in line


def test_reward_options_given_once_still_work():
    """The same options, each once: resolved as before (a built-in reward needs no file)."""
    reward = resolve_reward("color:r=0,g=1, b=0")
    assert callable(reward)


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["--set", "lr=1e-4", "--set", "lr=2e-4"], "--set lr=1e-4 and --set lr=2e-4"),
        # two names of one setting (diffusers' name, a hyphen) are one key
        (["--set", "lr=1e-4", "--set", "learning-rate=1e-4"], "--set learning-rate=1e-4"),
        (["--set", "lr=1e-4", "--lr", "2e-4"], "--set lr=1e-4 and its flag"),
    ],
)
def test_a_setting_given_twice_on_the_command_line_is_refused(tmp_path, capsys, argv, shown):
    line = refusal(capsys, tmp_path / "run", *argv)
    assert "setting lr is given twice on the command line" in line
    assert shown in line and "give it once" in line
    with pytest.raises(RecipeConfigError, match="setting lr is given twice"):
        config_from_argv("sd3", ["--tiny", *argv])


def test_settings_given_once_still_work():
    config, _ = config_from_argv("sd3", ["--tiny", "--set", "lr=2e-4", "--set", "seed=3"])
    assert (config.lr, config.seed) == (2e-4, 3)


def test_a_config_file_naming_one_setting_twice_is_refused(tmp_path, capsys):
    """Two names of one setting in a ``--config`` file, even with one value: refused."""
    file = tmp_path / "run.toml"
    file.write_text("lr = 1e-3\nlearning_rate = 1e-3\n")
    line = refusal(capsys, tmp_path / "run", "--config", str(file))
    assert "setting lr is given twice in config file" in line and "give it once" in line
