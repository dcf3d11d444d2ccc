"""A weighted sum of rewards: ``reward = "0.7*pickscore:model=PATH + 0.3*brightness"``.

The reward is ``sum_i w_i * r_i(images, prompts)``, one value per image ``[B]``, as
Flow-GRPO's ``multi_score(device, {"pickscore": 1.0, "aesthetic": 0.5})`` adds its scores
(weights as given, not normalised). Each term is resolved exactly as a single ``reward``
setting (:func:`gradest_recipes.rewards.resolve_reward`): its own options, model and
preprocessing, and its gradient reaches the pixels as it does alone.

The syntax, and why it cannot be mistaken for a single reward:

* Terms are joined by a ``+`` with whitespace on both sides (``a + b``). A ``+`` touching
  other text is part of a name or path, as in LAION's aesthetic head
  ``sac+logos+ava1-l14-linearMSE.pth``, so every single reward written before still reads
  as before (a value holding `` + ``, a plus between spaces, would now split).
* A term is ``WEIGHT*REWARD`` or just ``REWARD`` (weight 1). The weight is the text before
  the first ``*`` when that ``*`` comes before the term's first ``:``: a ``*`` in an
  option value (after the ``:``) is never read as a weight. Spaces around the ``*`` are
  allowed; the weight is any finite float (``0.5``, ``-0.1``, ``1e-3``).

Decided (each refusal is one :class:`RecipeConfigError` line naming the term by its
position and saying the fix, before any reward model loads):

* Negative weights are allowed: a term to penalise (``pickscore:model=P + -0.1*contrast``).
  A zero weight is allowed for a term to watch, not train (its values are still computed
  and reported by :meth:`WeightedReward.take_term_means`); all weights zero is refused.
* The same reward twice (same name and options, in any order and spelling of its numbers)
  is refused, not summed: a repeated term is most likely a copy-paste slip, and for a
  learned reward it would load the model twice. The line gives the summed weight to use.

This module only parses and adds; :mod:`gradest_recipes.rewards` resolves each term (so
neither imports the other both ways).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import attrs
from torch import Tensor

from gradest import InvalidValue
from gradest_recipes.errors import RecipeConfigError

__all__ = ["TermSpec", "WeightedReward", "WeightedTerm", "parse_reward_sum", "term_labels"]

# A ``+`` with whitespace (or the spec's start / end) on both sides: the start and end
# count so that a dangling ``brightness +`` or ``+ brightness`` shows as an empty term
# instead of a reward named ``brightness +``.
_SEPARATOR = re.compile(r"(?:(?<=\s)|^)\+(?=\s|$)")
_EXAMPLE = "'0.7*pickscore:model=PATH + 0.3*brightness'"


@attrs.frozen
class TermSpec:
    """One term of a weighted ``reward`` setting, as written.

    Attributes:
        position: 1-based, for messages (``term 2``).
        text: the term as written, without surrounding whitespace.
        weight: the finite weight (1.0 when the term has none).
        spec: the reward after the weight, a single ``reward`` setting.
    """

    position: int
    text: str
    weight: float
    spec: str


def _refuse(setting: str, why: str) -> RecipeConfigError:
    return RecipeConfigError(f"setting reward={setting!r} is invalid: {why}")


def _weight(setting: str, position: int, text: str, written: str) -> float:
    """The weight ``written`` before a term's ``*``, checked finite (one line if not)."""
    where = f"term {position} {text!r}"
    fix = "write WEIGHT*REWARD with a finite number, e.g. '0.5*brightness', or no 'WEIGHT*' for 1"
    if not written.strip():
        raise _refuse(setting, f"{where} has no weight before '*'; {fix}")
    try:
        weight = float(written)
    except ValueError:
        raise _refuse(
            setting, f"{where} has weight {written.strip()!r}, not a number; {fix}"
        ) from None
    if not math.isfinite(weight):
        raise _refuse(setting, f"{where} has weight {weight}, not a finite number; {fix}")
    return weight


def parse_reward_sum(setting: str) -> list[TermSpec] | None:
    """The terms of a weighted ``reward`` setting, or ``None`` for a single reward.

    ``None`` (read as before, by :func:`gradest_recipes.rewards.resolve_reward`) when the
    setting has no `` + `` separator and no ``WEIGHT*`` prefix. Otherwise every term is
    parsed, but no reward is looked up: that is the resolver's part.

    Raises:
        RecipeConfigError: an empty term (``brightness + ``), a weight that is empty
            (``*brightness``), not a number or not finite (``nan*brightness``), or a term
            with a weight and no reward (``0.5*``).
    """
    parts = _SEPARATOR.split(setting)
    if len(parts) == 1 and "*" not in setting.partition(":")[0]:
        return None
    terms = []
    for position, part in enumerate(parts, start=1):
        text = part.strip()
        if not text:
            raise _refuse(
                setting,
                f"term {position} of {len(parts)} is empty; join rewards as [WEIGHT*]REWARD "
                f"with ' + ' between them, e.g. {_EXAMPLE}",
            )
        weight, spec = 1.0, text
        if "*" in text.partition(":")[0]:
            written, _, spec = text.partition("*")
            weight, spec = _weight(setting, position, text, written), spec.strip()
            if not spec:
                raise _refuse(
                    setting,
                    f"term {position} {text!r} names no reward after '*'; write "
                    f"WEIGHT*REWARD, e.g. '{written.strip()}*brightness'",
                )
        terms.append(TermSpec(position=position, text=text, weight=weight, spec=spec))
    if all(term.weight == 0 for term in terms):
        raise _refuse(
            setting,
            "every term has weight 0, so the reward is 0 for every image; give at least "
            "one term a nonzero weight",
        )
    return terms


