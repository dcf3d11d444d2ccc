"""Every file the digits commands read back has a schema: a damaged one is one line.

For each format a real file is written by the code (a tiny ``gradest finetune`` run, the
shipped checkpoints), then damaged in every way the test can derive from the file itself:
empty, truncated, not an object (a list, null, a string, a number), a malicious pickle
(whose ``__reduce__`` would create a marker file), and for each of its fields (found by
walking the file, not listed here) the field removed and the field replaced by a value
of each other type. Each damaged file goes through the command a user runs (``gradest
finetune --resume DIR``, ``--config FILE``, a new run loading the shipped checkpoints,
``python -m gradest_digits.mnist_pretrain``), which must answer with exit status 2 and one
line naming the file (a :class:`~gradest.errors.InvalidValue` without a newline, never a
traceback); the folder keeps every byte and the marker never appears.

A field the format declares optional (a checkpoint's ``draw_generators``, a DiT option
with a default, a collection's item) may be removed: then the command either refuses it
the same way or goes on as with the file it was.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from digits_support import snapshot
from gradest_digits import assets
from gradest_digits.finetune_cli import RUN_SETTINGS, read_result
from gradest_digits.run_state import (
    ADDED_SETTINGS,
    NULLABLE_FIELDS,
    OPTIONAL_FIELDS,
    checkpoints_in,
    is_optimizer_flag,
)
from torch import Tensor

import gradest.cli
from gradest.cli import main
from gradest.errors import GradestError, InvalidType, InvalidValue
from gradest.models.dit import DiTConfig

# A tiny run with non-default settings (the micro DiT: tiny_digits_assets).
RUN = (
    "--estimator sdo:samples=2 --batch-size 3 --sampler-steps 2 --target 2 --lr 0.01 "
    "--max-grad-norm 1.0 --seed 3 --checkpoint-every 1 --quiet --no-tensorboard --steps 2"
).split()
# A new run on the shipped checkpoints, as cheap as a run gets.
REAL_RUN = "--steps 1 --batch-size 2 --sampler-steps 1 --quiet --no-tensorboard".split()

# A value of each type a file can hold (JSON's, and a torch file's tensors below).
VALUES: tuple[Any, ...] = (None, True, "text", 7, 2.5, [1], {"a": 1})
REMOVE = object()


class Payload:
    """A pickle whose loading would run a command (creating ``marker``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch '{self.marker}'",))


# -- damaged copies, derived from the file ------------------------------------------------


def same_kind(value: Any, other: Any) -> bool:
    """Whether ``other`` is of ``value``'s type (an int stands for a float: JSON and TOML
    write ``1.0`` as ``1`` when a person types it)."""
    if isinstance(value, bool) or isinstance(other, bool):
        return isinstance(value, bool) and isinstance(other, bool)
    if isinstance(value, float) and isinstance(other, int):
        return True
    return type(value) is type(other)


def other_values(value: Any) -> list[Any]:
    """Values of every other type than ``value``'s; for a tensor, also one of another
    shape and one of another kind of number."""
    found = [other for other in VALUES if not same_kind(value, other)]
    if isinstance(value, Tensor):
        bigger = torch.zeros([size + 1 for size in value.shape] or [2], dtype=value.dtype)
        # Of another kind of number (float32 and float64 may both be right: a scalar
        # state written under another default dtype).
        other_dtype = torch.int64 if value.is_floating_point() else torch.float32
        found += [bigger, value.to(other_dtype)]
    return found


def is_record(node: Any) -> bool:
    """A dict of named fields (not a collection of items: a state dict's tensors, an
    optimizer's per-parameter states)."""
    return (
        isinstance(node, dict)
        and all(isinstance(key, str) for key in node)
        and not all(isinstance(value, Tensor) for value in node.values())
    )


def nodes(node: Any, path: tuple = (), depth: int = 3, free_form=()) -> Iterator[tuple]:
    """``(path, value)`` of every field of ``node`` to ``depth`` levels: each field of a
    record, the first item of a collection (a list, a state dict: its items are alike)."""
    if depth == 0:
        return
    if isinstance(node, dict):
        keys = list(node) if is_record(node) else list(node)[:1]
    elif isinstance(node, list | tuple):
        keys = [0] if node else []
    else:
        return
    for key in keys:
        yield path + (key,), node[key]
        if key not in free_form:
            yield from nodes(node[key], path + (key,), depth - 1, free_form)


def changed(node: Any, path: tuple, new: Any) -> Any:
    """``node`` with the value at ``path`` replaced by ``new`` (removed for ``REMOVE``);
    ``node`` itself is not changed."""
    key, rest = path[0], path[1:]
    items: Any = dict(node) if isinstance(node, dict) else list(node)
    if not rest and new is REMOVE:
        del items[key]
    else:
        items[key] = new if not rest else changed(node[key], rest, new)
    return tuple(items) if isinstance(node, tuple) else items


def field_damage(
    data: Any,
    *,
    optional: Callable[[tuple], bool],
    free_form=(),
    depth: int = 3,
    allowed: Callable[[tuple, Any], bool] = lambda path, value: False,
    below: int = 0,
) -> Iterator[tuple[str, Any, bool]]:
    """``(what, damaged data, strict)`` for every field of ``data``: removed (``strict``:
    it must be refused, unless ``optional(path)`` or an item of a collection) and replaced
    by a value of each other type (refused, unless the format ``allowed(path, value)`` it:
    None where a field may be null). Only fields more than ``below`` levels deep."""
    for path, value in nodes(data, depth=depth, free_form=free_form):
        if len(path) <= below:
            continue
        shown = ".".join(map(str, path))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        required = is_record(parent) and not optional(path)
        yield f"{shown} removed", changed(data, path, REMOVE), required
        for other in other_values(value):
            strict = not allowed(path, other)
            yield f"{shown} = {type(other).__name__}", changed(data, path, other), strict


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def byte_damage(good: bytes, marker: Path, *, torch_file: bool) -> Iterator[tuple[str, bytes]]:
    """The file's bytes damaged whole: empty, truncated, not an object, a foreign pickle."""
    yield "empty", b""
    yield "truncated", good[: len(good) // 2]
    yield "pickle", pickle.dumps(Payload(marker))
    if torch_file:
        yield "torch pickle", torch_bytes(Payload(marker))
        for other in ([1], None, "text", 7):
            yield f"a {type(other).__name__}", torch_bytes(other)
    else:
        for other in ([1], None, "text", 7):
            yield f"a {type(other).__name__}", json.dumps(other).encode()


def json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


# -- the commands --------------------------------------------------------------------------


@pytest.fixture
def errors(monkeypatch) -> list[BaseException]:
    """The errors ``gradest`` printed as one line (to check their type and text)."""
    seen: list[BaseException] = []
    one_line = gradest.cli._one_line

    def recording(err: BaseException) -> str:
        seen.append(err)
        return one_line(err)

    monkeypatch.setattr(gradest.cli, "_one_line", recording)
    return seen


class Checker:
    """Runs a command on each damaged copy of one file and checks the answer."""

    def __init__(self, capsys, errors, marker: Path, kinds=(InvalidValue,)):
        self.capsys, self.errors, self.marker, self.kinds = capsys, errors, marker, kinds
        self.counts = {"refused": 0, "accepted": 0}

    def check(
        self,
        what: str,
        target: Path,
        damaged: bytes,
        command: Callable[[], int],
        *,
        strict: bool,
        folder: Path,
        restore: Callable[[], None],
    ) -> None:
        original = target.read_bytes()
        target.write_bytes(damaged)
        before = snapshot(folder)
        self.errors.clear()
        code = command()
        err = self.capsys.readouterr().err
        label = f"{target.name}: {what}"
        assert not self.marker.exists(), f"{label}: the pickle's code ran"
        assert "Traceback" not in err, f"{label}: {err}"
        if code == 0 and not strict:
            self.counts["accepted"] += 1
            restore()
            return
        assert code == 2, f"{label}: exit {code}, {err}"
        lines = err.strip().splitlines()
        assert len(lines) == 1, f"{label}: {err}"
        assert str(target) in lines[0], f"{label}: the file is not named: {lines[0]}"
        assert self.errors, f"{label}: not one of gradest's errors: {err}"
        for error in self.errors:
            assert isinstance(error, self.kinds), f"{label}: {type(error).__name__}: {error}"
            assert "\n" not in str(error), f"{label}: {error!r}"
        assert snapshot(folder) == before, f"{label}: the folder changed"
        self.counts["refused"] += 1
        target.write_bytes(original)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A finished 2-step run of the micro DiT, checkpointed at both steps."""
    from digits_support import LinearClassifierReward, tiny_dit

    folder = tmp_path_factory.mktemp("pristine") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(assets, "load_pretrained_dit", lambda device="cpu": tiny_dit().to(device))
        patch.setattr(assets, "load_digit_classifier", lambda device="cpu": "classifier")
        from gradest_digits import rewards

        patch.setattr(rewards, "ClassifierReward", lambda c, target: LinearClassifierReward(target))
        assert main(["finetune", *RUN, "--out", str(folder)]) == 0
    return folder


@pytest.fixture
def run_copy(tmp_path, pristine) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A copy of the run, and how to restore it after a command accepted a file."""
    folder = tmp_path / "run"

    def restore() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(pristine, folder, symlinks=True)

    restore()
    yield folder, restore


def resume(folder: Path, *extra: str) -> Callable[[], int]:
    return lambda: main(["finetune", "--resume", str(folder), *extra])


def check_all(checker, target, good, fields, command, folder, restore, *, torch_file):
    for what, damaged in byte_damage(good, checker.marker, torch_file=torch_file):
        checker.check(what, target, damaged, command, strict=True, folder=folder, restore=restore)
    encode = torch_bytes if torch_file else json_bytes
    for what, data, strict in fields:
        checker.check(
            what, target, encode(data), command, strict=strict, folder=folder, restore=restore
        )
    assert checker.counts["refused"] > 10


# -- the run folder's files, through gradest finetune --resume -----------------------------


@pytest.mark.usefixtures("tiny_digits_assets")
def test_a_damaged_settings_file_is_one_line_naming_it(tmp_path, capsys, errors, run_copy):
    folder, restore = run_copy
    target = folder / "settings.json"
    data = json.loads(target.read_text())
    assert set(data["settings"]) == set(RUN_SETTINGS)
    checker = Checker(capsys, errors, tmp_path / "MARKER")
    fields = field_damage(data, optional=lambda path: False)
    check_all(
        checker,
        target,
        target.read_bytes(),
        fields,
        resume(folder),
        folder,
        restore,
        torch_file=False,
    )
    assert checker.counts["accepted"] == 0


@pytest.mark.usefixtures("tiny_digits_assets")
@pytest.mark.parametrize("with_settings", [True, False], ids=["beside_settings", "alone"])
def test_a_damaged_run_record_is_one_line_naming_it(
    tmp_path, capsys, errors, run_copy, with_settings
):
    folder, restore = run_copy
    if not with_settings:  # a run stopped before it wrote settings.json: run.json is read
        (folder / "settings.json").unlink()

        def restore_without() -> None:
            restore()
            (folder / "settings.json").unlink()

    target = folder / "run.json"
    data = json.loads(target.read_text())
    checker = Checker(capsys, errors, tmp_path / "MARKER")
    fields = field_damage(data, optional=lambda path: False)
    command = resume(folder) if with_settings else resume(folder, "--steps", "2")
    check_all(
        checker,
        target,
        target.read_bytes(),
        fields,
        command,
        folder,
        restore if with_settings else restore_without,
        torch_file=False,
    )
    assert checker.counts["accepted"] == 0


def is_flag_path(path: tuple) -> bool:
    return path[:2] == ("optimizer", "param_groups") and len(path) == 4


def checkpoint_optional(state: dict) -> Callable[[tuple], bool]:
    """The fields a checkpoint may lack: those of older versions of the format, settings
    added since, and an optimizer's flags (torch gives a missing one its default)."""
    fields = {(name,) for name in OPTIONAL_FIELDS} | {("config", name) for name in ADDED_SETTINGS}

    def optional(path: tuple) -> bool:
        if is_flag_path(path):
            return is_optimizer_flag(state["optimizer"]["param_groups"][path[2]][path[3]])
        return path in fields

    return optional


def checkpoint_allowed(state: dict) -> Callable[[tuple, Any], bool]:
    """The values another type may take: None for a nullable field, any flag for a flag."""

    def allowed(path: tuple, value: Any) -> bool:
        if is_flag_path(path):
            flag = state["optimizer"]["param_groups"][path[2]][path[3]]
            return is_optimizer_flag(flag) and is_optimizer_flag(value)
        return value is None and path in {(name,) for name in NULLABLE_FIELDS}

    return allowed


@pytest.mark.usefixtures("tiny_digits_assets")
@pytest.mark.parametrize(
    "levels", [(0, 2), pytest.param((2, 4), marks=pytest.mark.slow)], ids=["fields", "deeper"]
)
def test_a_damaged_checkpoint_is_one_line_naming_it(tmp_path, capsys, errors, run_copy, levels):
    """The fields and their parts (``fields``: a setting of its config, a tensor of its
    model), and the parts of those (``deeper``: an optimizer's hyperparameter, a log
    record's cost in its history)."""
    folder, restore = run_copy
    (_, target), *_ = checkpoints_in(folder / "checkpoints")
    state = torch.load(target, weights_only=True)
    assert {"model", "optimizer", "generators", "history", "config"} <= set(state)
    checker = Checker(capsys, errors, tmp_path / "MARKER")
    below, depth = levels
    fields = list(
        field_damage(
            state,
            optional=checkpoint_optional(state),
            allowed=checkpoint_allowed(state),
            free_form=("estimator_state",),
            depth=depth,
            below=below,
        )
    )
    if not below:  # a field of foreign code inside a well-formed checkpoint
        fields += [
            (f"{name} = pickle", changed(state, (name,), Payload(checker.marker)), True)
            for name in state
        ]
        check_all(
            checker,
            target,
            target.read_bytes(),
            fields,
            resume(folder),
            folder,
            restore,
            torch_file=True,
        )
    else:
        for what, data, strict in fields:
            checker.check(
                what,
                target,
                torch_bytes(data),
                resume(folder),
                strict=strict,
                folder=folder,
                restore=restore,
            )
        assert checker.counts["refused"] > 100


@pytest.mark.usefixtures("tiny_digits_assets")
def test_a_damaged_log_is_one_line_naming_it(tmp_path, capsys, errors, run_copy):
    folder, restore = run_copy
    target = folder / "log.jsonl"
    good = target.read_bytes()
    records = [json.loads(line) for line in good.decode().splitlines()]
    checker = Checker(capsys, errors, tmp_path / "MARKER")
    for what, damaged in byte_damage(good, checker.marker, torch_file=False):
        # A partial last line is the trace of a killed writer: the log reads without it
        # (an empty log: a branch's, that starts at the checkpoint).
        strict = what not in ("empty", "truncated")
        checker.check(
            what, target, damaged, resume(folder), strict=strict, folder=folder, restore=restore
        )
    for what, record, strict in field_damage(records[0], optional=lambda path: False):
        lines = [json.dumps(record), *map(json.dumps, records[1:])]
        checker.check(
            f"record 1: {what}",
            target,
            ("\n".join(lines) + "\n").encode(),
            resume(folder),
            strict=strict,
            folder=folder,
            restore=restore,
        )
    assert checker.counts["refused"] > 10


@pytest.mark.usefixtures("tiny_digits_assets")
def test_a_damaged_config_file_is_one_line_naming_it(tmp_path, capsys, errors, run_copy):
    """``--config FILE`` with the run's own settings, then each one removed (the run's is
    taken: not an error) or of another TOML type (refused by name)."""
    folder, restore = run_copy
    settings = json.loads((folder / "settings.json").read_text())["settings"]
    target = tmp_path / "run.toml"

    def toml(table: dict[str, Any]) -> bytes:
        lines = []
        for key, value in table.items():
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, dict):
                text = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }"
            else:
                text = json.dumps(value)
            lines.append(f"{key} = {text}")
        return ("\n".join(lines) + "\n").encode()

    target.write_bytes(toml(settings))
    command = lambda: main(["finetune", "--config", str(target), "--resume", str(folder)])  # noqa: E731
    assert command() == 0, capsys.readouterr().err  # the run's own settings: it resumes
    restore()
    checker = Checker(capsys, errors, tmp_path / "MARKER", kinds=(InvalidValue, InvalidType))
    good = target.read_bytes()
    for what, damaged in byte_damage(good, checker.marker, torch_file=False):
        strict = what not in ("empty", "truncated")  # an empty file gives no settings
        checker.check(
            what, target, damaged, command, strict=strict, folder=tmp_path, restore=restore
        )
    checker.check(
        "not UTF-8",
        target,
        good + b"# \xff\n",
        command,
        strict=True,
        folder=tmp_path,
        restore=restore,
    )
    checker.check(
        "not TOML",
        target,
        good + b"steps = = 2\n",
        command,
        strict=True,
        folder=tmp_path,
        restore=restore,
    )
    present = {key: value for key, value in settings.items() if value is not None}
    # TOML has no null: a value of each other type but None.
    for what, table, _ in field_damage(present, optional=lambda path: True, depth=1):
        if any(value is None for value in table.values()):
            continue
        removed = "removed" in what  # the flag takes the run's value: it resumes
        checker.check(
            what, target, toml(table), command, strict=not removed, folder=tmp_path, restore=restore
        )
    assert checker.counts["accepted"] >= len(present)


