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

__all__ = [
    "BUILTIN_REWARDS",
    "Reward",
    "decode_images",
    "decoded_reward",
    "resolve_reward",
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


def _bad(spec: str, why: str) -> RecipeConfigError:
    return RecipeConfigError(
        f"setting reward={spec!r} is invalid: {why}; use one of {sorted(BUILTIN_REWARDS)} "
        f"(e.g. 'color:r=1,g=0.5,b=0') or 'package.module:function' naming your own "
        f"reward(images [B,3,H,W] in [0,1]) -> [B]"
    )


def _reward_options(spec: str) -> dict[str, str]:
    """A built-in reward's options as texts, in order: ``"color:r=1,g=0.5"`` ->
    ``{"r": "1", "g": "0.5"}``.

    The one reader of a reward spec's options. Each option is ``key=value`` (a comma ends
    one; empty items are skipped), its key one the reward takes, and each key is given
    once: ``aesthetic:model=A,model=B`` is refused, not read as ``model=B``, as gradest's
    estimator specs refuse ``jagg:window=2,window=4``.

    Raises:
        RecipeConfigError: an option that is not ``key=value``, a key the reward does not
            take, or a key given twice (one line naming the setting, the key and the fix).
    """
    name, _, rest = spec.strip().partition(":")
    if name not in _OPTIONS:
        raise _bad(spec, f"{name!r} is not a built-in reward")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _OPTIONS[name]:
            allowed = ", ".join(_OPTIONS[name]) or "none"
            raise _bad(spec, f"{name!r} takes options {allowed}, got {item!r}")
        if key in options:
            raise RecipeConfigError(
                f"setting reward={spec!r} sets option {key!r} twice ({key}={options[key]!r} "
                f"and {key}={value.strip()!r}); give each option once"
            )
        options[key] = value.strip()
    return options


def resolve_reward(spec: str) -> Reward:
    """The reward callable for a ``reward`` setting (built-in name or ``module:function``)."""
    name, _, options = spec.strip().partition(":")
    if name in BUILTIN_REWARDS:
        kwargs: dict[str, Any] = {}
        for key, value in _reward_options(spec).items():
            try:
                kwargs[key] = _OPTIONS[name][key](value)
            except ValueError as err:
                raise _bad(spec, f"option {key}={value!r} is {err}") from None
        if name not in LEARNED_REWARDS:
            return BUILTIN_REWARDS[name](**kwargs)
        try:  # loads the weights: a missing file is one line naming it
            return BUILTIN_REWARDS[name](**kwargs)
        except RecipeConfigError as err:
            raise RecipeConfigError(f"setting reward={spec!r}: {err}") from None
    if not options:
        raise _bad(spec, "not a built-in reward and not of the form module:function")
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
        raise _bad(spec, f"cannot import {module_name!r} ({err})") from err
    function = getattr(module, attribute, None)
    if not callable(function):
        raise _bad(spec, f"{module_name!r} has no callable {attribute!r}")
    return function


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
