"""Rewards on VAE-decoded images: the decode runs inside the reward, differentiably.

A reward maps images ``[B, 3, H, W]`` in ``[0, 1]`` to one number per image ``[B]``;
:func:`reward_objective` turns it into gradest's terminal objective on the final latents:
``loss(z) = -mean(reward(decode(z)))`` with ``decode(z) = (vae.decode(z / scaling_factor
+ shift_factor) + 1) / 2`` clamped to ``[0, 1]`` (as diffusers' image processor does),
so every estimator's gradient runs back through the VAE decoder into the sampling chain.

Built in (no downloads; ``reward = "name"`` or ``"name:key=value,..."``):

* ``brightness``: the mean pixel value.
* ``contrast``: the standard deviation of the grey level over the image.
* ``color:r=1,g=0,b=0``: ``-mean((pixel - target)^2)`` towards the target colour
  (defaults red).

Learned (:mod:`gradest_recipes.learned_rewards`; transformers / open_clip, the extra
``learned-rewards``; the weights from a local path or the hub cache, never downloaded
unless ``download=1``): ``aesthetic:model=CLIP,head=MLP.pth`` (LAION's aesthetic
predictor), ``pickscore:model=PATH``, ``hpsv2:model=PATH`` and ``imagereward:model=PATH``
(text-image: they score each image against its prompt). Option values are text (paths,
hub names); a comma ends one.

Your own reward model: ``reward = "package.module:function"`` (or ``"path/to/file.py:
function"``) names a callable ``function(images) -> [B]`` (differentiable in ``images``;
load your model once at import). If it takes a ``prompts`` parameter, it also gets the
batch's prompt strings (a list of ``B`` str), for text-image rewards.

A weighted sum of any of these (:mod:`gradest_recipes.reward_sums`): ``reward =
"0.7*pickscore:model=PATH + 0.3*brightness"``, terms joined by a ``+`` with spaces around
it, each ``WEIGHT*REWARD`` or ``REWARD`` (weight 1), resolved as a single reward would be.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradest import InvalidValue, TerminalObjective
from gradest_recipes.errors import RecipeConfigError
from gradest_recipes.learned_rewards import LEARNED_OPTIONS, LEARNED_REWARDS
from gradest_recipes.reward_sums import (
    TermSpec,
    WeightedReward,
    WeightedTerm,
    parse_reward_sum,
    term_labels,
)

__all__ = [
    "BUILTIN_REWARDS",
    "Reward",
    "WeightedReward",
    "decode_images",
    "decoded_reward",
    "resolve_reward",
    "reward_names_code",
    "reward_objective",
]

Reward = Callable[..., Tensor]


def brightness(images: Tensor) -> Tensor:
    return images.mean(dim=(1, 2, 3))


def contrast(images: Tensor) -> Tensor:
    return images.mean(dim=1).flatten(1).std(dim=1)


def color(r: float = 1.0, g: float = 0.0, b: float = 0.0) -> Reward:
    target = torch.tensor([r, g, b])

    def reward(images: Tensor) -> Tensor:
        goal = target.to(images)[None, :, None, None]
        return -(images - goal).pow(2).mean(dim=(1, 2, 3))

    return reward


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError("not a number") from None


#: Every reward a ``reward`` setting names without code: the simple ones and the learned.
BUILTIN_REWARDS: dict[str, Callable[..., Reward]] = {
    "brightness": lambda: brightness,
    "contrast": lambda: contrast,
    "color": color,
    **LEARNED_REWARDS,
}
# Each reward's options and the reader of their text.
_OPTIONS: dict[str, dict[str, Callable[[str], Any]]] = {
    "brightness": {},
    "contrast": {},
    "color": {"r": _number, "g": _number, "b": _number},
    **LEARNED_OPTIONS,
}


def _subject(setting: str, term: TermSpec | None = None) -> str:
    """How a message names what it refuses: the setting, and the term of a weighted sum
    by its position (``setting reward='a + b': term 2 'b'``)."""
    named = f"setting reward={setting!r}"
    return named if term is None else f"{named}: term {term.position} {term.text!r}"


def _bad(subject: str, why: str) -> RecipeConfigError:
    """``subject`` (see :func:`_subject`) is refused for ``why``, with the rewards to use."""
    return RecipeConfigError(
        f"{subject} is invalid: {why}; use one of {sorted(BUILTIN_REWARDS)} "
        f"(e.g. 'color:r=1,g=0.5,b=0') or 'package.module:function' naming your own "
        f"reward(images [B,3,H,W] in [0,1]) -> [B]"
    )


def _plus_hint(name: str) -> str:
    """For a name holding a ``+``: a sum written without the spaces that make it one
    (``brightness+contrast``) is read as one name, so say how to write the sum."""
    if "+" not in name:
        return ""
    return " (to add rewards, put spaces around the '+': 'brightness + contrast')"


def _reward_options(spec: str, subject: str | None = None) -> dict[str, str]:
    """A built-in reward's options as texts, in order: ``"color:r=1,g=0.5"`` ->
    ``{"r": "1", "g": "0.5"}``.

    The one reader of a reward spec's options. Each option is ``key=value`` (a comma ends
    one; empty items are skipped), its key one the reward takes, and each key is given
    once: ``aesthetic:model=A,model=B`` is refused, not read as ``model=B``, as gradest's
    estimator specs refuse ``jagg:window=2,window=4``.

    ``subject`` names the setting in messages (default ``setting reward=SPEC``; a term of a
    weighted sum passes its own, see :func:`_subject`).

    Raises:
        RecipeConfigError: an option that is not ``key=value``, a key the reward does not
            take, or a key given twice (one line naming the setting, the key and the fix).
    """
    subject = subject or _subject(spec)
    name, _, rest = spec.strip().partition(":")
    if name not in _OPTIONS:
        raise _bad(subject, f"{name!r} is not a built-in reward")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _OPTIONS[name]:
            allowed = ", ".join(_OPTIONS[name]) or "none"
            raise _bad(subject, f"{name!r} takes options {allowed}, got {item!r}")
        if key in options:
            raise RecipeConfigError(
                f"{subject} sets option {key!r} twice ({key}={options[key]!r} "
                f"and {key}={value.strip()!r}); give each option once"
            )
        options[key] = value.strip()
    return options


def _builtin_options(spec: str, subject: str) -> dict[str, Any]:
    """A built-in reward's options, each read by its reader (``r=1`` -> ``{"r": 1.0}``)."""
    name = spec.strip().partition(":")[0]
    kwargs: dict[str, Any] = {}
    for key, value in _reward_options(spec, subject).items():
        try:
            kwargs[key] = _OPTIONS[name][key](value)
        except ValueError as err:
            raise _bad(subject, f"option {key}={value!r} is {err}") from None
    return kwargs


