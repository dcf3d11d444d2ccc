"""One rule per class of input, tried on cases it was not written for.

* **Only onto regular files** (:func:`gradest_lab.storage.files.refuse_non_file`): every writer
  (``atomic_write`` and what builds on it, ``JsonLog``, the early ``check_output_file``)
  refuses an existing path that is not a regular file (a FIFO, a character device, a
  folder, through a symbolic link too) in one line and leaves it as it was; a loop of
  links or an over-long name is one line, not a traceback. ``/dev/null`` itself is only
  ever checked with every way of writing disabled, and is a character device afterwards.
* **Whole numbers** (:class:`gradest.integers.WholeNumber`): every integer flag of every
  ``gradest`` command, a ``--config`` value and a ``--task-option`` integer.
* **diffusers configs by the class's own signature**
  (:func:`gradest_lab.cost.diffusers_presets.checked_config`).
* ``truncated``'s ``random=`` by kind (numpy arrays and tensors included).
* **A plugin's surrogate** (:func:`gradest.protocol.check_surrogate`): a vector or a bare
  tensor is one line naming the plugin wherever gradest backpropagates it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import io
import json
import os
import signal
import stat
import tempfile
from pathlib import Path
from typing import Any

import _hypothesis_profiles
import attrs
import numpy as np
import pytest
import torch
from gradest_lab.errors import MissingFile
from gradest_lab.race.task_options import parse_task_options
from gradest_lab.storage.config_file import load_defaults
from gradest_lab.storage.files import (
    JsonLog,
    OutputError,
    atomic_save,
    atomic_write_text,
    check_output_dir,
    check_output_file,
    read_text,
    refuse_non_file,
)
from hypothesis import given
from hypothesis import strategies as st

import gradest
from gradest import cli
from gradest.errors import GradestError, InvalidType, InvalidValue
from gradest.integers import INT64_MAX, WholeNumber, whole_number_problem
from gradest.protocol import check_surrogate
from gradest.testing.problems import seeded_normal, smooth_terminal_objective, tiny_mlp

DIM, BATCH = 3, 2

# -- helpers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def no_hang(seconds: int = 20):
    """Fail instead of waiting forever (an open or read of a FIFO blocks without a peer)."""

    def fail(signum, frame):
        raise AssertionError(f"blocked for {seconds} s (a FIFO opened or read?)")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: list[str]) -> tuple[int, list[str]]:
    """``gradest argv``: the exit status and the non-empty stderr lines."""
    err = io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
        no_hang(),
    ):
        try:
            status = cli.main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return status, [line for line in err.getvalue().splitlines() if line.strip()]


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message, message
    return message


def char_device(path: Path) -> Path:
    """A character device node like /dev/null's, in a test folder (skip where mknod is not
    permitted)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as err:
        pytest.skip(f"mknod is not permitted here ({err})")
    return path


def kind_of(path: Path) -> str:
    mode = os.lstat(path).st_mode
    for test, name in ((stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "chr"), (stat.S_ISDIR, "dir")):
        if test(mode):
            return name
    return "link" if stat.S_ISLNK(mode) else "file"


# Every way gradest writes or reads back a file, each with how it must refuse.
WRITERS = {
    "check_output_file": lambda path: check_output_file(path, what="--json"),
    "atomic_write_text": lambda path: atomic_write_text(path, "{}\n"),
    "atomic_save": lambda path: atomic_save({"x": torch.zeros(2)}, path),
    "JsonLog.append": lambda path: JsonLog(path).append({"step": 0}),
    "JsonLog.records": lambda path: JsonLog(path).records(),
    "read_text": lambda path: read_text(path, what="--config"),
}


