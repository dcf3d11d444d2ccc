"""Detecting NaN / Inf where it first appears, instead of in a poisoned ``.grad``.

The VJP engine checks every velocity, state gradient and parameter gradient it
produces, the adjoint sweep checks each adjoint, and objectives check losses and their
gradients. The first non-finite tensor raises :class:`NonFiniteError` naming the tensor
and the sampling step(s); ``estimate``/``backward`` add the estimator and either re-raise
(``on_nonfinite="raise"``, the default) or return an estimate marked unusable with
``.grad`` untouched (``on_nonfinite="skip"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from gradest.errors import GradestError

ON_NONFINITE = ("raise", "skip")
_HALF = (torch.float16, torch.bfloat16)


class NonFiniteError(GradestError, ValueError):
    """A NaN or Inf appeared in an estimate.

    Attributes:
        tensor: what was non-finite ("velocity", "adjoint", "parameter gradient", ...).
        steps: the sampling steps it was computed at (empty if not step-specific).
        times: the flow times of those steps.
        estimator: the estimator that was running (filled in by ``estimate``).
    """

    def __init__(self, tensor: str, *, times: Sequence[float] = (), steps: Sequence[int] = ()):
        self.tensor = tensor
        self.times = tuple(float(t) for t in times)
        self.steps = tuple(steps)
        self.estimator = ""
        super().__init__(self._message())

    def locate(self, flow_times: Tensor, estimator: str) -> NonFiniteError:
        """Translate times to step indices on ``flow_times`` and record the estimator."""
        if self.times and not self.steps:
            grid = flow_times.tolist()
            self.steps = tuple(
                min(range(len(grid) - 1), key=lambda k: abs(grid[k] - t)) for t in self.times
            )
        self.estimator = estimator
        self.args = (self._message(),)
        return self

    def _message(self) -> str:
        where = ""
        if self.steps:
            where = (
                f" at step {self.steps[0]}"
                if len(self.steps) == 1
                else f" at steps {list(self.steps)}"
            )
        elif self.times:
            where = f" at t={', '.join(f'{t:g}' for t in self.times)}"
        by = f" in estimator {self.estimator}" if self.estimator else ""
        return (
            f"non-finite (NaN/Inf) {self.tensor}{where}{by}; check the model and loss for "
            f"overflow (lower the learning rate, use float32/bfloat16 autocast carefully), or "
            f"pass on_nonfinite='skip' to drop such estimates"
        )


def _all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element is finite, at the cost of one sum per tensor.

    A sum is non-finite iff an element is (NaN and Inf propagate), except when finite
    values overflow the sum; half-precision tensors are summed in float32 so that cannot
    happen for them, and a non-finite sum is confirmed element-wise before reporting.
    ``isfinite(t).all()`` directly is ~20x slower on CPU, which showed in wall time.
    """
    items = list(tensors)
    if not items:
        return True
    sums = torch.stack(
        [
            (t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum()).to(torch.float64)
            for t in items
        ]
    )
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in items)


def check_finite(
    value: Tensor | Mapping[str, Tensor], tensor: str, times: Sequence[float] = ()
) -> None:
    """Raise :class:`NonFiniteError` if ``value`` (a tensor or a gradient dict) has NaN/Inf.

    For ``[M, B, ...]`` stacked values with ``M`` times, only the offending rows' times
    are reported.
    """
    if isinstance(value, Tensor):
        if _all_finite([value]):
            return
        if len(times) > 1 and value.shape[0] == len(times):
            bad = [t for t, row in zip(times, value, strict=True) if not _all_finite([row])]
            raise NonFiniteError(tensor, times=bad)
        raise NonFiniteError(tensor, times=times)
    if not _all_finite(value.values()):
        names = [n for n, g in value.items() if not _all_finite([g])]
        raise NonFiniteError(
            f"{tensor} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})", times=times
        )