def test_a_damaged_result_file_is_one_line_naming_it(tmp_path, pristine):
    """``result.json`` is read back by the RL-objectives benchmark, through
    :func:`read_result`: every damage is one line naming it (its ``config`` is the run's
    record, carried along and never read back)."""
    good = (pristine / "result.json").read_bytes()
    data = json.loads(good)
    target = tmp_path / "result.json"
    target.write_bytes(good)
    assert read_result(target).checkpoints == data["checkpoints"]
    marker = tmp_path / "MARKER"
    cases = [(what, damaged, True) for what, damaged in byte_damage(good, marker, torch_file=False)]
    for what, damaged_data, strict in field_damage(
        data, optional=lambda path: False, free_form=("config",)
    ):
        cases.append((what, json_bytes(damaged_data), strict))
    refused = 0
    for what, damaged, strict in cases:
        target.write_bytes(damaged)
        try:
            read_result(target)
        except InvalidValue as err:
            message = str(err)
            assert str(target) in message and "\n" not in message, (what, message)
            refused += 1
        else:
            assert not strict, f"{what}: accepted"
        assert target.read_bytes() == damaged
    assert not marker.exists() and refused > 20


# -- the shipped checkpoints, through a new gradest finetune -------------------------------


def dit_optional(path: tuple) -> bool:
    defaults = {f.name for f in attrs.fields(DiTConfig) if f.default is not attrs.NOTHING}
    return len(path) == 2 and path[0] == "config" and path[1] in defaults


