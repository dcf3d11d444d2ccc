"""What one ``estimate`` call knows: validated inputs, the trajectory, cotangents, costs.

Strategies receive an :class:`EstimationContext` and only decide *which cotangents*
and *how the sum of VJPs* is evaluated; everything else (sampling, loss checks, the
adjoint sweep, exact backpropagation through a tail of the chain, cost counting) is
shared here and in :mod:`gradest.vjp`. The same strategy code serves ``estimate()`` and
``surrogate()``: the context's field evaluates parameter VJPs or defers them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import Tensor

from gradest._checks import (
    check_generator,
    check_model,
    check_model_modes,
    check_noise,
    is_symbolic,
    outside_fake_mode,
)
from gradest.conditioning import check_cond
from gradest.errors import InvalidType, InvalidValue
from gradest.nonfinite import NonFiniteError, check_finite, immediate_checks
from gradest.objectives import Objective, StepwiseObjective, TerminalObjective
from gradest.protocol import Decisions
from gradest.ranks import RankAgreement
from gradest.samplers import AffineSampler
from gradest.symbolic import host_value
from gradest.trajectory import (
    SamplerSteps,
    Trajectory,
    check_model_fits_sampler,
    check_sampler,
    check_trajectory_matches,
    draw_step_noise,
    host_coefficients,
    integrate,
)
from gradest.vjp import (
    CostMeter,
    ParamGradient,
    RetainedChain,
    VelocityField,
    add_grads,
    velocities_checked,
)


@attrs.frozen(eq=False)
class AdjointSweep:
    """Result of the reverse adjoint sweep along a recorded path.

    Attributes:
        cotangents: ``c_k = beta_k a_{k+1}`` for the swept steps ``start..N-1``
            (``[N - start, B, ...]``).
        velocities: the model's velocity at each swept state (from the sweep's forwards).
        state_grad: ``a_start``, the gradient w.r.t. the first swept state (only
            meaningful for a joint sweep, or from step 0 with the noise gradient wanted).
        grads: the parameter gradient of a joint sweep (None for a state-only sweep).
    """

    cotangents: Tensor
    velocities: Tensor
    state_grad: Tensor
    grads: ParamGradient | None


def _as_lists(value: Any) -> Any:
    """Tuples (and tuples in dicts) as lists: ``info`` holds plain JSON-like values."""
    if isinstance(value, dict):
        return {key: _as_lists(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_as_lists(item) for item in value]
    return value


def host_floats(values: Any) -> list[float]:
    """0-dim tensors as Python floats in one transfer (not one host sync each)."""
    items = [v if v.ndim == 0 and not v.requires_grad else v.detach().reshape(()) for v in values]
    if not items:
        return []
    if any(is_symbolic(v) for v in items):
        return [float("nan")] * len(items)  # fake/meta tensors: no values (cost tracing)
    device = items[0].device
    # One stack (it promotes to a common dtype; half and bfloat16 widen exactly) and one
    # conversion, not one per value.
    stacked = torch.stack([v if v.device == device else v.to(device) for v in items])
    return stacked.to(torch.float64).tolist()


class EstimationContext:
    """Validated inputs of one estimate, with the shared building blocks strategies use.

    Attributes:
        field: the model as a :class:`~gradest.vjp.VelocityField`.
        sampler: the sampler; ``coefficients`` its ``(alpha, beta, sigma)``.
        objective: terminal or stepwise.
        generator: the only source of randomness.
        want_noise_grad: whether the caller asked for the initial-noise gradient.
        meter: cost counters of this call.
        surrogate: True inside ``surrogate()``: parameter VJPs become loss terms.
        ranks: agreement of random and gate decisions across data-parallel ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sampler: AffineSampler,
        objective: Objective,
        *,
        noise: Tensor | None = None,
        trajectory: Trajectory | None = None,
        cond: Mapping[str, Any] | None = None,
        generator: torch.Generator | None = None,
        noise_grad: bool = False,
        engine: str = "autograd",
        surrogate: bool = False,
    ):
        if torch.is_inference_mode_enabled():
            raise InvalidValue(
                "gradest cannot differentiate inside torch.inference_mode(): tensors made "
                "there never record a graph; call the estimator outside it (torch.no_grad() "
                "around the call is fine)"
            )
        check_sampler(sampler)
        check_model_fits_sampler(model, sampler)
        if not isinstance(objective, TerminalObjective | StepwiseObjective):
            raise InvalidType(
                "objective must be gradest.TerminalObjective(loss_fn) or "
                f"gradest.StepwiseObjective(loss_fn), got {type(objective).__name__}"
            )
        if (noise is None) == (trajectory is None):
            raise InvalidValue(
                "pass exactly one of noise= (the estimator samples itself) or trajectory= "
                "(a path recorded with gradest.rollout); got "
                + ("both" if noise is not None else "neither")
            )
        if not isinstance(noise_grad, bool):
            raise InvalidType(f"noise_grad must be True or False, got {noise_grad!r}")
        if noise_grad and isinstance(objective, StepwiseObjective):
            raise InvalidValue(
                "noise_grad=True needs a TerminalObjective: a StepwiseObjective treats the "
                "recorded states as data, so the loss does not depend on the initial noise"
            )
        # One walk over the model's modules for every check and reader of this call.
        check_model(model)
        named_modules = list(model.named_modules())
        check_model_modes(model, named_modules)
        self.generator = check_generator(
            generator, noise if noise is not None else getattr(trajectory, "states", None)
        )
        if noise is not None:
            check_noise(model, noise, named_modules=named_modules)
            batch = noise.shape[0]
        else:
            assert trajectory is not None
            check_trajectory_matches(sampler, trajectory)
            check_noise(
                model,
                trajectory.states[0],
                name="trajectory.states[0]",
                named_modules=named_modules,
            )
            batch = trajectory.batch_size
            # Recorded tensors are data: never let a graph they carry reach the estimate
            # (or the caller's leaves through the surrogate's backward).
            trajectory = attrs.evolve(
                trajectory,
                states=trajectory.states.detach(),
                velocities=trajectory.velocities.detach(),
                step_noise=None
                if trajectory.step_noise is None
                else trajectory.step_noise.detach(),
            )
        # The conditioning rule needs the batch (gradest.conditioning).
        cond = check_cond(cond, batch)
        self.meter = CostMeter()
        self.field = VelocityField(
            model,
            cond,
            batch,
            self.meter,
            engine=engine,
            surrogate=surrogate,
            generator=self.generator,
            named_modules=named_modules,
        )
        self.surrogate = surrogate
        # Data-parallel ranks must decide alike (gradest.ranks): draws and gates go through it.
        self.ranks = RankAgreement(model)
        self.sampler = sampler
        # Host copies of the grid and coefficients (one transfer each per call): the step
        # loops read floats from these, never float(times[k]) (a host sync per step).
        # The schedule is a host object: real values even under FakeTensorMode.
        with outside_fake_mode():
            self.coefficients = sampler.coefficients()
            self.host_times: list[float] = sampler.times.tolist()
            self.host_coefficients = host_coefficients(self.coefficients)
        self.objective = objective
        self.noise = noise
        self.want_noise_grad = noise_grad
        self._trajectory = trajectory
        # The sampler's step noise is drawn first, before anything a strategy draws, so
        # that an estimator given the same generator state as gradest.rollout samples
        # the same path, and strategies need not order their draws around the rollout.
        self._step_noise = (
            draw_step_noise(self.host_coefficients[2], noise, self.generator)
            if noise is not None
            else trajectory.step_noise  # type: ignore[union-attr]
        )
        # Velocities recorded by a rollout made in this call are the current model's, so
        # strategies may reuse them instead of evaluating the model again.
        self._velocities_are_current = False
        # Whether any evaluated step's loss depended on its velocity (stepwise).
        self.stepwise_loss_depends = False
        # l_k of the evaluated steps (stepwise), each step once: info["evaluated_value"].
        # Kept as tensors: one host transfer in finish_stepwise_value, none per step.
        self._step_losses: dict[int, Tensor] = {}
        self.info: dict[str, Any] = {}
        self.decisions: Decisions | None = None

    @property
    def num_steps(self) -> int:
        return self.sampler.num_steps

    @property
    def times(self) -> Tensor:
        return self.sampler.times

    def times_at(self, index: int | slice | Sequence[int]) -> Tensor:
        """``times[index]`` of the sampler's grid, a real tensor even under FakeTensorMode
        (the schedule is a host object)."""
        with outside_fake_mode():
            return self.sampler.times[index]

    @property
    def is_terminal(self) -> bool:
        return isinstance(self.objective, TerminalObjective)

    @property
    def sampled_here(self) -> bool:
        """True when the estimator samples from ``noise`` itself (it may fuse sampling)."""
        return self.noise is not None

    @property
    def sampler_steps(self) -> SamplerSteps:
        """The affine steps a chain runs: coefficients, grid and recorded step noise."""
        return SamplerSteps(
            self.coefficients, self.times, self.step_noise(), self.host_coefficients
        )

    def step_noise(self) -> Tensor | None:
        """Recorded ``xi_k``: the trajectory's, or drawn from the generator at construction."""
        return self._step_noise

    def _sample_without_graph(self, z: Tensor, steps: range) -> tuple[list[Tensor], list[Tensor]]:
        velocities: list[Tensor] = []

        def velocity(k: int, state: Tensor) -> Tensor:
            velocities.append(self.field.velocity(state, self.host_times[k], check=False))
            return velocities[-1]

        # Every velocity checked at once when the loop ends (the first non-finite step is
        # named, as a check per step would).
        with velocities_checked(velocities, [self.host_times[k] for k in steps]):
            return integrate(velocity, self.host_coefficients, z, self.step_noise(), steps)

    def trajectory(self) -> Trajectory:
        """The given trajectory, or a no-graph rollout from ``noise`` (``N`` forwards)."""
        if self._trajectory is None:
            assert self.noise is not None
            states, velocities = self._sample_without_graph(
                self.noise.detach(), range(self.num_steps)
            )
            self.record(torch.stack(states), torch.stack(velocities))
        return self._trajectory  # type: ignore[return-value]

    def record(self, states: Tensor, velocities: Tensor) -> None:
        """Adopt a path sampled in this call with the current parameters."""
        self._trajectory = Trajectory(
            times=self.times.clone(),
            states=states,
            velocities=velocities,
            step_noise=self.step_noise(),
        )
        self._velocities_are_current = True

    def decide(self, decisions: Decisions) -> None:
        """Record the estimator's decisions (also copied into ``info`` for logs; tensors,
        such as drawn noise, only by their shape)."""
        self.decisions = decisions
        fields = attrs.asdict(decisions, recurse=False)
        self.info.update(
            {
                name: f"tensor{list(value.shape)}" if isinstance(value, Tensor) else value
                for name, value in _as_lists(fields).items()
            }
        )

    def velocities_at(self, steps: Sequence[int], *, chunk: int | None = None) -> list[Tensor]:
        """Current-model velocities at recorded states ``steps``: the recording's, or
        no-graph forwards of the states stacked, at most ``chunk`` states per model call
        (one call's transient memory bounded by ``chunk`` states)."""
        trajectory = self.trajectory()
        steps = list(steps)
        if not steps:
            return []
        if self._velocities_are_current:
            return [trajectory.velocities[k] for k in steps]
        size = len(steps) if chunk is None else max(1, chunk)
        out: list[Tensor] = []
        for first in range(0, len(steps), size):
            part = steps[first : first + size]
            stacked = self.field.velocities(
                trajectory.states[part], [self.host_times[k] for k in part]
            )
            out.extend(stacked.unbind(0))
        return out

    def velocity(self, k: int) -> Tensor:
        """Current-model velocity at recorded state ``k`` (a no-graph forward if needed)."""
        trajectory = self.trajectory()
        if self._velocities_are_current:
            return trajectory.velocities[k]
        return self.field.velocity(trajectory.states[k], self.host_times[k])

    # -- objectives -----------------------------------------------------------------------

    def terminal_adjoint(self) -> Tensor:
        """``a_N = grad l(z_N)`` on the trajectory's final state; records the loss."""
        assert isinstance(self.objective, TerminalObjective)
        loss, adjoint = self.objective.terminal_adjoint(self.trajectory().states[-1])
        # No value to read on fake/meta tensors (cost tracing): NaN.
        self.info["loss"] = host_value(loss)
        return adjoint

    def step_cotangent(self, k: int, velocity: Tensor) -> Tensor:
        """``c_k = d l_k / d v_k`` of a stepwise objective; accumulates the loss."""
        assert isinstance(self.objective, StepwiseObjective)
        loss, cotangent, depends = self.objective.evaluate_step(k, velocity, self.trajectory())
        self.stepwise_loss_depends |= depends
        if k not in self._step_losses:
            # a copy: the loss's own storage belongs to its (freed) graph
            self._step_losses[k] = loss.detach().clone()
        return cotangent

    def finish_stepwise_value(self) -> None:
        """``info["loss"] = sum_k l_k`` over all ``N`` steps of a stepwise objective.

        The evaluated steps' losses are those at the current model's velocities; every
        other step's loss is ``loss_fn(k, v_k, trajectory)`` at the recorded velocity
        (detached, no model call). So every estimator reports the same value for the same
        trajectory (recorded by the current model). ``info["evaluated_value"]`` keeps the
        evaluated steps' part. Without a recorded path (a plugin that never sampled one)
        ``info["loss"]`` stays the evaluated part.
        """
        if self.is_terminal or not self._step_losses:
            return
        losses = host_floats(self._step_losses.values())  # one transfer for every step
        evaluated = dict(zip(self._step_losses, losses, strict=True))
        self.info["evaluated_value"] = sum(evaluated.values())
        self.info["loss"] = self.info["evaluated_value"]
        trajectory = self._trajectory
        if trajectory is None or trajectory.velocities.shape[0] != self.num_steps:
            return
        assert isinstance(self.objective, StepwiseObjective)
        others: dict[int, Tensor] = {}
        with torch.no_grad():
            for k in range(self.num_steps):
                if k not in evaluated:
                    # a copy: a loss with an in-place op must not edit the recording
                    velocity = trajectory.velocities[k].detach().clone()
                    others[k] = torch.as_tensor(self.objective.loss_fn(k, velocity, trajectory))
        values = {**evaluated, **dict(zip(others, host_floats(others.values()), strict=True))}
        total = 0.0
        for k in range(self.num_steps):
            total += values[k]
        self.info["loss"] = total

    # -- the adjoint ----------------------------------------------------------------------

    def retained_chain(self, start: int = 0) -> RetainedChain:
        """Steps ``start..N-1`` with each step's graph kept from its own leaf
        (:class:`~gradest.vjp.RetainedChain`): sampled from ``noise`` (the first ``start``
        steps without a graph; the whole path recorded), or evaluated at the recorded states."""
        if self._trajectory is not None:
            states = self._trajectory.states
            return self.field.retained_chain(
                self.sampler_steps, start, states[start], recorded=states[start:]
            )
        assert self.noise is not None
        head_states, head_velocities = self._sample_without_graph(self.noise.detach(), range(start))
        chain = self.field.retained_chain(self.sampler_steps, start, head_states[-1])
        if start:
            self.record(
                torch.cat([torch.stack(head_states[:-1]), chain.states]),
                torch.cat([torch.stack(head_velocities), chain.velocities]),
            )
        else:
            self.record(chain.states, chain.velocities)
        return chain

    def state_at(self, k: int) -> Tensor:
        """``z_k``: recorded, or sampled from ``noise`` without a graph through steps
        ``0..k-1`` (``k`` forwards; the path is not recorded, for estimators that stop there)."""
        if self._trajectory is not None:
            return self._trajectory.states[k]
        assert self.noise is not None
        states, _ = self._sample_without_graph(self.noise.detach(), range(k))
        return states[-1]

    def adjoint_sweep(
        self,
        terminal_adjoint: Tensor,
        *,
        start: int = 0,
        joint: bool = False,
        chain: RetainedChain | None = None,
        keep: frozenset[int] = frozenset(),
    ) -> AdjointSweep:
        """Reverse sweep ``a_k = alpha_k a_{k+1} + beta_k (dv_k/dz_k)^T a_{k+1}`` on the path.

        Sweeps steps ``N-1`` down to ``start``. ``joint=True`` takes one full VJP per step
        (state and parameters: the exact ``sum_k J_k^T c_k`` of the swept steps, one
        step's graph at a time; ``estimate()`` only); otherwise state-only VJPs, which skip
        the parameter part. Every step costs one forward with graph, except a state-only
        first swept step whose ``a_start`` nobody needs (``c_start`` needs only
        ``a_{start+1}``; ``a_0`` is the noise gradient, needed when it is wanted). With a
        retained ``chain`` the state-only VJPs run through its kept graphs (no forward);
        the graphs of the steps in ``keep`` stay for a later parameter VJP.
        """
        trajectory = self.trajectory()
        alpha, beta, _ = self.host_coefficients
        adjoint = terminal_adjoint
        swept = range(start, self.num_steps)
        cotangents: list[Tensor] = [terminal_adjoint] * len(swept)
        velocities: list[Tensor] = [terminal_adjoint] * len(swept)
        grads: ParamGradient | None = None
        # a_start is needed only as the noise gradient (start 0, when it is wanted).
        need_first = start == 0 and self.want_noise_grad
        for k in reversed(swept):
            cotangent = beta[k] * adjoint
            z, t = trajectory.states[k], self.host_times[k]
            if joint:
                v, z_grad, step_grads = self.field.joint_vjp(z, t, cotangent)
                grads = add_grads(grads, step_grads)
            elif chain is not None:
                v = chain.velocities[k - chain.start]
                if k == start and not need_first:
                    z_grad = None
                    if k not in keep:
                        chain.release(k)
                else:
                    z_grad = chain.state_vjp(k, cotangent, keep=k in keep)
            elif k == start and not need_first:
                v, z_grad = self.velocity(k), None
            else:
                v, z_grad = self.field.state_vjp(z, t, cotangent)
            cotangents[k - start], velocities[k - start] = cotangent, v
            if z_grad is not None:
                # alpha = 1 (Euler) skips a multiply; adjoint * 1.0 == adjoint exactly.
                adjoint = (adjoint if alpha[k] == 1.0 else alpha[k] * adjoint) + z_grad
            check_finite(adjoint, "adjoint", [t])
        return AdjointSweep(
            cotangents=torch.stack(cotangents),
            velocities=torch.stack(velocities),
            state_grad=adjoint,
            grads=grads,
        )

    def backprop_tail(
        self, start: int, *, low_memory: bool = False
    ) -> tuple[ParamGradient, Tensor | None]:
        """Exact ``sum_{k >= start} J_k^T c_k`` of the terminal objective, and ``a_start``.

        Backpropagation through steps ``start..N-1`` with the chain before ``start``
        detached (``start=0``: the exact gradient; ``start=N-k``: DRaFT-K). How:

        * from ``noise``, ``low_memory=False``: a no-graph rollout of the first ``start``
          steps, then the remaining steps with their graph kept and one fused VJP
          (activations of ``N - start`` steps);
        * from ``noise``, ``low_memory=True``: ``estimate()`` samples without a graph and
          sweeps joint VJPs in reverse (one step's graph at a time, one forward more per
          step); ``surrogate()`` checkpoints each step of the chain, so the caller's
          backward recomputes it (the same cost and memory);
        * on a recorded trajectory: ``estimate()`` sweeps joint VJPs along the recording;
          ``surrogate()`` builds the chain with each state pinned to the recording (the
          graph of ``N - start`` steps, or one at a time with ``low_memory``).

        Returns:
            ``(parameter gradient, a_start or None)``; ``a_start`` only when the noise
            gradient was requested (``estimate()``).
        """
        want_state_grad = self.want_noise_grad
        if not self.surrogate and (self._trajectory is not None or low_memory):
            sweep = self.adjoint_sweep(self.terminal_adjoint(), start=start, joint=True)
            assert sweep.grads is not None
            return sweep.grads, sweep.state_grad if want_state_grad else None
        if self._trajectory is not None:
            trajectory = self._trajectory
            chain = self.field.chain(
                self.sampler_steps,
                start,
                trajectory.states[start],
                recorded=trajectory.states[start:],
                low_memory=low_memory,
            )
            return chain.pull(self.terminal_adjoint())[0], None
        assert self.noise is not None
        head_states, head_velocities = self._sample_without_graph(self.noise.detach(), range(start))
        chain = self.field.chain(
            self.sampler_steps,
            start,
            head_states[-1],
            low_memory=low_memory,
            state_grad=want_state_grad,
        )
        states = torch.cat([torch.stack(head_states[:-1]), chain.states]) if start else chain.states
        velocities = (
            torch.cat([torch.stack(head_velocities), chain.velocities])
            if start
            else chain.velocities
        )
        self.record(states, velocities)
        terminal_adjoint = self.terminal_adjoint()
        if self.surrogate:
            return chain.pull(terminal_adjoint)

        def locate() -> NonFiniteError | None:
            # The fused backward saw a NaN/Inf somewhere in the chain: sweep again one step
            # at a time along the recorded path, whose checks name the step where it
            # first appears (the failure path only; a clean estimate never pays this).
            try:
                with immediate_checks():
                    self.adjoint_sweep(terminal_adjoint, start=start, joint=True)
            except NonFiniteError as err:
                return err
            return None

        return chain.pull(terminal_adjoint, locate)
