"""Every call of the velocity model, in one place: the module as itself, or functionally.

Three concerns of a model call live here and nowhere else:

* **Locking** (:mod:`gradest.model_lock`): calls of the module as itself hold the
  model's lock shared (they only read its attributes); a ``functional_call`` swaps
  tensors into the module, so it holds the lock exclusively, and puts back any slot
  torch restored wrongly (a submodule registered under two names).
* **torch.compile guards**: a state that is a view at a storage offset is copied before
  a compiled module sees it (Dynamo guards the offset and would recompile for every
  step), and a ``functional_call`` forward, always under a ``torch.func`` transform that
  compiled code cannot run in, runs the compiled code eagerly.
* **``functional_call``** itself: the explicit parameter dict of the func engine, the
  frozen parameters and buffers beside it, and the one-line error for a model whose
  saved-tensor hooks (layer checkpointing) torch.func refuses.

The conditioning rule (:mod:`gradest.conditioning`) is applied here too: a call on ``M``
stacked states of batch ``B`` gets the per-sample ``cond`` tensors repeated ``M`` times.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from gradest.conditioning import model_kwargs
from gradest.errors import InvalidValue
from gradest.mixed_dtypes import first_call
from gradest.model_lock import (
    compiled_code_eager,
    has_compiled_code,
    has_shared_submodules,
    lock_for,
    tensors_restored,
)
from gradest.vjp.gradients import Grads

Call = Callable[[Tensor, Tensor], Tensor]


def unwrap_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (``model`` otherwise)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def _saved_tensor_hooks_error(err: RuntimeError) -> bool:
    return "saved tensor hooks" in str(err).lower()


def _without_kwargs(call: Call, z: Tensor, t: Tensor, **_: Any) -> Tensor:
    """``call(z, t)`` for :func:`~gradest.mixed_dtypes.first_call`, which passes ``cond``
    as keyword arguments (the call binds its own)."""
    return call(z, t)


class ModelCalls:
    """The velocity model's calls for one estimate, on stacked rows ``[M*B, ...]``.

    Args:
        model: the model as given (a ``DistributedDataParallel`` wrapper stays one: the
            surrogate's parameter terms go through it, so its reducer sees them).
        cond: the model's keyword arguments for one state (validated).
        batch_size: ``B``.
        modules: ``list(model.modules())`` if the caller has it (one walk per estimate).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cond: Mapping[str, Any],
        batch_size: int,
        modules: list[torch.nn.Module] | None = None,
    ):
        self.model = model
        # DDP's reducer must see only the forwards whose parameter gradient autograd will
        # compute (the surrogate's terms); everything else goes to the module inside.
        self.module = unwrap_data_parallel(model)
        self.lock = lock_for(self.module)
        self.cond = dict(cond)
        self.batch_size = batch_size
        #: ``self.module.modules()``: from ``modules`` (the model's, listed by the caller)
        #: unless a DDP wrapper stands in front of the module.
        self.modules = (
            modules if modules is not None and self.module is model else list(self.module.modules())
        )
        self._compiled = has_compiled_code(self.module, self.modules)
        # The keyword arguments of a one-state call, the call every chain step makes: the
        # same dict each time (nothing is repeated for one state, and ``**`` copies it).
        self._one_state = model_kwargs(self.cond, batch_size)
        self._names: dict[str, str] = {}
        self._frozen: Grads = {}
        self._shared_submodules = False

    def kwargs(self, rows: int) -> dict[str, Any]:
        """``cond`` for a call on ``rows`` stacked rows (the conditioning rule)."""
        copies = rows // self.batch_size
        if copies == 1:
            return self._one_state
        return model_kwargs(self.cond, self.batch_size, copies)

    # -- the module as itself -------------------------------------------------------------

    def as_itself(self, z: Tensor, t: Tensor) -> Tensor:
        """The module (inside any DDP wrapper) called as itself."""
        return self._call(self.module, z, t)

    def through_wrapper(self, z: Tensor, t: Tensor) -> Tensor:
        """The model as given (through a DDP wrapper): the surrogate's parameter terms."""
        return self._call(self.model, z, t)

    def _call(self, module: torch.nn.Module, z: Tensor, t: Tensor) -> Tensor:
        cond = self.kwargs(z.shape[0])
        if self._compiled and z.storage_offset():
            # States are views into the stacked path; torch.compile guards a view's
            # storage offset (0 apart from the others) and would recompile for it,
            # running into its recompile limit (then eager, for good).
            z = z.clone()
        with self.lock.shared():
            return module(z, t, **cond)

    # -- functionally ---------------------------------------------------------------------

    def prepare_functional(self, trainable: Mapping[str, Tensor]) -> None:
        """Read what :meth:`functional` needs beside the differentiated parameters (under
        the lock, shared, held by the caller): the module's own names of the trainable
        parameters, and its frozen parameters and buffers."""
        module_params = {id(p): n for n, p in self.module.named_parameters()}
        self._names = {n: module_params[id(p)] for n, p in trainable.items()}
        self._frozen = {
            n: p.detach() for n, p in self.module.named_parameters() if not p.requires_grad
        }
        self._frozen.update(dict(self.module.named_buffers()))
        self._shared_submodules = has_shared_submodules(self.module)

    def functional(self, params: Grads, z: Tensor, t: Tensor) -> Tensor:
        """``functional_call`` of the module with ``params`` for its trainable parameters
        (after :meth:`prepare_functional`)."""
        named = {self._names[n]: p for n, p in params.items()}
        cond = self.kwargs(z.shape[0])
        restored = tensors_restored(self.module) if self._shared_submodules else nullcontext()
        # Always under a torch.func transform, which torch.compile'd code cannot run in:
        # eager here, compiled everywhere else (gradest.model_lock). ~10us a call, so only
        # for models that hold a compiled module.
        eager = compiled_code_eager() if self._compiled else nullcontext()
        try:
            with self.lock.exclusive(), restored, eager:
                return functional_call(self.module, (named, self._frozen), (z, t), cond)
        except RuntimeError as err:
            if _saved_tensor_hooks_error(err):
                raise InvalidValue(
                    "engine='func' cannot differentiate this model: torch.func refuses the "
                    "saved-tensor hooks of torch.utils.checkpoint / gradient checkpointing "
                    "inside it; use engine='autograd' (the default) or est.surrogate(...)"
                ) from err
            raise

    def bound(self, params: Grads | None, *, through_wrapper: bool = False) -> Call:
        """``(z, t) -> v``: functionally with ``params``, else the module as itself (through
        the wrapper if asked)."""
        if params is not None:
            return partial(self.functional, params)
        return self.through_wrapper if through_wrapper else self.as_itself

    # -- the first call of an estimate ----------------------------------------------------

    def checked_first(self, call: Call, z: Tensor, t: Tensor) -> Tensor:
        """``call(z, t)`` as an estimate's first model call: a state the model does not fit,
        an output of another shape, or mixed dtypes become one readable error."""
        return first_call(
            partial(_without_kwargs, call),
            z,
            t,
            self._one_state,
            owner=self.module,
            cond_given=self.cond,
            batch_size=self.batch_size,
        )
