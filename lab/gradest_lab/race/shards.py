"""A tuned race's runs stored one file each: the (estimator, lr, seed) shards.

A tuned race (:mod:`gradest_lab.race.tuned_race`) runs every estimator at every grid
learning rate on the tuning seeds, then at its chosen rates on the report seeds. Each of
those runs is independent of the others (its own copy of the pretrained model, its own
optimizer and generators, a FLOPs budget that no other run's timing touches), so each is
stored on its own, as a **shard**: one small JSON file with the run's key, the identity of
the race it belongs to and its evaluated curve. Shards are what a long race is made of:

* **Committed and merged.** A folder of finished shards can be committed and copied to
  another machine; two machines that ran different shards of the same race give the union
  by copying files, and a shard whose file is there is never run again.
* **Resumed.** A run in progress keeps its state (model, optimizer, generators, the curve
  so far) after every evaluation point, under ``state/``; a rerun continues it, on the same
  machine, equal to an uninterrupted run.
* **Run by several processes.** A process claims a shard with a lock
  (:mod:`gradest_lab.storage.process_lock`) before running it; another process skips a claimed shard
  and comes back to it, and a lock left by a killed process is free and taken over.

Layout under a race folder (``<lr>`` is ``lr-1e-04``; ``task-lr`` where the task's own
optimizer settings are kept)::

    shards/<estimator>/<lr>/seed-<seed>.json   finished runs (commit these)
    state/<estimator>/<lr>/seed-<seed>.pt      a run in progress (this machine's)
    state/<estimator>/<lr>/seed-<seed>.lock    the process running it

**Identity.** A shard's numbers depend on the task and its settings, the budget, the
evaluation fractions and the evaluation set, and on its own key; not on which other shards
the race has (its grid, its seeds, its estimators: those can grow). The race identity is
a hash of the former, stored in every shard; a shard with another identity, another key or
a malformed body is refused in one line naming the file and the field, and left untouched.
A body is checked by :func:`gradest_lab.race.file_schemas.check_row` before any number of
it is used: JSON nested at most :data:`~gradest_lab.storage.json_text.MAX_JSON_DEPTH`
levels, every number finite, one curve point per budget fraction of the race (each at its
fraction), steps, FLOPs and seconds never going down, one step time per step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from gradest import InvalidValue
from gradest_lab.race.file_schemas import check_row
from gradest_lab.storage.file_schema import (
    describe,
    first_line,
    is_int,
    is_number,
    require_finite_numbers,
    require_object,
)
from gradest_lab.storage.files import atomic_write_text, refuse_symlinks
from gradest_lab.storage.json_text import parse_json
from gradest_lab.storage.process_lock import describe_holder, read_holder, try_lock

SHARD_SCHEMA = "gradest.race-shard/1"

__all__ = ["SHARD_SCHEMA", "ShardKey", "ShardStore", "lr_label", "race_identity"]


def lr_label(lr: float | None) -> str:
    """The folder name of a learning rate: ``lr-0.0001``; ``task-lr`` for the task's own."""
    return "task-lr" if lr is None else f"lr-{lr:.6g}"


def _spec_folder(spec: str) -> str:
    """A file-system-safe folder name for an estimator spec (the spec itself is inside the
    file, and checked, so two specs that share a folder name cannot be confused)."""
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", spec)
    return name if name not in ("", ".", "..") else f"_{name}"


