"""Conditioning (``cond``): keyword arguments of ``model(z, t, **cond)``, per sample or shared.

Estimators stack ``M`` states of a batch of ``B`` into one model call on ``M*B`` rows (sdo's
samples, jagg's nodes, a stepwise objective's steps, draft_lv's copies, auto's probes);
every per-sample conditioning tensor must then be repeated ``M`` times, and everything
else passed as it is. One rule decides, for every leaf at any depth:

* A ``cond`` value may nest dicts (any mapping), lists and tuples (named tuples too) to
  any depth, as diffusers' SDXL UNet takes ``added_cond_kwargs={"text_embeds": [B, D],
  "time_ids": [B, 6]}``. Containers are rebuilt with their own type, and only where a
  leaf inside them changes.
* A tensor leaf whose first dimension is ``B`` is per sample (class labels ``[B]``, text
  embeddings ``[B, S, D]``) and is repeated.
* Every other leaf is shared by all rows and passed untouched: scalars, 0-dim tensors,
  tensors of another length (a ``[1, D]`` row broadcasts), None, strings, other objects.

A shared tensor that happens to have ``B`` rows (a ``[B, D]`` lookup table, Flux's
position ids when there are ``B`` text tokens) is ambiguous; wrap it in
:class:`SharedCondition`, at any depth, and it is never repeated (nor looked into)::

    est.surrogate(model, sampler, objective, noise=noise,
                  cond={"y": labels, "table": gradest.SharedCondition(table)})

:func:`check_cond` applies the rule at the boundary, before any model call, and refuses
in one line naming the path (``cond['extra'].ids``) what it cannot honour: keys that are
not strings, and a per-sample tensor inside a value the rule does not take apart (a set,
an attrs or dataclass instance), which would reach a stacked call unrepeated (exact
works, ``sdo:samples=2`` fails deep inside the model). Every place that repeats, moves or
inspects ``cond`` goes through :func:`map_leaves`, the one walk over it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest.errors import InvalidType, InvalidValue


@attrs.frozen(eq=False)
class SharedCondition:
    """Marks a ``cond`` value as shared by every sample: passed to the model unrepeated.

    Attributes:
        value: what the model receives.
    """

    value: Any


# A leaf's place in ``cond``: the keys and indices from the top (formatted only for errors).
Path = tuple[Any, ...]


def format_path(path: Path, root: str = "cond") -> str:
    """``("added_cond_kwargs", "time_ids") -> "cond['added_cond_kwargs']['time_ids']"``."""
    return root + "".join(step.text if isinstance(step, _Step) else f"[{step!r}]" for step in path)


@attrs.frozen
class _Step:
    """A path step that is not a key or an index: an attrs / dataclass field (``.name``),
    a set's element."""

    text: str


def map_leaves(value: Any, leaf: Callable[[Any, Path], Any], path: Path = ()) -> Any:
    """``value`` with every leaf replaced by ``leaf(leaf_value, path)``.

    Descends into mappings, lists and tuples; everything else is a leaf, including
    tensors and :class:`SharedCondition` (``leaf`` decides what it means). A container is
    rebuilt only where a leaf in it changed (``leaf`` returned another object), with its
    own type: unchanged containers, and every untouched leaf, are the caller's objects.
    """
    if isinstance(value, Mapping):
        items = {key: map_leaves(child, leaf, (*path, key)) for key, child in value.items()}
        if all(items[key] is child for key, child in value.items()):
            return value
        return _rebuilt_mapping(value, items)
    if isinstance(value, list | tuple):
        children = [map_leaves(child, leaf, (*path, i)) for i, child in enumerate(value)]
        if all(new is old for new, old in zip(children, value, strict=True)):
            return value
        return _rebuilt_sequence(value, children)
    return leaf(value, path)


