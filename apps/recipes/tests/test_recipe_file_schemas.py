"""Every file a recipe reads back, damaged every way the tests can think of, is one line.

Property-style: for each format a real file the recipe wrote (a 2-step tiny SD3 run with
EMA: its checkpoint's ``recipe_state.json``, ``optimizer.bin``, ``custom_checkpoint_N.pkl``
(the lr schedule, the EMA), ``random_states_0.pkl`` and ``lora_0.safetensors``, the run's
``done.json``, ``log.jsonl`` and ``config.toml``; prompt embeddings written by
``PromptEmbeddings.to_file``) is damaged programmatically: emptied, truncated, made
something that is not an object, not UTF-8 (text formats), a pickle whose ``__reduce__``
runs a shell command (torch formats); and every field found in the file, at every depth,
removed in turn and replaced by a value of every other kind (tensors also by another
dtype and another shape, lists also one element shorter). The fields are walked, not
listed, so a field the writer gains later is damaged too.

Each variant goes through what a user runs: the recipe's ``--resume_from_checkpoint
latest`` (checkpoint files, ``done.json``, ``log.jsonl``), ``--config FILE`` (TOML) and
``load_embeddings`` (what the recipe calls with ``--embeddings``). The outcome is either
a refusal that is one line (a ``GradestError`` whose message has no newline: never a
``KeyError`` or a torch, safetensors or tomllib traceback) or the run going on as for an
intact file. A variant that breaks the format's schema (anything but a removed optional
field or a value the schema allows) must be refused, naming the file and the field. A
refused file keeps its bytes, and so does everything else in the run folder; the pickled
command never runs.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from gradest_lab.storage.run_folder import RUN_LOCK  # noqa: E402
from gradest_recipes.config import config_from_argv  # noqa: E402
from gradest_recipes.embeddings import load_embeddings, required_keys, tiny_embeddings  # noqa: E402
from gradest_recipes.records import DONE_FILE, LOG_FILE, STATE_FIELDS  # noqa: E402
from recipe_support import RECIPE_WARNINGS, reset_accelerate, script  # noqa: E402

from gradest.errors import GradestError  # noqa: E402

pytestmark = RECIPE_WARNINGS

CHECKPOINT = Path("checkpoints") / "step_000002"
#: One value of each kind a JSON or torch file holds (numbers are one kind).
KINDS: list[Any] = [None, True, 7, "x", ["x"], {"x": 1}]


def kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


class Evil:
    """A pickle that runs a shell command when it is loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@attrs.frozen
class Variant:
    """A damaged file: ``data`` its bytes; ``refused``: the schema forbids it (it must be
    refused naming the file and, when set, ``field``)."""

    label: str
    data: bytes
    refused: bool
    field: str | None = None


def nodes(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every ``(path, value)`` below ``value``: every string key of a dict (of a dict
    keyed by numbers, its first entry), every item of a list or tuple of mixed kinds, the
    first item of one of a single kind (a vector of words, a list of tensors)."""
    if isinstance(value, dict):
        keys = [k for k in value if isinstance(k, str)] or list(value)[:1]
        for key in keys:
            yield (*path, key), value[key]
            yield from nodes(value[key], (*path, key))
    elif isinstance(value, list | tuple) and value:
        mixed = len({kind(item) for item in value}) > 1
        for index in range(len(value) if mixed else 1):
            yield (*path, index), value[index]
            yield from nodes(value[index], (*path, index))


_REMOVED = object()


def _with(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """A copy of ``value`` with ``new`` at ``path`` (``_REMOVED``: the key taken out)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, tuple):
        items = list(value)
        items[head] = _with(items[head], rest, new)
        return tuple(items)
    out = copy.copy(value)
    if new is _REMOVED and not rest:
        del out[head]
    else:
        out[head] = _with(value[head], rest, new)
    return out


def field_name(path: tuple[Any, ...]) -> str | None:
    """The innermost named field of ``path`` (what a refusal must name)."""
    names = [str(part) for part in path if isinstance(part, str)]
    return names[-1] if names else None