def term_labels(names: Sequence[str]) -> list[str]:
    """Log-friendly labels of the terms: each name made of word characters (``_`` for
    the rest), and ``name_<position>`` for a name more than one term shares (two
    ``color`` terms: ``color_1``, ``color_2``)."""
    clean = [re.sub(r"\W+", "_", name).strip("_") or "reward" for name in names]
    return [
        f"{label}_{position}" if clean.count(label) > 1 else label
        for position, label in enumerate(clean, start=1)
    ]


@attrs.frozen
class WeightedTerm:
    """One resolved term of a :class:`WeightedReward`.

    Attributes:
        weight: its finite weight.
        spec: the single ``reward`` setting it was resolved from.
        label: its name in :meth:`WeightedReward.take_term_means` (unique in the sum).
        reward: the reward callable, ``reward(images) -> [B]`` (or with ``prompts=``).
        takes_prompts: whether ``reward`` is passed the batch's prompts.
    """

    weight: float
    spec: str
    label: str
    reward: Callable[..., Tensor]
    takes_prompts: bool


class WeightedReward:
    """``images [B, 3, H, W], prompts -> sum_i w_i * r_i(images[, prompts])`` in float32.

    A reward like any other to :func:`~gradest_recipes.rewards.reward_objective` and the
    RL recipes' ``per_sample_reward``: it takes ``prompts`` (so it is always given them)
    and hands them to the terms that take them. Each term must return a tensor ``[B]``
    or a scalar (then the same value for every image), checked per term, so a term of
    shape ``[B, 1]`` is refused by name instead of broadcasting the sum to ``[B, B]``.
    The sum is ``[B]``, or a scalar when every term is one (as that single reward's
    value would be).

    Each term's unweighted values are also added up, detached, on the images' device (no
    host sync per call): :meth:`take_term_means` reads and resets them, for a log record
    with one column per term beside the total.
    """

    def __init__(self, terms: Sequence[WeightedTerm]) -> None:
        if not terms:
            raise ValueError("a weighted reward needs at least one term")
        self.terms: tuple[WeightedTerm, ...] = tuple(terms)
        self._sums: list[Tensor | None] = [None] * len(self.terms)
        self._count = 0

    def __repr__(self) -> str:
        shown = " + ".join(f"{term.weight!r}*{term.spec}" for term in self.terms)
        return f"WeightedReward({shown!r})"

    def __call__(self, images: Tensor, prompts: Sequence[str] | None = None) -> Tensor:
        batch = images.shape[0]
        total: Tensor | None = None
        for index, term in enumerate(self.terms):
            values = (
                term.reward(images, prompts=prompts) if term.takes_prompts else term.reward(images)
            )
            if not isinstance(values, Tensor) or tuple(values.shape) not in ((), (batch,)):
                raise InvalidValue(
                    f"reward term {index + 1} {term.spec!r} returned "
                    f"{type(values).__name__} of shape {tuple(getattr(values, 'shape', ()))}; "
                    f"each term returns a tensor [B] = [{batch}] (one value per image) or a "
                    f"scalar"
                )
            # The sum runs in float32 whatever dtype autocast gave each term.
            values = values.float()
            weighted = term.weight * values
            total = weighted if total is None else total + weighted
            # A scalar term is that value for every image of the batch.
            seen = values.detach().sum() * (1 if values.ndim else batch)
            previous = self._sums[index]
            self._sums[index] = seen if previous is None else previous + seen.to(previous)
        self._count += batch
        assert total is not None  # at least one term (checked in __init__)
        return total

    def take_term_means(self) -> dict[str, float]:
        """Each term's mean unweighted reward over every image scored since the last call,
        by label (empty when nothing was scored); resets the sums.

        Counts every call: the rollouts of a GRPO step, and for an estimator that scores
        other points than the step's samples (``draft_lv``'s re-noised copies) those too.
        """
        if self._count == 0:
            return {}
        means = {
            term.label: float(total) / self._count
            for term, total in zip(self.terms, self._sums, strict=True)
            if total is not None
        }
        self._sums = [None] * len(self.terms)
        self._count = 0
        return means