def _rebuilt_mapping(value: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    if type(value) is dict:
        return items
    if isinstance(value, dict):
        # OrderedDict, defaultdict (its default_factory), diffusers' BaseOutput: a copy
        # keeps the type and whatever else the instance carries.
        rebuilt = copy.copy(value)
        rebuilt.update(items)
        return rebuilt
    # Another mapping (a read-only view): the model reads it by key, as a dict.
    return items


def _rebuilt_sequence(value: list[Any] | tuple[Any, ...], children: list[Any]) -> Any:
    if type(value) is list:
        return children
    if type(value) is tuple:
        return tuple(children)
    if isinstance(value, tuple):
        if hasattr(value, "_make"):  # a named tuple: fields by position
            return type(value)._make(children)
        return type(value)(children)
    rebuilt = copy.copy(value)
    rebuilt[:] = children
    return rebuilt


def is_per_sample(value: Any, batch_size: int) -> bool:
    """The rule for one leaf: a tensor whose first dimension is the batch."""
    return isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == batch_size


def repeat_per_sample(value: Any, batch_size: int, copies: int) -> Any:
    """``value`` (a ``cond`` value or all of ``cond``) for ``copies`` stacked batches of
    ``batch_size``: every per-sample tensor leaf repeated ``copies`` times along its first
    dimension (``[v; v; ...]``, the stacking order of the states), :class:`SharedCondition`
    unwrapped, everything else untouched."""

    def leaf(v: Any, _: Path) -> Any:
        if isinstance(v, SharedCondition):
            return v.value
        if copies > 1 and is_per_sample(v, batch_size):
            # [v; v; ...] along the first dimension: one cat, several times cheaper per
            # call than Tensor.repeat on the small tensors conditioning holds.
            return torch.cat([v] * copies)
        return v

    return map_leaves(value, leaf)


def model_kwargs(cond: Mapping[str, Any], batch_size: int, copies: int = 1) -> dict[str, Any]:
    """``cond`` as the model's keyword arguments for ``copies`` stacked states of ``batch_size``
    (:func:`repeat_per_sample`; a fresh dict, the caller's ``cond`` is never changed)."""
    return dict(repeat_per_sample(cond, batch_size, copies))


def map_tensors(value: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor leaf, those inside a
    :class:`SharedCondition` too (kept wrapped): moving ``cond`` to a device or dtype."""

    def leaf(v: Any, _: Path) -> Any:
        if isinstance(v, SharedCondition):
            inner = map_tensors(v.value, fn)
            return v if inner is v.value else SharedCondition(inner)
        return fn(v) if isinstance(v, Tensor) else v

    return map_leaves(value, leaf)


def tensor_leaves(value: Any) -> list[Tensor]:
    """Every tensor leaf of ``value`` in walk order (the model's inputs, for tracing);
    :func:`with_tensor_leaves` puts replacements back in the same order."""
    found: list[Tensor] = []

    def leaf(v: Any, _: Path) -> Any:
        if isinstance(v, Tensor):
            found.append(v)
        return v

    map_leaves(value, leaf)
    return found


def with_tensor_leaves(value: Any, tensors: list[Tensor]) -> Any:
    """``value`` with its tensor leaves replaced, in :func:`tensor_leaves`' order."""
    replacements = iter(tensors)
    out = map_leaves(value, lambda v, _: next(replacements) if isinstance(v, Tensor) else v)
    assert next(replacements, None) is None, "more tensors than tensor leaves"
    return out


def suspect_leaves(cond: Mapping[str, Any], batch_size: int, device: torch.device) -> list[str]:
    """Phrases naming the tensor leaves of ``cond`` that may be why a model call failed:
    those passed unrepeated (not a per-sample leaf) though their first dimension is
    neither the batch nor 1, and those on another device than the state. Only a hint for
    an error message: a leaf shared on purpose may have any first dimension."""
    found: list[str] = []

    def leaf(v: Any, path: Path) -> Any:
        if not isinstance(v, Tensor) or v.ndim == 0:
            return v
        where = format_path(path)
        if v.shape[0] not in (batch_size, 1):
            found.append(
                f"{where} has {v.shape[0]} rows (shape {tuple(v.shape)}) where the batch has "
                f"{batch_size}: a per-sample tensor needs {batch_size} rows (a tensor shared by "
                f"every sample can be wrapped in gradest.SharedCondition)"
            )
        if v.device != device:
            found.append(
                f"{where} is on {v.device}, the state on {device}: pass it .to('{device}')"
            )
        return v

    map_leaves(cond, leaf)
    return found


def check_cond(cond: Any, batch_size: int) -> dict[str, Any]:
    """``cond`` checked against the rule for a batch of ``batch_size`` (see the module
    docstring), as a dict; raises :class:`~gradest.errors.InvalidType` /
    :class:`~gradest.errors.InvalidValue` in one line naming the path and the fix."""
    if cond is None:
        return {}
    if not isinstance(cond, Mapping):
        raise InvalidType(
            f"cond must be a dict of keyword arguments for model(z, t, **cond), "
            f"got {type(cond).__name__}; e.g. cond={{'y': labels}}"
        )
    for key in cond:
        if not isinstance(key, str):
            raise InvalidType(
                f"cond's keys are the model's keyword arguments and must be strings, got "
                f"{key!r} ({type(key).__name__}); e.g. cond={{'y': labels}}"
            )

    def leaf(v: Any, path: Path) -> Any:
        if not isinstance(v, SharedCondition):
            for inner, inner_path in _opaque_children(v, path):
                _refuse_per_sample_inside(inner, inner_path, v, path, batch_size)
        return v

    map_leaves(cond, leaf)
    return dict(cond)


def _opaque_children(value: Any, path: Path) -> Iterator[tuple[Any, Path]]:
    """The parts of a value the rule does not take apart (the walk cannot rebuild it
    with repeated tensors): a set's elements, a deque's, an attrs or dataclass
    instance's fields. Other objects are not looked into (they are shared)."""
    if isinstance(value, set | frozenset):
        for element in value:
            yield element, (*path, _ELEMENT)
    elif isinstance(value, collections.deque):
        for i, element in enumerate(value):
            yield element, (*path, i)
    elif attrs.has(type(value)):
        for field in attrs.fields(type(value)):
            yield getattr(value, field.name), (*path, _Step("." + field.name))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield getattr(value, field.name), (*path, _Step("." + field.name))


# A set's element has no key or index: ``cond['ids']{...}``.
_ELEMENT = _Step("{...}")


def _refuse_per_sample_inside(
    value: Any, path: Path, holder: Any, holder_path: Path, batch_size: int
) -> None:
    def leaf(v: Any, p: Path) -> Any:
        if isinstance(v, SharedCondition):
            return v
        if is_per_sample(v, batch_size):
            where = format_path(holder_path)
            what = f"an element of {where}" if p == (*holder_path, _ELEMENT) else format_path(p)
            raise InvalidValue(
                f"{what} is a per-sample tensor of shape {tuple(v.shape)} (its "
                f"first dimension is the batch, {batch_size}) inside {where}, a "
                f"{type(holder).__name__}, which gradest does not take apart, so a call "
                f"that stacks several steps would get it unrepeated; pass {where} as a "
                f"dict, list or tuple, or wrap it in gradest.SharedCondition(...) if it "
                f"is the same for every sample"
            )
        for inner, inner_path in _opaque_children(v, p):
            map_leaves(inner, leaf, inner_path)
        return v

    map_leaves(value, leaf, path)
