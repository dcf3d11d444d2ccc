"""The one VJP engine: every model call and vector-Jacobian product of every estimator.

Strategies evaluate the model only through a :class:`VelocityField`, which keeps in one
place which parameters are differentiated (``requires_grad=True`` only), how
conditioning is repeated when several states are stacked into one batched call, the
:class:`~gradest.protocol.Cost` bookkeeping (exact by construction), replayed randomness
for stochastic layers (:mod:`gradest.replay`) and the non-finite checks.

Three ways to evaluate the parameter part, chosen per estimate, behind one interface
(:class:`~gradest.vjp.engines.Engine`, :mod:`gradest.vjp.engines`):

* ``engine="autograd"`` (the default of ``estimate()``, :class:`AutogradEngine`): the
  module is called as itself and VJPs are ``torch.autograd.grad`` calls. Forward hooks,
  ``torch.utils.checkpoint`` and diffusers' gradient checkpointing run; ``.grad`` is
  never written.
* ``engine="func"`` (:class:`FuncEngine`): ``torch.func.functional_call`` +
  ``torch.func.vjp`` on an explicit parameter dict, composable with ``vmap``/``jacrev``.
  ``functional_call`` swaps the module's parameters during the forward, so those forwards
  hold the model's exclusive lock (:mod:`gradest.model_lock`); it cannot differentiate a
  model that uses saved-tensor hooks (layer checkpointing).
* surrogate mode (``surrogate()``, the autograd engine with its parameter pullbacks
  deferred): parameter VJPs are not evaluated at all. Each one becomes a term
  ``<v_theta(z_j, t_j), G_j>`` of a loss whose autograd gradient is the estimate
  (:class:`SurrogateTerms`); the caller's ``loss.backward()`` evaluates them, through
  DDP/FSDP wrappers and AMP like any loss.

Cotangent work (no-graph forwards, state-only VJPs of the adjoint sweep, the gate) is
the same in every mode: the module is called as itself (the inner module of a
``DistributedDataParallel`` wrapper, so the reducer sees only the parameter terms) and
state VJPs differentiate the state only, so nothing lands in ``.grad``. Every model call
(locking, torch.compile guards, ``functional_call``) goes through
:class:`~gradest.vjp.model_call.ModelCalls`.

Batched calls stack ``M`` states of batch ``B`` along the batch dimension (one model
call on ``M*B`` rows), which assumes the model treats rows independently, as diffusion
transformers and MLPs do (no batch norm in training mode).

Modules: :mod:`~gradest.vjp.field` (the field, the cost meter),
:mod:`~gradest.vjp.engines`, :mod:`~gradest.vjp.model_call`, :mod:`~gradest.vjp.chains`
(the fused and the retained chain), :mod:`~gradest.vjp.gradients` (gradient dicts and
surrogate terms).
"""

from gradest.vjp.chains import ChainPullback, RetainedChain, velocities_checked
from gradest.vjp.engines import ENGINES, AutogradEngine, Engine, FuncEngine
from gradest.vjp.field import ParamPullback, VelocityField
from gradest.vjp.gradients import (
    Grads,
    ParamGradient,
    SurrogateTerms,
    add_grads,
    inner,
    scale_grads,
)
from gradest.vjp.meter import CostMeter
from gradest.vjp.model_call import unwrap_data_parallel

__all__ = [
    "ENGINES",
    "AutogradEngine",
    "ChainPullback",
    "CostMeter",
    "Engine",
    "FuncEngine",
    "Grads",
    "ParamGradient",
    "ParamPullback",
    "RetainedChain",
    "SurrogateTerms",
    "VelocityField",
    "add_grads",
    "inner",
    "scale_grads",
    "unwrap_data_parallel",
    "velocities_checked",
]
