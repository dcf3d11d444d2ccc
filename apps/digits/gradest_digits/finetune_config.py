"""Every setting of a fine-tuning run, in one frozen record: defaults and checks live here once.

:class:`FinetuneConfig` is what :func:`gradest_digits.finetune.finetune` takes (or builds
from its keyword arguments) and what a checkpoint records; ``gradest finetune``'s options
are generated from its fields (:func:`add_config_arguments`), so the command line and the
Python API cannot disagree about a default.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import attrs

from gradest import InvalidType, InvalidValue
from gradest.plugin import INT64_MAX, WholeNumber
from gradest.rl import LOG_PROB_REDUCTIONS

MODES = ("reward", "grpo", "adjoint_matching")
OPTIMIZERS = ("adamw", "sgd")


def _int_at_least(minimum: int, hint: str) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidType(
                f"{attribute.name} must be an int >= {minimum}, got {value!r}; {hint}"
            )
        if value < minimum:
            raise InvalidValue(f"{attribute.name} must be >= {minimum}, got {value}; {hint}")
        if value > INT64_MAX:  # gradest.integers: what torch holds (seeds, sizes)
            raise InvalidValue(f"{attribute.name} must be at most 2**63 - 1, got {value}; {hint}")

    check.minimum = minimum  # type: ignore[attr-defined]  # the flag's type reads it
    return check


def _finite_float(
    *, positive: bool, hint: str, optional: bool = False
) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidType(f"{attribute.name} must be a float, got {value!r}; {hint}")
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            bound = "> 0" if positive else ">= 0"
            raise InvalidValue(
                f"{attribute.name} must be a finite float {bound}, got {value!r}; {hint}"
            )

    return check


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise InvalidValue(
                f"{attribute.name} must be one of {', '.join(choices)}, got {value!r}"
            )

    return check


def _float_or_none(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def setting(
    default: Any,
    *,
    help: str,
    validator: Callable[[Any, attrs.Attribute, Any], None] | None = None,
    kind: type | None = None,
    choices: tuple[str, ...] | None = None,
    grpo: bool = False,
) -> Any:
    """A config field with what the command line needs (help, type, choices)."""
    checks = [validator] if validator is not None else []
    if choices is not None:
        checks.append(_one_of(choices))
    return attrs.field(
        default=default,
        validator=checks,
        converter=_float_or_none if kind is float else None,
        metadata={
            "help": help,
            "kind": kind,
            "choices": choices,
            "grpo": grpo,
            # An int setting's smallest value: its flag is a WholeNumber of that range.
            "minimum": getattr(validator, "minimum", None),
        },
    )


@attrs.frozen(kw_only=True)
class FinetuneConfig:
    """The settings of a fine-tuning run (see :func:`~gradest_digits.finetune.finetune`).

    Attributes:
        estimator: a spec string (``"exact"``, ``"jagg:window=4"``) or an estimator object.
        mode: ``"reward"`` (the terminal ``-reward`` through the ODE sampler), ``"grpo"``
            (Flow-GRPO's clipped surrogate on FlowSDE rollouts) or ``"adjoint_matching"``
            (adjoint matching on rollouts of the memoryless FlowSDE, ``noise_level=sqrt(2)``,
            against a frozen copy of the initial model; :mod:`gradest.rl.adjoint_matching`).
        steps: outer steps (``reward``: one optimizer step each; ``grpo``: one batch of
            rollouts, then ``inner_epochs`` optimizer steps).
        batch_size: samples per step over all ranks (``grpo``: a multiple of
            ``group_size``).
        lr, optimizer, weight_decay: ``torch.optim.AdamW`` or plain ``SGD``.
        max_grad_norm: clip the total gradient norm to this (None: no clipping).
        seed: seeds the run's only ``torch.Generator`` (several ranks: the evaluation
            generator, and each rank's training generator via ``rank_generator(seed)``).
        sampler_steps: ``N``, steps of the sampler.
        checkpoint_every: save a checkpoint every this many steps (0: only at the end).
        prior_weight: weight of a flow-matching loss on real samples (``prior_data``) added
            to every backward: prior preservation, which keeps the model near the data
            while the reward pulls it away (0: off).
        group_size, inner_epochs, clip, noise_level, log_prob_reduction: GRPO's group
            size, optimizer steps per batch, PPO clip range, FlowSDE ``noise_level`` and
            the reduction of :meth:`~gradest.samplers.TimeGrid.step_log_prob`.
        kl_weight: GRPO's weight of the KL to a frozen copy of the initial model (the
            reference policy), per step (:func:`gradest.rl.grpo_objective`; 0: off).
    """

    estimator: Any = setting(
        "exact", kind=str, help="estimator spec, e.g. exact, jagg:window=4, sdo:samples=2"
    )
    mode: str = setting(
        "reward",
        choices=MODES,
        help="reward: backprop -reward through the ODE sampler; grpo: Flow-GRPO on FlowSDE; "
        "adjoint_matching: adjoint matching on memoryless FlowSDE rollouts (base: the "
        "initial model)",
    )
    steps: int = setting(
        50, kind=int, validator=_int_at_least(1, "e.g. steps=50"), help="outer training steps"
    )
    batch_size: int = setting(
        16,
        kind=int,
        validator=_int_at_least(1, "e.g. batch_size=16"),
        help="samples per step, over all ranks",
    )
    lr: float = setting(
        1e-4,
        kind=float,
        validator=_finite_float(positive=True, hint="e.g. lr=1e-4"),
        help="learning rate",
    )
    optimizer: str = setting("adamw", choices=OPTIMIZERS, help="the optimizer")
    weight_decay: float = setting(
        0.0,
        kind=float,
        validator=_finite_float(positive=False, hint="e.g. 0.0"),
        help="weight decay",
    )
    max_grad_norm: float | None = setting(
        None,
        kind=float,
        validator=_finite_float(positive=True, hint="or None", optional=True),
        help="clip the gradient norm (default: no clipping)",
    )
    seed: int = setting(
        0,
        kind=int,
        validator=_int_at_least(0, "any non-negative int"),
        help="seed of the whole run",
    )
    sampler_steps: int = setting(
        10, kind=int, validator=_int_at_least(1, "e.g. sampler_steps=10"), help="sampler steps N"
    )
    checkpoint_every: int = setting(
        0,
        kind=int,
        validator=_int_at_least(0, "0 saves only the final checkpoint"),
        help="save a checkpoint every this many steps (0: only the final one)",
    )
    prior_weight: float = setting(
        0.0,
        kind=float,
        validator=_finite_float(positive=False, hint="0 switches it off"),
        help="weight of a flow-matching loss on real data beside the reward (prior "
        "preservation; needs prior data)",
    )
    group_size: int = setting(
        4,
        kind=int,
        validator=_int_at_least(2, "advantages compare samples within a group"),
        help="GRPO group size",
        grpo=True,
    )
    inner_epochs: int = setting(
        2,
        kind=int,
        validator=_int_at_least(1, "Flow-GRPO uses 1-2"),
        help="GRPO optimizer steps per batch",
        grpo=True,
    )
    clip: float = setting(0.2, kind=float, help="GRPO clip range, in (0, 1)", grpo=True)
    noise_level: float = setting(
        0.7,
        kind=float,
        validator=_finite_float(positive=True, hint="Flow-GRPO uses 0.7"),
        help="FlowSDE noise level a",
        grpo=True,
    )
    log_prob_reduction: str = setting(
        "sum", choices=LOG_PROB_REDUCTIONS, help="GRPO step log-density: sum or mean", grpo=True
    )
    kl_weight: float = setting(
        0.0,
        kind=float,
        validator=_finite_float(positive=False, hint="0 switches it off; Flow-GRPO uses 0.04"),
        help="GRPO weight of the KL to the initial model (0: off)",
        grpo=True,
    )

    def __attrs_post_init__(self) -> None:
        if self.mode != "grpo":
            return
        if self.batch_size % self.group_size:
            raise InvalidValue(
                f"batch_size={self.batch_size} must be a multiple of group_size="
                f"{self.group_size} in mode='grpo'; e.g. batch_size="
                f"{self.group_size * max(1, self.batch_size // self.group_size)}"
            )
        clip = self.clip
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not 0 < clip < 1:
            raise InvalidValue(f"clip must be in (0, 1), got {clip!r}; Flow-GRPO uses 0.2")

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in attrs.fields(cls)]

    def record(self, estimator_repr: str) -> dict[str, Any]:
        """The settings as a checkpoint / log stores them (GRPO's only in GRPO mode)."""
        record = {
            field.name: getattr(self, field.name)
            for field in attrs.fields(type(self))
            if field.name not in ("estimator", "checkpoint_every")
            and (self.mode == "grpo" or not field.metadata["grpo"])
        }
        record["estimator"] = estimator_repr
        return record


def config_from(config: FinetuneConfig | None, settings: dict[str, Any]) -> FinetuneConfig:
    """``config`` (or the defaults) with ``settings`` replaced; unknown names are refused."""
    unknown = sorted(set(settings) - set(FinetuneConfig.names()))
    if unknown:
        raise InvalidType(
            f"finetune() got unknown setting(s) {', '.join(unknown)}; the settings are "
            f"{', '.join(FinetuneConfig.names())}"
        )
    base = config if config is not None else FinetuneConfig()
    if not isinstance(base, FinetuneConfig):
        raise InvalidType(f"config must be a FinetuneConfig, got {type(base).__name__}")
    return attrs.evolve(base, **settings)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`FinetuneConfig` field, with its default, type and help."""
    for field in attrs.fields(FinetuneConfig):
        meta = field.metadata
        flag = "--" + field.name.replace("_", "-")
        help_text = meta["help"] + (
            " (default: none)" if field.default is None else f" (default {field.default})"
        )
        options: dict[str, Any] = {"default": field.default, "help": help_text}
        if meta["choices"] is not None:
            options["choices"] = meta["choices"]
        elif meta["kind"] is int:
            # gradest's one rule for integer flags (gradest.integers), in the setting's range.
            options["type"] = WholeNumber(meta["minimum"] if meta["minimum"] is not None else 1)
        elif meta["kind"] is not None:
            options["type"] = meta["kind"]
        parser.add_argument(flag, **options)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    return FinetuneConfig(**{name: getattr(args, name) for name in FinetuneConfig.names()})