@pytest.mark.parametrize("name", [assets.DIT_CHECKPOINT, assets.CLASSIFIER_CHECKPOINT])
def test_a_damaged_shipped_checkpoint_is_one_line_naming_it(
    tmp_path, capsys, errors, monkeypatch, name
):
    shipped = assets.asset_path(name)
    if not shipped.is_file():
        pytest.skip(f"shipped checkpoint {name} missing")
    store = tmp_path / "assets"
    store.mkdir()
    for other in (assets.DIT_CHECKPOINT, assets.CLASSIFIER_CHECKPOINT):
        shutil.copy(assets.asset_path(other), store / other)
    monkeypatch.setattr(assets, "asset_path", lambda file: store / file)
    target, out = store / name, tmp_path / "out"

    def command() -> int:
        return main(["finetune", *REAL_RUN, "--out", str(out)])

    def restore() -> None:
        shutil.rmtree(out, ignore_errors=True)

    state = torch.load(target, weights_only=True)
    checker = Checker(capsys, errors, tmp_path / "MARKER")
    fields = field_damage(state, optional=dit_optional, free_form=("info",))
    check_all(
        checker, target, target.read_bytes(), fields, command, store, restore, torch_file=True
    )
    assert not out.exists()  # a refused new run leaves nothing behind