# -- only onto regular files -----------------------------------------------------------------


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("make", ["fifo", "chr", "dir", "fifo through a linked folder"])
def test_a_path_that_is_not_a_regular_file_is_refused_and_kept(tmp_path, writer, make):
    if make == "fifo":
        target = tmp_path / "out.json"
        os.mkfifo(target)
    elif make == "chr":
        target = char_device(tmp_path / "out.json")
    elif make == "dir":
        target = tmp_path / "out.json"
        target.mkdir()
    else:
        (tmp_path / "real").mkdir()
        os.mkfifo(tmp_path / "real" / "out.json")
        (tmp_path / "link").symlink_to(tmp_path / "real")
        target = tmp_path / "link" / "out.json"
    before = os.stat(target)
    with no_hang(), pytest.raises(GradestError) as info:
        WRITERS[writer](target)
    message = one_line(info.value)
    assert str(target) in message, message
    assert isinstance(info.value, ValueError | FileNotFoundError)
    after = os.stat(target)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (
        before.st_mode,
        before.st_ino,
        before.st_rdev,
    )
    assert sorted(p.name for p in target.parent.iterdir() if p.name.endswith(".tmp")) == []


@pytest.fixture
def nothing_can_be_written(monkeypatch):
    """Every way gradest_lab.storage.files writes is disabled: a refusal must come before any
    of them."""

    def refused(*args, **kwargs):
        raise AssertionError("a write was attempted")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    monkeypatch.setattr(os, "replace", refused)
    monkeypatch.setattr(os, "open", refused)
    monkeypatch.setattr(Path, "mkdir", refused)


@pytest.mark.parametrize("writer", ["check_output_file", "atomic_write_text", "JsonLog.append"])
def test_dev_null_is_refused_before_any_write(writer, nothing_can_be_written):
    before = os.stat("/dev/null")
    assert stat.S_ISCHR(before.st_mode)
    with pytest.raises(OutputError, match=r"'/dev/null' is a character device, not a regular"):
        WRITERS[writer]("/dev/null")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_a_link_to_dev_null_is_refused_and_stays_a_link(tmp_path, nothing_can_be_written):
    link = tmp_path / "result.json"
    link.symlink_to("/dev/null")
    for writer in ("check_output_file", "atomic_write_text", "JsonLog.append"):
        with pytest.raises(OutputError) as info:
            WRITERS[writer](link)
        assert str(link) in one_line(info.value)
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_gradest_cost_json_on_a_fifo_or_dev_null_is_one_line_and_kept(tmp_path, monkeypatch):
    fifo = tmp_path / "costs.json"
    os.mkfifo(fifo)
    status, lines = run_cli(["cost", "--model", "mlp", "--json", str(fifo), "--quiet"])
    assert status == 2 and len(lines) == 1, lines
    assert f"--json {str(fifo)!r} is a FIFO (named pipe), not a regular file" in lines[0]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    # /dev/null only with every write disabled: the refusal comes first.
    for name, target in (("mkstemp", tempfile), ("replace", os)):
        monkeypatch.setattr(target, name, lambda *a, **k: pytest.fail("a write was attempted"))
    status, lines = run_cli(["cost", "--model", "mlp", "--json", "/dev/null", "--quiet"])
    assert status == 2 and len(lines) == 1, lines
    assert "'/dev/null' is a character device" in lines[0]
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def _out_flags(tmp_path: Path) -> dict[str, list[str]]:
    """Commands and where their output path goes (``{}``)."""
    commands = {
        "compare": ["compare", "--out", "{}", "--quiet"],
        "race": ["race", "--model", "digits", "--budget", "1x", "--out", "{}", "--quiet"],
        "cost": ["cost", "--model", "mlp", "--json", "{}/x.json", "--quiet"],
    }
    if "finetune" in cli.build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        commands["finetune"] = ["finetune", "--out", "{}", "--quiet"]
        commands["pretrain"] = ["pretrain", "--what", "dit", "--out", "{}/m.pt", "--quiet"]
    return commands


