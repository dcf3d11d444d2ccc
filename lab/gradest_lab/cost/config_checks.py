"""Model configs read from JSON (a reward model's, a VAE's), checked field by field by
principle before any model is built from them.

``gradest cost --reward`` / ``--decoder`` and the recipes' learned rewards
(``apps/recipes/gradest_recipes/learned_rewards.py``, which import this module: the
recipes depend on the lab) build transformers and diffusers models from configs a user
may have written. Those libraries take a negative or zero size without a word (a
reward model with ``num_hidden_layers=0`` has no layers and is priced or trained as
such) or fail deep inside torch with a traceback. :func:`check_config` refuses such a
config first, in one line naming the config, the field's dotted path, its value and the
fix.

The rules, by principle rather than by listing fields:

* **sizes and counts**: a field whose name says it is a size or a count (its last word
  is a size noun, :data:`SIZE_WORDS`: ``hidden_size``, ``projection_dim``,
  ``num_hidden_layers``, ``max_position_embeddings``, ``block_out_channels``,
  ``norm_num_groups``, ``text_tokens``, ``width``...; or it starts with ``num_``; or it
  counts per something, ``layers_per_block``) must be a whole number (not a boolean, a
  fraction or a string) >= 1, or a list of them. A name led by a verb is a switch, not a
  size (``tie_word_embeddings``). :data:`ZERO_ALLOWED` are the few sizes where 0 means
  "off" (transformers' generation defaults, written into every config it saved), and
  :data:`NOT_SIZES` the names that only look like counts (``pruned_heads``).
* **nested configs** (``vision``, ``text_config``, ``vision_cfg``...: any JSON object) are
  checked the same way, their fields named by dotted paths (``vision.hidden_size``,
  ``block_out_channels[1]``).
* **architectures and types** the caller knows: ``choices`` (``kind``, ``model_type``:
  the names the code supports) and ``types`` (``logit_scale`` a boolean, ``vision`` an
  object), each by dotted path.
* **null** is refused where a size belongs, unless ``nulls=True``: transformers writes
  an unset optional size as ``null`` (``cross_attention_hidden_size``), and the library
  then gives it its default or refuses it (:func:`library_config_errors`).

Each layer raises its own error type (``error``): :class:`gradest.InvalidValue` in the lab,
as :func:`gradest_lab.cost.diffusers_presets.checked_config` does for the transformer's
config (the command line prints it in one line and exits with status 2), the recipes'
``RecipeConfigError`` in the recipes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from typing import Any

from gradest import GradestError, InvalidValue

__all__ = [
    "NOT_SIZES",
    "SIZE_WORDS",
    "ZERO_ALLOWED",
    "check_config",
    "is_size_field",
    "library_config_errors",
]

#: The last word of a field that holds a size or a count (``hidden_size``, ``embed_dim``,
#: ``num_hidden_layers``, ``max_position_embeddings``, ``block_out_channels``,
#: ``norm_num_groups``, ``text_tokens``, open_clip's ``width`` / ``layers`` / ``heads``).
SIZE_WORDS = frozenset(
    {
        "size",
        "dim",
        "dims",
        "layers",
        "heads",
        "channels",
        "groups",
        "embeddings",
        "tokens",
        "width",
        "length",
        "depth",
    }
)
#: Sizes where 0 is meaningful (it switches something off): transformers' generation
#: settings, which every config transformers 4 saved carries with these values.
ZERO_ALLOWED = frozenset({"min_length", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size"})
#: Fields named like a count that hold something else: transformers' ``pruned_heads`` (a
#: JSON object: the heads pruned in each layer).
NOT_SIZES = frozenset({"pruned_heads"})
# A name led by one of these verbs is a switch, whatever its last word (tie_word_embeddings,
# use_post_quant_conv, is_decoder, add_cross_attention, output_hidden_states).
_SWITCH_VERBS = frozenset({"is", "use", "tie", "do", "add", "output", "return", "force"})
_INT64_MAX = 2**63 - 1  # the largest integer torch holds

# How messages name a JSON value's type, and what ``types`` may ask for.
_TYPE_WORDS: dict[type, str] = {
    dict: "a JSON object",
    list: "a list",
    bool: "true or false",
    str: "a string",
    float: "a number",
    int: "a whole number",
}


def is_size_field(name: str) -> bool:
    """Whether the field ``name`` (its last path part) holds a size or a count, by its
    words (module docstring)."""
    words = name.lower().split("_")
    if words[0] in _SWITCH_VERBS or name.lower() in NOT_SIZES:
        return False
    if words[0] == "num" and len(words) > 1:
        return True
    counted = name.lower().split("_per_")[0].split("_")  # layers_per_block counts layers
    return counted[-1] in SIZE_WORDS or words[-1] in SIZE_WORDS


def library_config_errors() -> tuple[type[Exception], ...]:
    """The errors transformers and diffusers raise for a config they refuse: ``TypeError``
    and ``ValueError``, and huggingface_hub's strict-dataclass errors (transformers 5
    validates its configs with them; they derive from neither). Callers turn these into
    their one line."""
    errors: list[type[Exception]] = [TypeError, ValueError]
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # huggingface_hub too old to have them, or absent
        pass
    else:
        errors.append(StrictDataclassError)
    return tuple(errors)


def _shown(value: Any) -> str:
    """``value`` as the config file spells it (JSON)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _what(value: Any) -> str:
    """The kind of a JSON value, in words (``a string``, ``a fraction``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a fraction" if math.isfinite(value) and not value.is_integer() else "a float"
    if isinstance(value, Mapping):
        return "a JSON object"
    for kind, word in _TYPE_WORDS.items():
        if isinstance(value, kind):
            return word
    return type(value).__name__


def _fits(value: Any, expected: type | tuple[type, ...]) -> bool:
    """Whether ``value`` has the ``types`` entry's type: a boolean is no number, a number
    (``float``) is any finite int or float, an object any mapping."""
    for kind in expected if isinstance(expected, tuple) else (expected,):
        if kind is bool and isinstance(value, bool):
            return True
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return math.isfinite(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind is dict and isinstance(value, Mapping):
            return True
        if kind not in (bool, float, int, dict) and isinstance(value, kind):
            return True
    return False


def _size_problem(value: Any, minimum: int, *, nulls: bool) -> str | None:
    """Why ``value`` is no size (a whole number >= ``minimum``), or None if it is one."""
    if value is None:
        return None if nulls else "is null (unset)"
    if isinstance(value, bool) or not isinstance(value, int):
        return f"is {_what(value)}, not a whole number"
    if value < minimum:
        return f"is below {minimum}"
    if value > _INT64_MAX:
        return "is larger than 2**63 - 1 (the largest integer torch holds)"
    return None


def check_config(
    config: Any,
    *,
    where: str,
    choices: Mapping[str, Collection[str]] | None = None,
    types: Mapping[str, type | tuple[type, ...]] | None = None,
    nulls: bool = False,
    error: type[GradestError] = InvalidValue,
) -> None:
    """Refuse a model config whose fields cannot build the model (module docstring).

    Args:
        config: the config as JSON gives it (a JSON object, its nested objects as dicts).
        where: how the message names the config: the option and the file
            (``--reward 'reward.json'``).
        choices: ``{dotted path: the names the code supports}`` (``{"kind": ...}``), for
            the fields that name an architecture; a field the config leaves out is not
            checked here.
        types: ``{dotted path: type}`` for fields the code reads with a type of its own
            (``dict`` an object, ``bool`` true / false, ``float`` any finite number,
            ``str``, ``list``); a field left out is not checked.
        nulls: ``null`` is accepted as an unset size (the library's default).
        error: the error to raise (the caller's layer's :class:`gradest.InvalidValue`).

    Raises:
        error: one line naming ``where``, the field's dotted path, its value and the fix.
    """
    if not isinstance(config, Mapping):
        raise error(
            f"{where} must hold a JSON object (a model config), got {_what(config)} "
            f'{_shown(config)}; write the config as {{"field": value, ...}}'
        )
    _check_object(config, "", where, choices or {}, types or {}, nulls, error)


def _check_object(
    config: Mapping[str, Any],
    prefix: str,
    where: str,
    choices: Mapping[str, Collection[str]],
    types: Mapping[str, type | tuple[type, ...]],
    nulls: bool,
    error: type[GradestError],
) -> None:
    for key, value in config.items():
        path = f"{prefix}{key}"
        field = f"{where}: field {path}={_shown(value)}"
        if path in choices:
            if not isinstance(value, str) or value not in choices[path]:
                raise error(
                    f"{field} is not one this code supports; set {key} to one of "
                    f"{', '.join(sorted(choices[path]))} in the config"
                )
            continue
        if path in types and not _fits(value, types[path]):
            expected = types[path]
            words = " or ".join(
                _TYPE_WORDS.get(kind, kind.__name__)
                for kind in (expected if isinstance(expected, tuple) else (expected,))
            )
            raise error(f"{field} is {_what(value)}; {key} must be {words}: fix it in the config")
        _check_value(value, path, str(key), field, where, choices, types, nulls, error)


def _check_value(
    value: Any,
    path: str,
    key: str,
    field: str,
    where: str,
    choices: Mapping[str, Collection[str]],
    types: Mapping[str, type | tuple[type, ...]],
    nulls: bool,
    error: type[GradestError],
) -> None:
    sized = is_size_field(key)
    if isinstance(value, Mapping) and not sized:  # a nested config (vision, text_config)
        _check_object(value, f"{path}.", where, choices, types, nulls, error)
        return
    if isinstance(value, list):  # per-block sizes (block_out_channels), lists of configs
        for index, item in enumerate(value):
            item_path = f"{path}[{index}]"
            if isinstance(item, Mapping):
                _check_object(item, f"{item_path}.", where, choices, types, nulls, error)
            elif sized:
                _check_size(item, key, f"{where}: field {item_path}={_shown(item)}", nulls, error)
        return
    if sized:
        _check_size(value, key, field, nulls, error)


def _check_size(value: Any, key: str, field: str, nulls: bool, error: type[GradestError]) -> None:
    minimum = 0 if key.lower() in ZERO_ALLOWED else 1
    problem = _size_problem(value, minimum, nulls=nulls)
    if problem is not None:
        raise error(
            f"{field} {problem}; {key} is a size or a count: set it to a whole number "
            f">= {minimum} in the config"
        )