def damaged(
    data: Any,
    *,
    required: Callable[[tuple[Any, ...]], bool],
    checked: Callable[[tuple[Any, ...]], bool],
    fixed_lengths: bool,
    depth: int | None = None,
) -> Iterator[tuple[str, Any, bool, str | None]]:
    """``(label, value, refused, field)`` for every field of ``data`` removed and replaced
    by a value of every other kind (tensors: also another dtype and shape; lists: also one
    item shorter). ``required(path)``: its removal must be refused; ``checked(path)``: a
    value of another kind must be refused; ``fixed_lengths``: a shorter list must be;
    ``depth``: the fields that many levels deep at most (None: all)."""
    for path, value in nodes(data):
        if depth is not None and len(path) > depth:
            continue
        name = field_name(path)
        where = ".".join(map(str, path))
        if isinstance(path[-1], str):
            yield f"{where} removed", _with(data, path, _REMOVED), required(path), name
        if isinstance(value, list | tuple) and value:
            shorter = _with(data, path, value[:-1])
            yield f"{where} one shorter", shorter, fixed_lengths and checked(path), name
        if value is None:
            continue  # a field that may be None may often be something else too
        others = [other for other in KINDS if kind(other) != kind(value)]
        if isinstance(value, torch.Tensor):
            other_dtype = torch.int64 if value.is_floating_point() else torch.float32
            others += [value.to(other_dtype), value.unsqueeze(-1)]
        for other in others:
            label = f"{where} = {describe(other)}"
            yield label, _with(data, path, other), checked(path), name


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return repr(value)


def torch_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def not_utf8(data: bytes) -> bytes:
    """``data`` with a Latin-1 byte in its first string."""
    at = data.index(b'"') + 1
    return data[:at] + b"\xe9" + data[at:]