@pytest.mark.parametrize("command", ["compare", "race", "cost", "finetune", "pretrain"])
@pytest.mark.parametrize("path", ["300 characters", "a loop of links"])
def test_an_output_path_that_cannot_be_named_or_resolved_is_one_line(tmp_path, command, path):
    commands = _out_flags(tmp_path)
    if command not in commands:
        pytest.skip("the digits application is not installed")
    from gradest_lab.race.plain_race import registered_tasks

    if command == "race" and "digits" not in registered_tasks():
        pytest.skip("the digits race task is not installed")
    if path == "a loop of links":
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        out = str(tmp_path / "loop" / "run")
    else:
        out = str(tmp_path / ("x" * 300))
    argv = [arg.replace("{}", out) for arg in commands[command]]
    status, lines = run_cli(argv)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"gradest {command}: error: "), lines
    assert ("300 bytes" in lines[0]) if path == "300 characters" else ("loop" in lines[0])


PATH_KINDS = ["nothing", "file", "fifo", "dir", "link to file", "link to fifo", "dangling link"]


def _make(tmp: Path, kind: str) -> Path:
    target = tmp / "target"
    if kind == "file":
        target.write_text("old\n")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    elif kind.startswith("link"):
        other = tmp / "other"
        if kind == "link to file":
            other.write_text("old\n")
        elif kind == "link to fifo":
            os.mkfifo(other)
        target.symlink_to(other)
    return target


@_hypothesis_profiles.examples(20)
@given(kind=st.sampled_from(PATH_KINDS), writer=st.sampled_from(["text", "save", "check"]))
def test_a_write_happens_exactly_when_the_path_is_nothing_or_a_regular_file(kind, writer):
    """The property: whatever stands at the path (or at the end of its link), a writer
    either writes a regular file there or refuses, in one line, leaving it as it was."""
    with tempfile.TemporaryDirectory() as folder:
        target = _make(Path(folder), kind)
        final = Path(os.path.realpath(target)) if target.is_symlink() else target
        writable = not final.exists() or final.is_file()
        before = os.lstat(target) if os.path.lexists(target) else None
        call = {
            "text": lambda: atomic_write_text(target, "new\n"),
            "save": lambda: atomic_save({"x": 1}, target),
            "check": lambda: check_output_file(target, what="--out"),
        }[writer]
        with no_hang():
            if writable:
                call()
                if writer != "check":
                    assert Path(target).is_file() and not Path(target).is_symlink()
            else:
                with pytest.raises(OutputError) as info:
                    call()
                one_line(info.value)
                after = os.lstat(target)
                assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)


