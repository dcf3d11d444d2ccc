"""What a surrogate loss was built with, and what changed in the model since.

``est.surrogate(...)`` records graphs (or, with ``exact:checkpoint=true``, inputs to
recompute from) of the model as it is during the call; its loss's backward evaluates them
later. A model changed in between makes that backward disagree with the model now: a
parameter replaced by a new ``nn.Parameter`` gets no gradient (the graph holds the old
one), or a recomputation uses the new one; a train/eval switch changes what a
recomputation computes (dropout; torch then raises its own ``CheckpointError``); an
in-place update (``optimizer.step()``) mixes old cotangents with new weights. So the
surrogate fingerprints the model (:meth:`ModelState.of`) and its loss's backward compares
the model with it first (:meth:`RecordedState.check`), raising
:class:`~gradest.errors.SurrogateOutdated` naming what changed.

The fingerprint is every module's object and ``training`` flag and every parameter and
buffer slot's tensor object and version counter (``Tensor._version``, which every in-place
write bumps): host attributes only, no device work and no host sync; one walk over the
modules per ``surrogate()`` call at each end, and one at the start of the backward.

What the model's own forwards change is not the caller's doing: a buffer the forward
updates (a call counter), buffers DDP broadcasts at every forward, the parameters FSDP2
swaps in for a forward. Slots that changed *during* the ``surrogate()`` call are left out
of the check (their next forward, or the backward, moves them again anyway). FSDP2's
managed parameters are fingerprinted by their sharded parameter, the one its optimizer
updates and the one it registers on the module whenever it is not unsharded, so its
swaps between sharded and unsharded tensors never count as a replacement while an
optimizer step on the shards still does.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from torch import nn

from gradest.errors import SurrogateOutdated

# (kind, qualified name): kind "module" (value: the module object and its training flag),
# "parameter" or "buffer" (value: the tensor object, or None, and its version counter).
Key = tuple[str, str]
Entry = tuple[Any, Any]

# At most this many changes are spelled out in the message (then "and N more").
_SHOWN = 3


def fsdp_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` if its module was imported, else None: no model can be
    ``fully_shard``-ed before that, and importing it here (or in :mod:`gradest.ranks`,
    which asks the same) would cost every call, and ``import gradest`` FSDP's few dozen
    modules."""
    for name in ("torch.distributed.fsdp._fully_shard._fully_shard", "torch.distributed.fsdp"):
        cls = getattr(sys.modules.get(name), "FSDPModule", None)
        if isinstance(cls, type):
            return cls
    return None


def _fsdp_slots(module: nn.Module) -> Iterator[tuple[tuple[int, str], Any]]:
    """``((id(owner), name), sharded parameter)`` for every slot FSDP2 manages under the
    ``fully_shard``-ed ``module`` (private torch API: nothing if its layout changed, and
    the model's slots are then fingerprinted as registered)."""
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                owners = [(info.module, info.param_name)]
                owners += list(zip(info.shared_modules, info.shared_param_names, strict=True))
                for owner, name in owners:
                    yield (id(owner), name), fsdp_param.sharded_param
    except (AssertionError, AttributeError, TypeError, ValueError):
        return


def _describe_mode(training: bool) -> str:
    return "train" if training else "eval"


@attrs.frozen(eq=False)
class ModelState:
    """A fingerprint of a model's modules, parameters and buffers (see the module doc).

    Attributes:
        signature: flat, in a depth-first walk (parents before their children, children in
            registration order, a submodule under two names visited under both): per module
            ``id(module), training, len(parameters), (name, id(tensor), version) per
            parameter, the same for buffers, len(children), (their names)``. Two states of
            a model are the same iff their signatures are equal (plain ``list ==``: ints,
            strings and bools, no tensor comparison).
        objects: the modules and tensors whose ids the signature holds, kept alive with it
            (so that an id cannot be reused by another object meanwhile), in walk order.
    """

    signature: list[Any]
    objects: list[Any]

    @classmethod
    def of(cls, model: nn.Module) -> ModelState:
        """The fingerprint of ``model`` now: one walk over its modules' own slots, host
        attributes only (no names built: :meth:`entries` spells them out when needed)."""
        signature: list[Any] = []
        objects: list[Any] = []
        # Bound methods and tuples extended at once: the walk runs three times per call.
        mark, extend, keep = signature.append, signature.extend, objects.append
        fsdp_module = fsdp_module_class()
        managed: dict[tuple[int, str], Any] = {}
        pending = [model]
        while pending:
            module = pending.pop()
            keep(module)
            if fsdp_module is not None and isinstance(module, fsdp_module):
                managed.update(_fsdp_slots(module))
            parameters = module._parameters
            extend((id(module), module.training, len(parameters)))
            tensor: Any
            for name, tensor in parameters.items():
                if managed:
                    tensor = managed.get((id(module), name), tensor)
                extend((name, id(tensor), None if tensor is None else tensor._version))
                keep(tensor)
            buffers = module._buffers
            mark(len(buffers))
            for name, tensor in buffers.items():
                extend((name, id(tensor), None if tensor is None else tensor._version))
                keep(tensor)
            children = module._modules
            if not children:
                mark(0)
                continue
            kids: list[Any] = list(children.values())
            if None in kids:
                # A slot registered as None holds no module (named_modules skips it too).
                names = tuple(name for name, child in children.items() if child is not None)
                kids = [child for child in kids if child is not None]
            else:
                names = tuple(children)
            mark(len(names))
            if names:
                mark(names)
                kids.reverse()
                pending.extend(kids)
        return cls(signature, objects)

    def same_as(self, other: ModelState) -> bool:
        """Whether nothing differs (the fast path: one comparison of two flat lists)."""
        return self.signature == other.signature

    def entries(self) -> dict[Key, Entry]:
        """``(kind, qualified name) -> (object, version or training flag)``, in walk order;
        kind ``"module"`` (the module and its ``training`` flag), ``"parameter"`` or
        ``"buffer"`` (the tensor or None, and its version counter). Names are those of
        ``named_modules`` / ``named_parameters`` / ``named_buffers``."""
        out: dict[Key, Entry] = {}
        signature, objects = iter(self.signature), iter(self.objects)
        prefixes = [""]  # the names of the modules still to decode, the next one last
        while prefixes:
            prefix = prefixes.pop()
            next(signature)  # the module's id
            training = next(signature)
            out[("module", prefix)] = (next(objects), training)
            dot = f"{prefix}." if prefix else ""
            for kind in ("parameter", "buffer"):
                for _ in range(next(signature)):
                    name = next(signature)
                    next(signature)  # the tensor's id
                    version = next(signature)
                    out[(kind, dot + name)] = (next(objects), version)
            if next(signature):
                prefixes.extend(dot + name for name in reversed(next(signature)))
        return out