def text_variants(data: bytes) -> list[Variant]:
    """A JSON file emptied, truncated, not an object, not UTF-8."""
    return [
        Variant("empty", b"", True),
        Variant("truncated", data[: len(data) // 2], True),
        Variant("a list", b"[1, 2]\n", True),
        Variant("null", b"null\n", True),
        Variant("a string", b'"x"\n', True),
        Variant("not UTF-8", not_utf8(data), True),
    ]


def torch_variants(data: bytes, marker: Path) -> list[Variant]:
    """A torch file emptied, truncated, not a dict, a pickle that runs a command."""
    return [
        Variant("empty", b"", True),
        Variant("truncated", data[: len(data) // 2], True),
        Variant("a list", torch_bytes([1, 2]), True),
        Variant("None", torch_bytes(None), True),
        Variant("a string", torch_bytes("x"), True),
        Variant("a pickle that runs a command", torch_bytes({"x": Evil(marker)}), True),
        Variant("a plain pickle that runs a command", pickle.dumps(Evil(marker)), True),
    ]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but the run's lock (which a claim rewrites)."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != RUN_LOCK
    }


def outcome(call: Callable[[], Any]) -> str | None:
    """None when ``call`` ran; the message of the one-line error it raised. Anything
    but a documented error propagates (a traceback fails the test)."""
    reset_accelerate()
    try:
        call()
    except GradestError as err:
        return str(err)
    finally:
        reset_accelerate()
    return None


def check(
    variants: list[Variant],
    *,
    name: str,
    marker: Path,
    place: Callable[[Variant], tuple[Path, Path]],
    run: Callable[[Path], Any],
) -> None:
    """Each variant through ``run(folder)``: ``place`` writes it and returns the folder
    to compare and the damaged file. Every failure is collected, then reported at once."""
    failures = []
    assert variants
    for variant in variants:
        folder, target = place(variant)
        before = snapshot(folder)
        try:
            message = outcome(lambda folder=folder: run(folder))
        except Exception as err:  # a traceback: what the schema is there to prevent
            failures.append(f"{variant.label}: raised {type(err).__name__}: {err}")
            shutil.rmtree(folder, ignore_errors=True)
            continue
        if marker.exists():
            failures.append(f"{variant.label}: the pickled command ran")
            marker.unlink()
        if message is None:
            if variant.refused:
                failures.append(f"{variant.label}: accepted")
            shutil.rmtree(folder, ignore_errors=True)
            continue
        if "\n" in message:
            failures.append(f"{variant.label}: not one line: {message!r}")
        if variant.refused and name not in message:
            failures.append(f"{variant.label}: does not name {name}: {message}")
        if variant.refused and variant.field and variant.field not in message:
            failures.append(f"{variant.label}: does not name {variant.field}: {message}")
        if target.exists() and target.read_bytes() != variant.data:
            failures.append(f"{variant.label}: the refused file was changed")
        changed = [k for k, v in snapshot(folder).items() if before.get(k) != v]
        changed += [k for k in before if not (folder / k).exists()]
        if changed:
            failures.append(f"{variant.label}: refused, but the folder changed: {changed}")
        shutil.rmtree(folder, ignore_errors=True)
    assert not failures, f"{len(failures)} of {len(variants)} variants:\n" + "\n".join(failures)


# -- the run whose files are damaged -------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A finished 2-step tiny SD3 run with EMA (lr schedule and EMA states checkpointed)."""
    reset_accelerate()
    out = tmp_path_factory.mktemp("pristine") / "run"
    main = script("sd3").main
    flags = ["--tiny", "--max_train_steps", "2", "--report_to", "none", "--use_ema"]
    assert main([*flags, "--output_dir", str(out)]) == 0
    reset_accelerate()
    return out


def resume(out: Path) -> None:
    script("sd3").main(["--resume_from_checkpoint", "latest", "--output_dir", str(out)])


def in_copy(pristine: Path, tmp_path: Path, relative: Path, *, keep_done: bool = False):
    """``place`` for ``check``: a copy of the run with the variant at ``relative``. Without
    ``done.json`` (unless ``keep_done``), so that an accepted variant finishes the export
    at step 2 (quick) instead of being refused for being done."""
    count = iter(range(10**6))

    def place(variant: Variant) -> tuple[Path, Path]:
        folder = tmp_path / f"variant{next(count)}"
        shutil.copytree(pristine, folder, symlinks=True)
        if not keep_done:
            (folder / DONE_FILE).unlink()
        (folder / relative).write_bytes(variant.data)
        return folder, folder / relative

    return place


def in_fresh_folder(tmp_path: Path, name: str):
    """``place`` for ``check``: a new folder holding only the variant, as ``name``."""
    count = iter(range(10**6))

    def place(variant: Variant) -> tuple[Path, Path]:
        folder = tmp_path / f"variant{next(count)}"
        folder.mkdir()
        (folder / name).write_bytes(variant.data)
        return folder, folder / name

    return place


def test_the_intact_run_resumes(pristine, tmp_path):
    """The baseline of the variants below: an intact copy without ``done.json`` resumes
    (it finishes its export at step 2); with it, it is done, and says so in one line."""
    place = in_copy(pristine, tmp_path, CHECKPOINT / "recipe_state.json")
    intact = (pristine / CHECKPOINT / "recipe_state.json").read_bytes()
    folder, _ = place(Variant("intact", intact, False))
    assert outcome(lambda: resume(folder)) is None
    assert (folder / DONE_FILE).read_bytes() == (pristine / DONE_FILE).read_bytes().replace(
        str(pristine).encode(), str(folder).encode()
    )
    message = outcome(lambda: resume(folder))
    assert message is not None and "already at step 2" in message and "\n" not in message


def test_recipe_state_json(pristine, tmp_path):
    """``recipe_state.json``: every field and every saved setting; a setting removed
    takes its default (an older checkpoint), which the run then accepts or refuses."""
    relative = CHECKPOINT / "recipe_state.json"
    original = (pristine / relative).read_bytes()
    state = json.loads(original)
    variants = text_variants(original)
    for label, value, refused, field in damaged(
        state,
        required=lambda path: len(path) == 1 and STATE_FIELDS[path[0]],
        checked=lambda path: True,
        fixed_lengths=False,
    ):
        variants.append(Variant(label, json.dumps(value).encode(), refused, field))
    check(
        variants,
        name="recipe_state.json",
        marker=tmp_path / "MARKER",
        place=in_copy(pristine, tmp_path, relative),
        run=resume,
    )


def test_done_json(pristine, tmp_path):
    relative = Path(DONE_FILE)
    original = (pristine / relative).read_bytes()
    variants = text_variants(original)
    for label, value, refused, field in damaged(
        json.loads(original),
        required=lambda path: True,
        checked=lambda path: True,
        fixed_lengths=False,
    ):
        variants.append(Variant(label, json.dumps(value).encode(), refused, field))
    check(
        variants,
        name=DONE_FILE,
        marker=tmp_path / "MARKER",
        place=in_copy(pristine, tmp_path, relative, keep_done=True),
        run=resume,
    )


def test_log_jsonl(pristine, tmp_path):
    """``log.jsonl``: a resumed run reads back each record's step (and keeps the rest as
    it is); a partial last line is a write that was cut, left out by design."""
    relative = Path(LOG_FILE)
    original = (pristine / relative).read_bytes()
    lines = original.splitlines(keepends=True)
    variants = [
        Variant("empty", b"", False),
        Variant("cut in its last line", original[:-10], False),
        Variant("a list line", b"[1, 2]\n" + original, True),
        Variant("a null line", b"null\n" + original, True),
        Variant("a string line", b'"x"\n' + original, True),
        Variant("not UTF-8", not_utf8(lines[0]) + b"".join(lines[1:]), True),
    ]
    first = json.loads(lines[0])
    for label, value, refused, field in damaged(
        first,
        required=lambda path: path[0] == "step",
        checked=lambda path: path[0] == "step",
        fixed_lengths=False,
    ):
        data = json.dumps(value).encode() + b"\n" + b"".join(lines[1:])
        variants.append(Variant(f"record 1: {label}", data, refused, field))
    check(
        variants,
        name=LOG_FILE,
        marker=tmp_path / "MARKER",
        place=in_copy(pristine, tmp_path, relative),
        run=resume,
    )


def _torch_file(name: str) -> Any:
    from accelerate.utils import other

    safe = getattr(other, "TORCH_SAFE_GLOBALS", ())  # numpy's RNG state
    with torch.serialization.safe_globals(list(safe)):
        return torch.load(name, map_location="cpu", weights_only=True)


@pytest.mark.parametrize(
    "name",
    ["optimizer.bin", "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "random_states_0.pkl"],
)
def test_accelerate_checkpoint_files(pristine, tmp_path, name):
    """accelerate's files of a checkpoint (the optimizer, the lr schedule, the EMA, the
    RNG states): each loaded with weights only and checked against the run's own objects;
    the pickled command never runs (accelerate itself loads the custom states with
    ``weights_only=False``)."""
    relative = CHECKPOINT / name
    marker = tmp_path / "MARKER"
    original = (pristine / relative).read_bytes()
    variants = torch_variants(original, marker)
    for label, value, refused, field in damaged(
        _torch_file(str(pristine / relative)),
        required=lambda path: True,
        checked=lambda path: True,
        fixed_lengths=True,
    ):
        variants.append(Variant(label, torch_bytes(value), refused, field))
    check(
        variants,
        name=name,
        marker=marker,
        place=in_copy(pristine, tmp_path, relative),
        run=resume,
    )
    assert not marker.exists()


@pytest.fixture(scope="module")
def with_auto(tmp_path_factory) -> Path:
    """A finished 2-step tiny SD3 run with ``auto`` (its schedule checkpointed)."""
    reset_accelerate()
    out = tmp_path_factory.mktemp("auto") / "run"
    main = script("sd3").main
    flags = ["--tiny", "--max_train_steps", "2", "--report_to", "none"]
    auto = ["--estimator", "auto:candidates=(exact,sdo),draws=2"]
    assert main([*flags, *auto, "--output_dir", str(out)]) == 0
    reset_accelerate()
    return out


def test_an_estimators_checkpointed_state(with_auto, tmp_path):
    """``auto``'s schedule (``custom_checkpoint_1.pkl`` after the lr schedule's): loaded
    with weights only, then checked by the estimator's own ``load_state_dict``, whatever it
    raises (a ``KeyError`` deep in a schedule included) one line naming the file. Its
    schema is the estimator's: the format and the configuration must match (its messages
    say so in its own words); the rest of what it accepts is its own business, so only
    the outcome's form is checked there."""
    relative = CHECKPOINT / "custom_checkpoint_1.pkl"
    marker = tmp_path / "MARKER"
    original = (with_auto / relative).read_bytes()
    variants = torch_variants(original, marker)
    own = {("format",), ("auto",)}
    for label, value, refused, _ in damaged(
        _torch_file(str(with_auto / relative)),
        required=lambda path: path in own,
        checked=lambda path: path in own,
        fixed_lengths=False,
        depth=3,
    ):
        variants.append(Variant(label, torch_bytes(value), refused))
    check(
        variants,
        name="custom_checkpoint_1.pkl",
        marker=marker,
        place=in_copy(with_auto, tmp_path, relative),
        run=resume,
    )
    assert not marker.exists()


def _safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()})


def test_lora_safetensors(pristine, tmp_path):
    """``lora_0.safetensors``: every tensor removed, of another dtype, of another shape;
    one more tensor; bytes that are no safetensors file."""
    from safetensors.torch import load

    relative = CHECKPOINT / "lora_0.safetensors"
    original = (pristine / relative).read_bytes()
    tensors = load(original)
    header = b"[1, 2]"
    variants = [
        Variant("empty", b"", True),
        Variant("truncated", original[: len(original) // 2], True),
        Variant("a header that is a list", struct.pack("<Q", len(header)) + header, True),
        Variant("a torch file", torch_bytes(tensors), True),
        Variant("one tensor more", _safetensors({**tensors, "lora_extra": torch.ones(2)}), True),
    ]
    for key, value in tensors.items():
        removed = {k: v for k, v in tensors.items() if k != key}
        variants.append(Variant(f"{key} removed", _safetensors(removed), True, key))
        for other in (value.to(torch.float64), value.unsqueeze(-1)):
            changed = {**tensors, key: other}
            variants.append(Variant(f"{key} = {describe(other)}", _safetensors(changed), True, key))
    check(
        variants,
        name="lora_0.safetensors",
        marker=tmp_path / "MARKER",
        place=in_copy(pristine, tmp_path, relative),
        run=resume,
    )


#: A TOML literal of each kind a setting's value can be written as.
TOML_KINDS = {"bool": "true", "number": "7", "str": '"x"', "list": '["x"]', "dict": "{ x = 1 }"}


def test_config_toml(pristine, tmp_path):
    """The saved ``config.toml`` given back with ``--config``: every setting removed (its
    default) and written as every other kind of value. A table is no setting's value and
    is always refused; a value its setting can be read as (a number for a float, a
    string for a list, split at commas) is accepted."""
    import tomllib

    original = (pristine / "config.toml").read_bytes()
    settings = tomllib.loads(original.decode())
    lines = original.decode().splitlines()
    variants = [
        Variant("empty", b"", False),
        Variant("truncated", original[: len(original) // 2], False),
        Variant("not UTF-8", b'variant = "\xe9"\n' + original, True),
        Variant("an array of tables", b"[[recipe]]\nlr = 1\n", True),
        Variant("not TOML", b"lr = [1\n", True),
    ]
    for index, line in enumerate(lines):
        key = line.partition("=")[0].strip()
        rest = lines[:index] + lines[index + 1 :]
        variants.append(Variant(f"{key} removed", "\n".join(rest).encode(), False, key))
        for name, literal in TOML_KINDS.items():
            if name == kind(settings[key]):
                continue
            text = "\n".join([*rest, f"{key} = {literal}"])
            variants.append(Variant(f"{key} = {literal}", text.encode(), name == "dict", key))
    check(
        variants,
        name="config.toml",
        marker=tmp_path / "MARKER",
        place=in_fresh_folder(tmp_path, "config.toml"),
        run=lambda folder: config_from_argv("sd3", ["--config", str(folder / "config.toml")]),
    )


@pytest.mark.parametrize("family", ["sd3", "flux", "sd_unet"])
def test_prompt_embeddings(tmp_path, family):
    """A prompt embeddings ``.pt`` file, loaded as the recipe loads ``--embeddings``: the
    tensors the family needs (with guidance) must be there, the others may be left out;
    every value of another kind, dtype or shape is refused."""
    marker = tmp_path / "MARKER"
    written = tmp_path / "written.pt"
    tiny_embeddings(family).to_file(written)
    original = written.read_bytes()
    needed = set(required_keys(family, guided=True))
    variants = torch_variants(original, marker)
    for label, value, refused, field in damaged(
        torch.load(written, weights_only=True),
        required=lambda path: path[0] in needed,
        checked=lambda path: True,
        fixed_lengths=True,
    ):
        variants.append(Variant(label, torch_bytes(value), refused, field))
    check(
        variants,
        name="prompts.pt",
        marker=marker,
        place=in_fresh_folder(tmp_path, "prompts.pt"),
        run=lambda folder: load_embeddings(folder / "prompts.pt", family, guided=True),
    )
    assert not marker.exists()


def test_done_json_of_an_earlier_step_finishes_the_export(pristine, tmp_path):
    """``done.json`` says which step's export finished: a run that continued past it and
    was stopped between its last checkpoint and that checkpoint's export (the record is
    still the earlier one's) finishes the export when resumed, not refused as done."""
    place = in_copy(pristine, tmp_path, Path(DONE_FILE), keep_done=True)
    earlier = json.loads((pristine / DONE_FILE).read_text())
    folder, done = place(Variant("step 1", json.dumps({**earlier, "step": 1}).encode(), False))
    assert outcome(lambda: resume(folder)) is None
    assert json.loads(done.read_text())["step"] == 2


def test_a_prompts_text_file_that_is_not_utf8(tmp_path):
    """``python -m gradest_recipes.prompts --prompts FILE``: the prompts file is read by
    gradest's rule for text read back, one line naming it."""
    from gradest_recipes.prompts import main

    latin = tmp_path / "prompts.txt"
    latin.write_bytes("a caf\xe9\n".encode("latin-1"))
    argv = ["--family", "sd3", "--pretrained", str(tmp_path), "--out", str(tmp_path / "p.pt")]
    message = outcome(lambda: main([*argv, "--prompts", str(latin)]))
    assert message is not None and "prompts.txt" in message and "UTF-8" in message
    assert "\n" not in message
    message = outcome(lambda: main([*argv, "--prompts", str(tmp_path)]))
    assert message is not None and "is a folder" in message and "\n" not in message
