"""What every reader of a file the digits commands read back shares.

Each format has one reader, next to its writer: ``settings.json``
(:func:`gradest_digits.finetune_cli.read_settings`), a run's checkpoint
(:func:`gradest_digits.run_state.load_checkpoint`), its log
(:func:`gradest_digits.run_state.read_log`), ``result.json``
(:func:`gradest_digits.finetune_cli.read_result`) and a pretrained model's checkpoint
(:func:`gradest_digits.assets.read_model_checkpoint`). Each reader builds a ``refuse(field,
why)`` that names its file, so that every failure is one :class:`~gradest.errors.InvalidValue`
line naming the file and the field, and the file is never changed; the helpers here check
one field against it.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# The library's rules for describing a value and checking a field's kind, shared with the
# recipes' readers.
from gradest_lab.storage.file_schema import Refuse as Refuse
from gradest_lab.storage.file_schema import describe as describe

# Re-exported for the readers here: the library's rule for quoting an error in one line.
from gradest_lab.storage.file_schema import first_line as first_line
from gradest_lab.storage.file_schema import is_int as is_int
from gradest_lab.storage.file_schema import is_number as is_number
from gradest_lab.storage.file_schema import json_object as json_object
from gradest_lab.storage.file_schema import require as require
from gradest_lab.storage.file_schema import require_finite as require_finite
from torch import Tensor


def require_fields(data: Mapping[str, Any], names: Any, refuse: Refuse, where: str = "") -> None:
    """Each of ``names`` is a key of ``data``; the first missing one is refused."""
    for name in names:
        if name not in data:
            raise refuse(f"{where}{name}", "is missing")


def require_json(value: Any, refuse: Refuse, field: str) -> None:
    """``value`` is plain JSON data (what a log record or a setting must be)."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise refuse(field, f"is not JSON data ({first_line(err)})") from None


def load_torch_file(path: Path, refuse: Refuse, *, links: bool = False) -> Any:
    """The object in the torch file ``path``, loaded with ``weights_only=True`` on the CPU.

    A file that would run code when unpickled (a class's ``__reduce__``) is refused and its
    code never runs; so is something that is not a regular file, a file that does not load
    (empty, truncated, not a torch file), and unless ``links`` (a file of a run's folder
    is the run's own) a symbolic link: each one line from ``refuse``.
    """
    if path.is_symlink() and not links:
        raise refuse("the file", "is a symbolic link; a run reads only its own files")
    if path.exists() and not path.is_file():
        raise refuse("the file", "is not a regular file")
    try:
        with warnings.catch_warnings():
            # torch warns about a foreign pickle's protocol before refusing it: the
            # refusal says all there is to say.
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a damaged zip or a foreign pickle
        raise refuse("the file", f"does not load (format unreadable: {first_line(err)})") from None


def require_state_dict(
    saved: Any,
    reference: Mapping[str, Tensor],
    refuse: Refuse,
    field: str,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """``saved`` is a state dict that loads into the module whose state dict is
    ``reference``: the same names, each a tensor of the same shape, of ``dtype`` (None: the
    reference tensor's dtype)."""
    require(isinstance(saved, dict), refuse, field, saved, "a dict of tensors")
    missing = [name for name in reference if name not in saved]
    if missing:
        raise refuse(f"{field}[{missing[0]!r}]", "is missing (the model has it)")
    extra = [name for name in saved if name not in reference]
    if extra:
        raise refuse(f"{field}[{extra[0]!r}]", "is not a tensor of the model")
    for name, tensor in saved.items():
        want = reference[name]
        wanted_dtype = dtype or want.dtype
        wanted = f"a {str(wanted_dtype).removeprefix('torch.')} tensor {tuple(want.shape)}"
        fits = (
            isinstance(tensor, Tensor)
            and tensor.shape == want.shape
            and tensor.dtype == wanted_dtype
        )
        require(fits, refuse, f"{field}[{name!r}]", tensor, wanted)