def test_a_folder_path_that_is_a_fifo_or_device_is_named_as_such(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(OutputError, match=r"is a FIFO \(named pipe\); pass a folder path"):
        check_output_dir(tmp_path / "pipe", what="--out")
    refuse_non_file(tmp_path / "nothing-here", what="--out")  # nothing there: fine


def test_a_config_file_that_is_not_utf8_a_fifo_or_missing_is_one_line(tmp_path):
    latin = tmp_path / "run.toml"
    latin.write_bytes('estimator = "sdo"\nvalidation = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(InvalidValue, match=r"is not UTF-8 text \(byte 0xe9 at offset 35\)"):
        read_text(latin, what="--config")
    parser = argparse.ArgumentParser()
    parser.add_argument("--estimator")
    with pytest.raises(InvalidValue) as info:
        load_defaults(latin, parser)
    assert str(latin) in one_line(info.value) and "UTF-8" in str(info.value)
    os.mkfifo(tmp_path / "pipe.toml")
    with no_hang(), pytest.raises(InvalidValue, match="FIFO"):
        load_defaults(tmp_path / "pipe.toml", parser)
    with pytest.raises(MissingFile, match="no such file"):
        load_defaults(tmp_path / "none.toml", parser)


# -- whole numbers ---------------------------------------------------------------------------


def _integer_flags() -> list[tuple[str, str, WholeNumber]]:
    """``(command, flag, type)`` of every flag of every gradest command that takes an
    integer (applications' commands included)."""
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    found = []
    for name, sub in commands.items():
        for action in sub._actions:
            if isinstance(action.type, WholeNumber):
                found.append((name, action.option_strings[-1], action.type))
    return found


def test_no_command_takes_a_plain_int_flag():
    """The one rule covers every integer flag: none is typed with a bare ``int``."""
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    plain = [
        f"gradest {name} {action.option_strings[-1]}"
        for name, sub in commands.items()
        for action in sub._actions
        if action.type is int
    ]
    # The race's --seeds is a seed list (a count, a range or a list), read by its own
    # parser (gradest_lab.race.tuned_race.parse_seed_list), not an integer flag.
    assert [flag for flag in plain if flag != "gradest race --seeds"] == []
    flags = {(command, flag) for command, flag, _ in _integer_flags()}
    assert {("cost", "--batch"), ("compare", "--seeds"), ("check", "--steps")} <= flags


BAD_TEXTS = st.one_of(
    st.integers(max_value=0).map(str),  # below every range that starts at 1
    st.integers(min_value=INT64_MAX + 1).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet="0123456789.eE+-_x ", min_size=1, max_size=8).filter(
        # "--" itself: argparse drops it from `--flag=--` before any type sees it (a quirk
        # of argparse's own, for every flag, not of the integer rule).
        lambda text: text != "--" and whole_number_problem(_as_int(text), minimum=1) is not None
    ),
)


def _as_int(text: str) -> Any:
    try:
        return int(text.strip(), 10) if text.strip().lstrip("+-").isdigit() else text
    except ValueError:
        return text


@_hypothesis_profiles.examples(30)
@given(data=st.data(), text=BAD_TEXTS)
def test_every_integer_flag_refuses_what_is_not_a_whole_number_in_range(data, text):
    command, flag, kind = data.draw(st.sampled_from(_integer_flags()))
    value = _as_int(text)
    if isinstance(value, int) and whole_number_problem(value, minimum=kind.minimum) is None:
        return  # in this flag's range (seeds start at 0)
    status, lines = run_cli([command, f"{flag}={text}"])
    assert status == 2 and len(lines) == 1, (command, flag, text, lines)
    assert lines[0].startswith(f"gradest {command}: error: argument {flag}"), lines
    assert "whole number" in lines[0]


@_hypothesis_profiles.examples(30)
@given(
    minimum=st.sampled_from([0, 1, 2]),
    value=st.integers(min_value=-(2**70), max_value=2**70),
)
def test_a_whole_number_reads_back_exactly_when_in_range(minimum, value):
    kind = WholeNumber(minimum)
    if minimum <= value <= INT64_MAX:
        assert kind.parse(str(value)) == value == kind.check(value)
        assert kind(f" +{value} " if value >= 0 else str(value)) == value
    else:
        with pytest.raises(InvalidValue) as info:
            kind.parse(str(value))
        assert "whole number" in one_line(info.value)
        with pytest.raises(argparse.ArgumentTypeError):
            kind(str(value))


def test_a_config_file_value_follows_its_flags_range(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=WholeNumber(1))
    config = tmp_path / "run.toml"
    for text, message in (
        ("steps = 0", r"steps = 0 in .*run\.toml: must be a whole number >= 1, got 0"),
        ("steps = 99999999999999999999", "2\\*\\*63 - 1"),
        ("steps = 2.5", "expected an integer"),
    ):
        config.write_text(text + "\n")
        with pytest.raises(GradestError, match=message):
            load_defaults(config, parser)
    config.write_text("steps = 3\n")
    assert load_defaults(config, parser) == {"steps": 3}


def _factory(*, eval_samples: int = 256, device: str = "cpu", batch: int = 16, name=None):
    return None


@pytest.mark.parametrize(
    "text",
    ["batch=99999999999999999999", "batch=-99999999999999999999", "name=10000000000000000000"],
)
def test_a_task_option_integer_must_fit_int64(text):
    with pytest.raises(InvalidValue) as info:
        parse_task_options(_factory, [text], model="toy")
    message = one_line(info.value)
    assert text.partition("=")[0] in message and "2**63 - 1" in message
    # Sign and zero are the task's own to check (it knows its range).
    assert parse_task_options(_factory, ["batch=-1"], model="toy") == {"batch": -1}


def test_race_on_cuda_without_cuda_is_refused_before_the_task_is_built(monkeypatch, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from gradest_lab.race import plain_race as race

    def never(**kwargs):
        raise AssertionError("the task was built")

    monkeypatch.setattr(race, "registered_tasks", lambda: {"toy": never})
    argv = ["race", "--model", "toy", "--budget", "2x", "--device", "cuda", "--quiet"]
    status, lines = run_cli(argv)
    assert status == 2 and lines == [
        "gradest race: error: --device cuda requested but CUDA is not available; use --device cpu"
    ]
    # The same check as compare's.
    compare = ["compare", "--device", "cuda", "--out", str(tmp_path / "c"), "--quiet"]
    assert run_cli(compare)[1][-1].endswith(
        "--device cuda requested but CUDA is not available; use --device cpu"
    )


def test_cost_refuses_a_negative_batch_from_python_too():
    from gradest_lab.cost.command import model_setup

    for value in (-1, 0, 2.5, True, 2**63):
        with pytest.raises(InvalidValue, match="--batch must be a whole number >= 1"):
            model_setup("mlp", batch=value)


# -- diffusers configs -----------------------------------------------------------------------

needs_diffusers = pytest.mark.skipif(
    importlib.util.find_spec("diffusers") is None, reason="needs diffusers"
)


def _presets() -> Any:
    from gradest_lab.cost import diffusers_presets

    return diffusers_presets


def _int_fields(class_name: str) -> list[tuple[str, Any, Any]]:
    """``(field, default, annotation)`` of the class's ``__init__`` fields whose annotation
    holds an ``int`` (found by inspect: the cases the check was not written for)."""
    presets = _presets()
    fields = presets._init_fields(presets._diffusers_class(class_name))
    return [
        (name, default, annotation)
        for name, (default, annotation) in fields.items()
        if presets._mentions_int(annotation)
    ]


PRESET_NAMES = ["sd3-medium", "sd3.5-large", "flux-dev", "sdxl-unet"]


@needs_diffusers
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_every_preset_passes_and_missing_fields_get_diffusers_defaults(preset):
    presets = _presets()
    assert sorted(presets.PRESETS) == sorted(PRESET_NAMES)
    config = presets.PRESETS[preset].config
    filled = presets.checked_config(config)
    fields = presets._init_fields(presets._diffusers_class(config["_class_name"]))
    for name, (default, _) in fields.items():
        assert filled[name] == (config[name] if name in config else default), name


BAD_INTS = [0, -1, 2.5, "8", None, True, INT64_MAX + 1, [4]]


@needs_diffusers
@_hypothesis_profiles.examples(40)
@given(data=st.data())
def test_every_integer_field_of_every_family_refuses_a_bad_value(data):
    presets = _presets()
    preset = data.draw(st.sampled_from(PRESET_NAMES))
    base = presets.PRESETS[preset].config
    field, default, annotation = data.draw(st.sampled_from(_int_fields(base["_class_name"])))
    value = data.draw(st.sampled_from(BAD_INTS))
    minimum = 0 if field in presets.NON_NEGATIVE_FIELDS else 1
    allowed = (
        (value is None and "None" in str(annotation))
        or (value == 0 and minimum == 0 and not isinstance(value, bool))
        or (isinstance(value, list) and "tuple" in str(annotation))
        # A relation between fields may refuse a value the type accepts; not this test's.
    )
    config = {**base, field: value}
    if allowed:
        with contextlib.suppress(InvalidValue):
            presets.checked_config(config)
        return
    with pytest.raises(InvalidValue) as info:
        presets.checked_config(config, source="--model 'x'")
    message = one_line(info.value)
    assert f"field {field}={json.dumps(value)} is invalid" in message, message
    assert message.startswith("--model 'x' (")


@needs_diffusers
@pytest.mark.parametrize(
    ("preset", "change", "names"),
    [
        ("sd3-medium", {"num_layers": -1}, ["num_layers=-1", "num_layers=18"]),
        ("sd3-medium", {"caption_projection_dim": 1000}, ["caption_projection_dim=1536"]),
        ("sd3-medium", {"dual_attention_layers": [24]}, ["dual_attention_layers=[24]"]),
        ("flux-dev", {"axes_dims_rope": [16, 56, 55]}, ["sum to 128"]),
        ("flux-dev", {"axes_dims_rope": [17, 56, 55]}, ["odd sizes [17, 55]"]),
        ("flux-dev", {"guidance_embeds": "yes"}, ['guidance_embeds="yes"']),
        ("sdxl-unet", {"attention_head_dim": [5, 10, 21]}, ["heads do not divide"]),
        ("sdxl-unet", {"norm_num_groups": 7}, ["norm_num_groups=7 does not divide"]),
        ("sdxl-unet", {"block_out_channels": [320, 640]}, ["block_out_channels has 2"]),
        ("sdxl-unet", {"transformer_layers_per_block": [1, 2]}, ["has 2 entries for 3"]),
        ("sdxl-unet", {"projection_class_embeddings_input_dim": 1536}, ["must exceed 6 x"]),
        ("sdxl-unet", {"freq_shift": -1}, ["freq_shift=-1", ">= 0"]),
    ],
)
def test_the_families_relations_are_checked_before_building(preset, change, names):
    presets = _presets()
    with pytest.raises(InvalidValue) as info:
        presets.checked_config({**presets.PRESETS[preset].config, **change})
    message = one_line(info.value)
    for name in names:
        assert name in message, message


@needs_diffusers
def test_a_field_left_out_gets_diffusers_default_not_a_guess():
    """SD3 patches 2x2 by default (diffusers' signature): without patch_size a size that
    is a multiple of 8 but not of 16 is refused (a default of 1 would have taken it)."""
    presets = _presets()
    config = {"_class_name": "SD3Transformer2DModel"}
    signature = inspect.signature(presets._diffusers_class(config["_class_name"]).__init__)
    patch = presets.checked_config(config)["patch_size"]
    assert patch == signature.parameters["patch_size"].default == 2
    with pytest.raises(InvalidValue, match="multiples of 16"):
        presets.diffusers_shapes(config, batch=1, height=24, width=24, dtype=torch.float32)


@needs_diffusers
def test_gradest_cost_on_a_config_folder_with_num_layers_minus_one_is_one_line(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = {**_presets().PRESETS["sd3-medium"].config, "num_layers": -1}
    (folder / "config.json").write_text(json.dumps(config))
    argv = ["cost", "--model", str(folder), "--height", "64", "--width", "64", "--steps", "2"]
    status, lines = run_cli([*argv, "--quiet"])
    assert status == 2 and len(lines) == 1, lines
    assert f"--model {str(folder)!r} (SD3Transformer2DModel): field num_layers=-1" in lines[0]


# -- truncated's random= ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [np.array([0.25, 0.75]), torch.tensor([0.25, 0.75]), [np.float32(0.25), np.float64(0.75)]],
)
def test_a_one_d_array_of_probabilities_is_a_sequence_of_them(value):
    assert gradest.estimator("truncated", random=value) == gradest.estimator(
        "truncated", random=(0.25, 0.75)
    )


@_hypothesis_profiles.examples(20)
@given(
    shape=st.sampled_from([(), (1, 2), (2, 1, 1), (0, 3)]),
    kind=st.sampled_from(["numpy", "torch"]),
)
def test_an_array_of_another_shape_is_one_line_naming_the_option(shape, kind):
    value = np.full(shape, 0.5) if kind == "numpy" else torch.full(shape, 0.5)
    with pytest.raises(InvalidType) as info:
        gradest.estimator("truncated", random=value)
    message = one_line(info.value)
    assert "option random=" in message and f"shape {tuple(shape)}" in message


@pytest.mark.parametrize("value", [{0.5, 0.25}, {"p": 1.0}, [0.5, "0.5"], (True, False), object()])
def test_other_kinds_of_random_are_one_line_naming_the_option(value):
    with pytest.raises(InvalidType) as info:
        gradest.estimator("truncated", random=value)
    assert "option random=" in one_line(info.value)


# -- a plugin's surrogate --------------------------------------------------------------------


class _SurrogatePlugin:
    """A plugin estimator (not an EstimatorBase) whose surrogate is ``make(exact's)``."""

    name = "bad_surrogate"
    objectives = ("terminal", "stepwise")

    def __init__(self, make):
        self.make = make

    def estimate(self, model, sampler, objective, **inputs):
        return gradest.estimator("exact").estimate(model, sampler, objective, **inputs)

    def surrogate(self, model, sampler, objective, **inputs):
        return self.make(gradest.estimator("exact").surrogate(model, sampler, objective, **inputs))


_SurrogatePlugin.__module__ = "a_plugin"

BAD_SURROGATES = {
    "a vector loss": (lambda sur: attrs.evolve(sur, loss=sur.loss * torch.ones(3)), "shape (3,)"),
    "a bare vector": (lambda sur: sur.loss * torch.ones(3), "a bare tensor of shape (3,)"),
    "a bare scalar": (lambda sur: sur.loss, "a bare tensor of shape ()"),
    "a float loss": (lambda sur: attrs.evolve(sur, loss=1.0), "loss is a float"),
    "a dict": (lambda sur: {"loss": sur.loss}, "returned dict"),
}


@pytest.mark.parametrize("case", list(BAD_SURROGATES))
def test_a_plugins_surrogate_that_is_not_a_scalar_loss_names_the_plugin(case):
    from gradest_lab.cost.training_cost import training_step_cost
    from gradest_lab.race.plain_race import StepProblem, _surrogate

    from gradest.testing.checks import surrogate_gradient

    make, shown = BAD_SURROGATES[case]
    plugin = _SurrogatePlugin(make)
    model, flow = tiny_mlp(DIM), gradest.RectifiedFlow(steps=3)
    objective = smooth_terminal_objective(DIM)
    noise = seeded_normal((BATCH, DIM), 0)
    label = "estimator 'bad_surrogate' (a_plugin._SurrogatePlugin)"
    for where in (
        # gradest check's comparison, gradest cost's traced step, the check itself
        lambda: surrogate_gradient(plugin, model, flow, objective, noise=noise),
        lambda: training_step_cost(
            plugin, model, flow, objective, noise=noise, draws=1, varies=False, replay=False
        ),
        lambda: check_surrogate(plugin, plugin.surrogate(model, flow, objective, noise=noise)),
        # a race's training step
        lambda: _surrogate(plugin, model, flow, StepProblem(objective, {"noise": noise}), None),
    ):
        with pytest.raises(GradestError) as info:
            where()
        message = one_line(info.value)
        assert message.startswith(label) and shown in message, message
        assert isinstance(info.value, TypeError | ValueError)


def test_a_good_surrogate_passes_unchanged():
    plugin = _SurrogatePlugin(lambda sur: sur)
    model = tiny_mlp(DIM)
    sur = plugin.surrogate(
        model,
        gradest.RectifiedFlow(steps=3),
        smooth_terminal_objective(DIM),
        noise=seeded_normal((BATCH, DIM), 0),
    )
    assert check_surrogate(plugin, sur) is sur