def _resolve_one(spec: str, subject: str) -> Reward:
    """The reward callable of one reward (built-in name or ``module:function``); messages
    start with ``subject`` (see :func:`_subject`)."""
    name, _, options = spec.strip().partition(":")
    if name in BUILTIN_REWARDS:
        kwargs = _builtin_options(spec, subject)
        if name not in LEARNED_REWARDS:
            return BUILTIN_REWARDS[name](**kwargs)
        try:  # loads the weights: a missing file is one line naming it
            return BUILTIN_REWARDS[name](**kwargs)
        except RecipeConfigError as err:
            raise RecipeConfigError(f"{subject}: {err}") from None
    if not options:
        raise _bad(
            subject,
            f"not a built-in reward and not of the form module:function{_plus_hint(name)}",
        )
    module_name, attribute = name, options
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None or not path.is_file():
                raise ImportError(f"no file {str(path)!r}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise _bad(
            subject,
            f"cannot import {module_name!r} ({err})"
            # a module name never holds a '+'; a file name may
            + ("" if module_name.endswith(".py") else _plus_hint(module_name)),
        ) from err
    function = getattr(module, attribute, None)
    if not callable(function):
        raise _bad(subject, f"{module_name!r} has no callable {attribute!r}")
    return function


def _identity(spec: str, subject: str) -> tuple[Any, ...]:
    """What makes two terms the same reward: a built-in's name and its options as read
    (``color:g=0,r=1`` is ``color:r=1.0, g=0``), or the text of a ``module:function``."""
    name = spec.strip().partition(":")[0]
    if name in BUILTIN_REWARDS:
        return (name, tuple(sorted(_builtin_options(spec, subject).items())))
    return ("code", spec.strip())


def _label_base(spec: str) -> str:
    """A term's name in the per-term means: the built-in's name, or the function's."""
    name, _, function = spec.strip().partition(":")
    return name if name in BUILTIN_REWARDS else function.strip()