def race_identity(settings: Mapping[str, Any]) -> str:
    """The hash of what a shard's numbers depend on (module docstring), as hex."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@attrs.frozen(order=True)
class ShardKey:
    """One run of a tuned race.

    Attributes:
        spec: the estimator spec.
        lr: the learning rate set on the task's optimizer (None: the task's own).
        seed: the seed of the run's data and draws.
    """

    spec: str
    lr: float | None
    seed: int

    def relative(self, suffix: str) -> Path:
        return Path(_spec_folder(self.spec), lr_label(self.lr), f"seed-{self.seed}{suffix}")

    def describe(self) -> str:
        lr = "the task's lr" if self.lr is None else f"lr {self.lr:g}"
        return f"{self.spec!r} at {lr}, seed {self.seed}"


@attrs.define(eq=False)
class ShardStore:
    """The shards of one race under ``root`` (``root/shards``, ``root/state``).

    Attributes:
        root: the race folder.
        identity: :func:`race_identity` of the race's settings.
        name: the shard folder's name (``"shards"``; the ceiling run has its own).
        fractions: the budget fractions every run of the store is evaluated at: a shard's
            curve must have one point at each. None where the reader does not know them
            (a look at committed shards): then the curve must be a finished run's, its
            fractions increasing in (0, 1] and ending at 1.
    """

    root: Path
    identity: str
    name: str = "shards"
    fractions: tuple[float, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v)
    )

    def result_path(self, key: ShardKey) -> Path:
        return self.root / self.name / key.relative(".json")

    def state_path(self, key: ShardKey) -> Path:
        return self.root / "state" / self.name / key.relative(".pt")

    def _lock_path(self, key: ShardKey) -> Path:
        return self.root / "state" / self.name / key.relative(".lock")

    def _check_no_links(self, key: ShardKey) -> None:
        """No component of the shard's paths under the race folder is a link."""
        for path in (self.result_path(key), self.state_path(key), self._lock_path(key)):
            relative = path.relative_to(self.root)
            components = [
                self.root / Path(*relative.parts[: i + 1]) for i in range(len(relative.parts))
            ]
            refuse_symlinks(components, what=f"race folder {str(self.root)!r}")

    def result(self, key: ShardKey) -> dict[str, Any] | None:
        """The finished run of ``key`` (its report row), or None when it has not run.

        Raises:
            InvalidValue: the file is not a shard of this race and this key (naming the
                file and the field); the file is left as it is.
        """
        path = self.result_path(key)
        self._check_no_links(key)
        if not path.exists():
            return None
        if not path.is_file():
            raise InvalidValue(f"{str(path)!r} is not a regular file; remove it to rerun the shard")
        try:
            data = parse_json(path.read_bytes())
        except (OSError, ValueError) as err:  # a UnicodeDecodeError is a ValueError
            raise InvalidValue(
                f"{str(path)!r} is not a readable race shard ({first_line(err)}); move it away "
                f"to rerun {key.describe()}"
            ) from None
        return self._checked(path, data, key)

    def _checked(self, path: Path, data: Any, key: ShardKey) -> dict[str, Any]:
        def refuse(field: str, why: str) -> InvalidValue:
            return InvalidValue(f"{str(path)!r}: {field} {why}; move the file away to rerun it")

        if not isinstance(data, dict):
            raise refuse("the file", f"holds {describe(data)}, not a shard object")
        if data.get("schema") != SHARD_SCHEMA:
            raise refuse("schema", f"is {data.get('schema')!r}, expected {SHARD_SCHEMA!r}")
        if data.get("identity") != self.identity:
            raise refuse(
                "identity",
                f"is {data.get('identity')!r}: a shard of another race (other task settings, "
                f"budget, fractions or evaluation set than this race's {self.identity!r})",
            )
        # The key by type as well as value: to Python, true == 1 and 1 == 1.0.
        lr = data.get("lr")
        same = {
            "spec": isinstance(data.get("spec"), str) and data.get("spec") == key.spec,
            "lr": lr is None if key.lr is None else is_number(lr) and lr == key.lr,
            "seed": is_int(data.get("seed")) and data.get("seed") == key.seed,
        }
        for field, ok in same.items():
            if not ok:
                expected = getattr(key, field)
                raise refuse(field, f"is {describe(data.get(field))}, not {expected!r}")
        require_object(data.get("environment", {}), refuse, "environment")
        # Written with allow_nan=False: a NaN or Infinity anywhere is not what a race wrote.
        require_finite_numbers(data, refuse)
        return check_row(data.get("row"), refuse, seed=key.seed, fractions=self.fractions)

    def save(self, key: ShardKey, row: Mapping[str, Any], environment: Mapping[str, Any]) -> Path:
        """Write the finished run ``row`` of ``key`` atomically (with the environment it ran
        in: torch, threads), and drop its state."""
        self._check_no_links(key)
        path = self.result_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "schema": SHARD_SCHEMA,
            "identity": self.identity,
            "spec": key.spec,
            "lr": key.lr,
            "seed": key.seed,
            "environment": dict(environment),
            "row": dict(row),
        }
        atomic_write_text(path, json.dumps(record, indent=1, allow_nan=False) + "\n")
        with contextlib.suppress(FileNotFoundError):
            self.state_path(key).unlink()
        return path

    @contextlib.contextmanager
    def claim(self, key: ShardKey) -> Iterator[bool]:
        """Hold the shard's lock while the body runs it: yields True when this process holds
        it, False when a live process does (skip the shard and come back to it). A killed
        process's lock is free (:mod:`gradest_lab.storage.process_lock`) and taken over."""
        self._check_no_links(key)
        lock_path = self._lock_path(key)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = try_lock(lock_path, command=f"gradest race --tune: {key.describe()}")
        if lock is None:
            yield False
            return
        with lock:
            yield True

    def holder(self, key: ShardKey) -> str | None:
        """Who holds the shard's lock (``pid N on HOST (...)``), or None."""
        info = read_holder(self._lock_path(key))
        return None if info is None else describe_holder(info)
