"""An example gradest plugin: ``sdo_mean``, the mean of K independent SDO draws.

Installing this package registers the estimator under the ``gradest.estimators``
entry-point group (see ``pyproject.toml``). The estimator class carries its own dense
definition (``MeanOfSdoDraws.definition``), so ``gradest check`` verifies it.
"""

from gradest_example_plugin.estimator import MeanOfSdoDraws, SdoMeanDecisions

__all__ = ["MeanOfSdoDraws", "SdoMeanDecisions"]
