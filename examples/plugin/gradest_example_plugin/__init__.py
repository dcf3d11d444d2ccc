"""An example gradest plugin: ``sdo_mean``, the mean of K independent SDO draws.

Installing this package registers the estimator under the ``gradest.estimators``
entry-point group (see ``pyproject.toml``); importing it also teaches
``gradest.reference`` the estimator's dense definition, so ``gradest check`` verifies it.
"""

from gradest_example_plugin.definition import sdo_mean_definition
from gradest_example_plugin.estimator import MeanOfSdoDraws

__all__ = ["MeanOfSdoDraws", "sdo_mean_definition"]
