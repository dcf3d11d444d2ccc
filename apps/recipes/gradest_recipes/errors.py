"""The recipes' error type, in a module of its own.

Both the settings (:mod:`~gradest_recipes.config`) and the rewards
(:mod:`~gradest_recipes.rewards`) raise it, and the settings ask the rewards which names
are built in: with the error here, neither imports the other for it
(tests/test_import_cycles.py).
"""

from __future__ import annotations

from gradest import InvalidValue

__all__ = ["RecipeConfigError"]


class RecipeConfigError(InvalidValue):
    """A recipe setting has a value the recipe cannot use (the message names it)."""