def _resolve_sum(setting: str, terms: Sequence[TermSpec]) -> WeightedReward:
    """The weighted sum of ``terms``: every term's name and options checked, and the
    repeats refused, before any reward model loads; then each term resolved."""
    subjects = [_subject(setting, term) for term in terms]
    seen: dict[tuple[Any, ...], TermSpec] = {}
    for term, subject in zip(terms, subjects, strict=True):
        key = _identity(term.spec, subject)
        first = seen.setdefault(key, term)
        if first is not term:
            raise RecipeConfigError(
                f"setting reward={setting!r} is invalid: terms {first.position} and "
                f"{term.position} are the same reward {term.spec!r}; give it once, with "
                f"the summed weight: '{first.weight + term.weight!r}*{term.spec}'"
            )
    rewards = [_resolve_one(t.spec, s) for t, s in zip(terms, subjects, strict=True)]
    labels = term_labels([_label_base(term.spec) for term in terms])
    return WeightedReward(
        [
            WeightedTerm(
                weight=term.weight,
                spec=term.spec,
                label=label,
                reward=reward,
                takes_prompts=_takes_prompts(reward),
            )
            for term, reward, label in zip(terms, rewards, labels, strict=True)
        ]
    )


def resolve_reward(spec: str) -> Reward:
    """The reward callable for a ``reward`` setting: a built-in name, ``module:function``,
    or a weighted sum of them (``0.7*pickscore:model=PATH + 0.3*brightness``: a
    :class:`~gradest_recipes.reward_sums.WeightedReward`).

    Raises:
        RecipeConfigError: one line naming the setting (and the term of a sum, by its
            position) and the fix.
    """
    terms = parse_reward_sum(spec)
    if terms is None:
        return _resolve_one(spec, _subject(spec))
    return _resolve_sum(spec, terms)


def reward_names_code(spec: str) -> bool:
    """Whether a ``reward`` setting names code to import (``module:fn``, ``file.py:fn``),
    itself or in a term of its sum; a setting that does not parse counts as code (a
    resumed run then asks for the reward again rather than trusting it)."""
    try:
        terms = parse_reward_sum(spec)
    except RecipeConfigError:
        return True
    specs = [spec] if terms is None else [term.spec for term in terms]
    return any(one.strip().partition(":")[0] not in BUILTIN_REWARDS for one in specs)


def _takes_prompts(function: Reward) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return "prompts" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def decode_images(vae: nn.Module, latents: Tensor) -> Tensor:
    """``latents [B, C, h, w] -> images [B, 3, H, W]`` in ``[0, 1]``, differentiably."""
    config: Any = vae.config
    scaled = latents / config.scaling_factor
    if getattr(config, "shift_factor", None):
        scaled = scaled + config.shift_factor
    parameter = next(vae.parameters())
    decoded = vae.decode(scaled.to(parameter.dtype), return_dict=False)[0]  # type: ignore[operator]
    return (decoded.float() / 2 + 0.5).clamp(0, 1)


def decoded_reward(
    reward: Reward,
    vae: nn.Module,
    to_vae_latents: Callable[[Tensor], Tensor],
    prompts: Sequence[str],
    *,
    autocast: Callable[[], Any] | None = None,
) -> Callable[[Tensor], Any]:
    """``z -> reward(decode(z))`` (the prompts passed when the reward takes them), what the
    reward returned as it is: its caller checks the shape it needs.

    ``autocast`` (e.g. ``accelerator.autocast``) is entered around the decode and the
    reward, so they run in the training's mixed precision.
    """
    pass_prompts = _takes_prompts(reward)

    def values(z: Tensor) -> Any:
        context = autocast() if autocast is not None else contextlib.nullcontext()
        with context:
            images = decode_images(vae, to_vae_latents(z))
            return reward(images, prompts=list(prompts)) if pass_prompts else reward(images)

    return values


def reward_objective(
    reward: Reward,
    vae: nn.Module,
    to_vae_latents: Callable[[Tensor], Tensor],
    prompts: Sequence[str],
    *,
    autocast: Callable[[], Any] | None = None,
) -> TerminalObjective:
    """``TerminalObjective(z -> -mean(reward(decode(z))))`` for one batch of ``prompts``
    (``autocast``: see :func:`decoded_reward`)."""
    scored = decoded_reward(reward, vae, to_vae_latents, prompts, autocast=autocast)

    def loss_fn(z: Tensor) -> Tensor:
        values = scored(z)
        if not isinstance(values, Tensor) or values.ndim > 1:
            raise InvalidValue(
                f"the reward returned {type(values).__name__} of shape "
                f"{tuple(getattr(values, 'shape', ()))}; a reward returns a tensor [B] (one "
                f"value per image) or a scalar"
            )
        return -values.float().mean()

    return TerminalObjective(loss_fn)
