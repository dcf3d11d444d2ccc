"""A meta-device measurement of a model with long runs of identical blocks, from short runs.

A diffusion transformer is mostly a stack of identical blocks (SD3 medium: 23 of its 24;
Flux: 19 double and 38 single blocks), and a CLIP reward model is too. On the meta device
a block's FLOPs, the bytes it saves and its transients depend on its structure and input
shapes only, so every number a call's measurement produces is, for a run of ``n``
identical blocks, ``a + b n``: the same block repeated adds the same amount each time.

:func:`measure_with_short_runs` measures the model with each long run cut to 1, 2 and 3
blocks (the other runs at 1), checks that every number grows by the same amount from 1 to
2 as from 2 to 3 and that nothing else (saved inputs, output shapes) changes, and
extrapolates to the full length. When a check fails, a run cannot be cut (the model
indexes its blocks, say), or cutting would not save time, it measures the whole model.
``lab/tests/test_repeated_blocks.py`` compares the two on tiny SD3 and Flux configs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import attrs
from torch import nn

__all__ = ["Measurement", "Run", "measure_with_short_runs", "repeated_runs"]

# Runs shorter than this are measured whole: three short measurements would cost more.
MIN_RUN = 4


@attrs.frozen
class Measurement:
    """What one measured call gives: numbers linear in a run's length (FLOPs, bytes) and
    a structure that must not depend on it (saved inputs, output shapes)."""

    numbers: tuple[int, ...]
    structure: tuple[Any, ...]  # hashable: compared across the cut measurements


@attrs.frozen(eq=False)
class Run:
    """``blocks[start:start + length]`` of a module list are identical."""

    blocks: nn.ModuleList
    start: int
    length: int


def _simple(value: object) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return tuple(_simple(v) for v in value)
    # Another object (an attention processor, a config): its kind, not its identity.
    return type(value).__qualname__


def fingerprint(module: nn.Module) -> Hashable:
    """What a module computes, up to its weights' values: every submodule's class, plain
    attributes, parameter and buffer shapes, dtypes and grad flags, and hooks."""
    parts = []
    for name, sub in module.named_modules():
        attributes = tuple(
            sorted((k, _simple(v)) for k, v in vars(sub).items() if not k.startswith("_"))
        )
        parameters = tuple(
            (n, tuple(p.shape), p.dtype, p.requires_grad)
            for n, p in sub.named_parameters(recurse=False)
        )
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in sub.named_buffers(recurse=False))
        hooks = tuple(
            len(getattr(sub, attr))
            for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
        )
        parts.append((name, type(sub).__qualname__, attributes, parameters, buffers, hooks))
    return tuple(parts)


def repeated_runs(model: nn.Module) -> list[Run]:
    """Each module list's longest run of identical consecutive blocks (``MIN_RUN`` or
    more), outermost only: a run inside another run's blocks is measured with them."""
    runs: list[Run] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        prints = [fingerprint(block) for block in module]
        best = (0, 0)
        start = 0
        for i in range(1, len(prints) + 1):
            if i == len(prints) or prints[i] != prints[start]:
                if i - start > best[1]:
                    best = (start, i - start)
                start = i
        if best[1] >= MIN_RUN:
            runs.append(Run(module, best[0], best[1]))
            inside |= {id(m) for block in module for m in block.modules()}
    return runs


@contextlib.contextmanager
def _cut(runs: Sequence[Run], lengths: Sequence[int]) -> Iterator[None]:
    """The module lists with each run cut to ``lengths`` blocks (restored on exit)."""
    kept = [list(run.blocks) for run in runs]
    try:
        for run, length, blocks in zip(runs, lengths, kept, strict=True):
            cut = blocks[: run.start + length] + blocks[run.start + run.length :]
            for _ in range(len(run.blocks)):
                del run.blocks[0]
            run.blocks.extend(cut)
        yield
    finally:
        for run, blocks in zip(runs, kept, strict=True):
            for _ in range(len(run.blocks)):
                del run.blocks[0]
            run.blocks.extend(blocks)


def measure_with_short_runs(model: nn.Module, measure: Callable[[], Measurement]) -> Measurement:
    """``measure()`` of ``model``, computed from its long runs cut short (see the module
    docstring); ``measure()`` on the whole model where that is not exact or not faster."""
    runs = repeated_runs(model)
    blocks = sum(run.length for run in runs)
    # Traces: 1 + 2 per run, each with every run at 1 to 3 blocks; a whole trace runs
    # every block once. Cut only where that is less work (SD3: 9 blocks traced for 23,
    # Flux 20 for 57; SDXL's seven runs of 10 are traced whole).
    if not runs or (1 + 2 * len(runs)) * (len(runs) + 2) >= blocks:
        return measure()
    try:
        with _cut(runs, [1] * len(runs)):
            base = measure()
        total = list(base.numbers)
        for i, run in enumerate(runs):
            grown = []
            for length in (2, 3):
                lengths = [1] * len(runs)
                lengths[i] = length
                with _cut(runs, lengths):
                    grown.append(measure())
            step = [b - a for a, b in zip(base.numbers, grown[0].numbers, strict=True)]
            again = [b - a for a, b in zip(grown[0].numbers, grown[1].numbers, strict=True)]
            same = {base.structure, grown[0].structure, grown[1].structure}
            if step != again or len(same) != 1:
                return measure()
            total = [t + s * (run.length - 1) for t, s in zip(total, step, strict=True)]
    except (IndexError, RuntimeError, ValueError, TypeError):
        # The model relies on its lists' lengths (it indexes them, or checks a count
        # against its config): measure it whole.
        return measure()
    return Measurement(tuple(total), base.structure)