def test_a_damaged_mnist_classifier_is_one_line_naming_it(tmp_path, capsys):
    """``python -m gradest_digits.mnist_pretrain --what dit`` reads the classifier in
    ``--out-dir`` back (the MNIST DiT goes through the same reader: next test)."""
    from gradest_digits import mnist_pretrain

    name = assets.MNIST_CLASSIFIER_CHECKPOINT
    if not assets.asset_path(name).is_file():
        pytest.skip(f"shipped checkpoint {name} missing")
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / name
    shutil.copy(assets.asset_path(name), target)
    good = target.read_bytes()
    state = torch.load(target, weights_only=True)
    marker = tmp_path / "MARKER"
    argv = ["--what", "dit", "--out-dir", str(folder), "--dit-steps", "1", "--quiet"]
    cases = list(byte_damage(good, marker, torch_file=True))
    for what, data, strict in field_damage(state, optional=lambda path: False, free_form=("info",)):
        if strict:
            cases.append((what, torch_bytes(data)))

    def files() -> dict[str, bytes]:  # the lock the command holds beside its output is its own
        return {k: v for k, v in snapshot(folder).items() if not k.endswith(".lock")}

    for what, damaged in cases:
        target.write_bytes(damaged)
        before = files()
        assert mnist_pretrain.main(argv) == 2, what
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, (what, err)
        assert str(target) in lines[0], (what, lines[0])
        assert files() == before and not marker.exists(), what
    assert len(cases) > 20


def test_a_damaged_mnist_dit_is_one_line_naming_it(tmp_path):
    name = assets.MNIST_DIT_CHECKPOINT
    if not assets.asset_path(name).is_file():
        pytest.skip(f"shipped checkpoint {name} missing")
    target = tmp_path / name
    shutil.copy(assets.asset_path(name), target)
    good = target.read_bytes()
    state = torch.load(target, weights_only=True)
    marker = tmp_path / "MARKER"
    cases = list(byte_damage(good, marker, torch_file=True))
    for what, data, strict in field_damage(state, optional=dit_optional, free_form=("info",)):
        if strict:
            cases.append((what, torch_bytes(data)))
    for what, damaged in cases:
        target.write_bytes(damaged)
        with pytest.raises(GradestError) as info:
            assets.build_model(assets.read_asset(name, tmp_path))
        message = str(info.value)
        assert isinstance(info.value, InvalidValue), (what, message)
        assert str(target) in message and "\n" not in message, (what, message)
        assert target.read_bytes() == damaged and not marker.exists(), what
