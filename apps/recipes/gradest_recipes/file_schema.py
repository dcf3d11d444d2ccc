"""What every reader of a file a recipe reads back shares.

Each format has one reader, shared by the code that reads it:

======================================  ==================================================
file                                    reader
======================================  ==================================================
``--config FILE`` (and ``config.toml``)  :func:`gradest_recipes.config.read_toml`
``recipe_state.json`` (a checkpoint's)   :func:`gradest_recipes.records.read_recipe_state`
``done.json``                            :func:`gradest_recipes.records.read_done`
``log.jsonl`` (a resumed run's)          :func:`gradest_recipes.records.read_log`
``lora_N.safetensors``                   :func:`gradest_recipes.checkpoints.read_lora_file`
accelerate's ``optimizer.bin``,          :func:`gradest_recipes.checkpoints.check_checkpoint_files`
``custom_checkpoint_N.pkl``,
``random_states_N.pkl``, ``scaler.pt``
prompt embeddings ``.pt``                :func:`gradest_recipes.embeddings.load_embeddings`
======================================  ==================================================

Each reader builds a ``refuse(field, why)`` that names its file, so that every failure is
one :class:`~gradest.errors.InvalidValue` line naming the file and the field (never a
``KeyError``, a torch, safetensors or tomllib traceback), and the file is never changed.
Torch files are read as bytes first (a FIFO or a device is refused, not waited on) and
loaded with ``weights_only=True``: a file that would run code when unpickled is refused
and its code never runs. The helpers here check one value against such a ``refuse``.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

# The library's rules for describing a value and checking a field's kind, shared with the
# digits' readers.
from gradest_lab.storage.file_schema import (
    Refuse,
    describe,
    is_int,
    is_number,
    json_object,
    with_article,
)
from torch import Tensor

__all__ = [
    "Refuse",
    "conform",
    "describe",
    "file_bytes",
    "first_line",
    "is_int",
    "is_number",
    "json_object",
    "load_torch_bytes",
]


def first_line(err: BaseException) -> str:
    """``err``'s message on one line (at most 200 characters), or its type's name."""
    text = " ".join(str(err).split())
    return (text or type(err).__name__)[:200]


def file_bytes(path: Path, refuse: Refuse) -> bytes:
    """The bytes of the regular file ``path`` (a link to one is followed): nothing there,
    a folder, a FIFO, a device or a file that cannot be read is one line from ``refuse``."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise refuse("the file", "is missing") from None
    except OSError as err:
        raise refuse("the file", f"cannot be looked at ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise refuse("the file", "is not a regular file")
    try:
        return path.read_bytes()
    except OSError as err:
        raise refuse("the file", f"cannot be read ({err.strerror})") from None


def _unpickling_detail(err: BaseException) -> str:
    """What torch's multi-paragraph weights-only refusal says is wrong, on one line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = [
        line
        for line in lines[1:]
        if not line.startswith(("Please file an issue", "Check the documentation"))
    ]
    return first_line(Exception(" ".join(detail) or (lines[0] if lines else "")))


def load_torch_bytes(data: bytes, refuse: Refuse, *, safe_globals: Iterable[Any] = ()) -> Any:
    """The object in a torch file's ``data``, loaded with ``weights_only=True`` on the CPU.

    ``safe_globals``: classes the file may hold beyond torch's own allowlist (accelerate's
    numpy types in its RNG states). A file that does not load (empty, truncated, not a
    torch file) or that holds other Python objects (a pickle whose ``__reduce__`` would run
    code) is one line from ``refuse``; its code never runs.
    """
    try:
        with warnings.catch_warnings():
            # torch warns about a foreign pickle's protocol before refusing it: the
            # refusal says all there is to say.
            warnings.simplefilter("ignore")
            with torch.serialization.safe_globals(list(safe_globals)):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise refuse(
            "the file",
            f"does not load as tensors and plain data ({_unpickling_detail(err)}); a file "
            f"that would run code when loaded is refused, its code never run",
        ) from None
    except Exception as err:  # torch raises many kinds for a damaged zip
        raise refuse("the file", f"does not load ({first_line(err)})") from None


def _kind(value: Any) -> str:
    if isinstance(value, Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return with_article(f"{dtype} tensor {tuple(value.shape)}")
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a dict"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    if value is None:
        return "None"
    return with_article(type(value).__name__)


def _join(field: str, key: Any) -> str:
    return f"{field}.{key}" if field else str(key)


def conform(value: Any, like: Any, refuse: Refuse, field: str) -> None:
    """``value`` (read from a file) has the structure of ``like`` (what this run's own
    object writes now): the same keys of every dict, the same length of every list, the
    same kind of every scalar (an int where a float is written is a number too), every
    tensor or array of the same shape and dtype, None where None is written. The first
    difference is one line from ``refuse`` naming its place (``param_groups[0].lr``; ``""``
    is the file's object itself)."""

    def fail() -> None:
        if not field:
            raise refuse("the file", f"holds {describe(value)}, not {_kind(like)}")
        raise refuse(field, f"is {describe(value)}, not {_kind(like)}")

    if isinstance(like, Tensor):
        if not isinstance(value, Tensor) or value.shape != like.shape or value.dtype != like.dtype:
            fail()
    elif like is None:
        if value is not None:
            fail()
    elif isinstance(like, bool):
        if not isinstance(value, bool):
            fail()
    elif isinstance(like, int):
        if not is_int(value):
            fail()
    elif isinstance(like, float):
        if not is_number(value):
            fail()
    elif isinstance(like, str):
        if not isinstance(value, str):
            fail()
    elif isinstance(like, Mapping):
        if not isinstance(value, Mapping):
            fail()
        for key in like:
            if key not in value:
                raise refuse(_join(field, key), "is missing")
        for key in value:
            if key not in like:
                raise refuse(_join(field, key), "is there, but this run's state has no such entry")
        for key, item in like.items():
            conform(value[key], item, refuse, _join(field, key))
    elif isinstance(like, list | tuple):
        if not isinstance(value, list | tuple) or len(value) != len(like):
            fail()
        for index, (item, expected) in enumerate(zip(value, like, strict=True)):
            conform(item, expected, refuse, f"{field}[{index}]")
    elif hasattr(like, "shape") and hasattr(like, "dtype"):  # a numpy array
        if not isinstance(value, type(like)) or (value.shape, value.dtype) != (
            like.shape,
            like.dtype,
        ):
            fail()
    elif not isinstance(value, type(like)):
        fail()