def _differing(before: Mapping[Key, Entry], after: Mapping[Key, Entry]) -> set[Key]:
    """The keys whose entry differs (present in one only, another object, another version
    or flag)."""
    keys = set(before.keys() ^ after.keys())
    for key, (obj, mark) in before.items():
        now = after.get(key)
        if now is not None and (now[0] is not obj or now[1] != mark):
            keys.add(key)
    return keys


def _name(kind: str, name: str) -> str:
    if kind == "module":
        return "the model" if not name else f"module {name!r}"
    return f"{kind} {name!r}"


@attrs.frozen(eq=False)
class RecordedState:
    """The state a surrogate was built with, checked when its loss's backward starts.

    Attributes:
        end: the fingerprint when the ``surrogate()`` call ended.
        entries: ``end``'s entries less the slots the call's own forwards changed, or None
            when they changed nothing (the usual case: then the check is one comparison).
        exempt: those slots (neither checked nor reported as added).
    """

    end: ModelState
    entries: Mapping[Key, Entry] | None
    exempt: frozenset[Key]

    @classmethod
    def between(cls, start: ModelState, end: ModelState) -> RecordedState:
        """What a ``surrogate()`` call that began at ``start`` and ended at ``end`` recorded."""
        if start.same_as(end):
            return cls(end, None, frozenset())
        ended = end.entries()
        exempt = frozenset(_differing(start.entries(), ended))
        return cls(end, {k: e for k, e in ended.items() if k not in exempt}, exempt)

    def changes(self, now: ModelState) -> list[str]:
        """What differs in ``now`` from the recorded state, one phrase per change, in
        ``named_modules`` order; changes inside a replaced submodule, and train/eval
        switches of submodules that switched with their parent, are folded into it."""
        if now.same_as(self.end):
            return []
        recorded = self.end.entries() if self.entries is None else self.entries
        current_entries = now.entries()
        changes: list[str] = []
        # Qualified-name prefixes of replaced submodules and of modules that switched mode
        # (with the new flag): what lies under them is said by their phrase.
        replaced: list[str] = []
        switched: list[tuple[str, bool, int]] = []

        def under(name: str, prefix: str) -> bool:
            return not prefix or name.startswith(prefix + ".")

        for key, (obj, mark) in recorded.items():
            kind, name = key
            if any(under(name, prefix) for prefix in replaced):
                continue
            current = current_entries.get(key)
            if current is None:
                changes.append(f"{_name(kind, name)} was removed")
                if kind == "module":
                    replaced.append(name)
                continue
            if current[0] is not obj:
                what = "set to None" if current[0] is None else "replaced"
                changes.append(f"{_name(kind, name)} was {what}")
                if kind == "module":
                    replaced.append(name)
            elif kind == "module" and current[1] != mark:
                folded = next(
                    (
                        index
                        for prefix, flag, index in switched
                        if flag == current[1] and under(name, prefix)
                    ),
                    None,
                )
                if folded is not None:
                    if not changes[folded].endswith("(with its submodules)"):
                        changes[folded] += " (with its submodules)"
                    continue
                changes.append(
                    f"{_name(kind, name)} switched {_describe_mode(mark)} -> "
                    f"{_describe_mode(current[1])}"
                )
                switched.append((name, current[1], len(changes) - 1))
            elif current[1] != mark:
                changes.append(
                    f"{_name(kind, name)} was modified in place"
                    + (" (an optimizer.step()?)" if kind == "parameter" else "")
                )
        for key, (obj, _) in current_entries.items():
            kind, name = key
            if key in recorded or key in self.exempt or obj is None:
                continue
            if any(under(name, prefix) for prefix in replaced):
                continue
            changes.append(f"{_name(kind, name)} was added")
            if kind == "module":
                replaced.append(name)
        return changes

    def check(self, now: ModelState, estimator: str) -> None:
        """Raise :class:`~gradest.errors.SurrogateOutdated` if ``now`` differs."""
        changes = self.changes(now)
        if not changes:
            return
        shown = ", ".join(changes[:_SHOWN])
        more = f" and {len(changes) - _SHOWN} more" if len(changes) > _SHOWN else ""
        raise SurrogateOutdated(
            f"the model changed between surrogate() and the backward of its loss (estimator "
            f"{estimator}): {shown}{more}; the backward would not be the gradient of the "
            f"model that was sampled; call est.surrogate(...) again after changing the model "
            f"(after optimizer.step(), load_state_dict, .eval()/.train()), or change the "
            f"model after backward()"
        )
