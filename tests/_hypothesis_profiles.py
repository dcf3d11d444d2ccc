"""Hypothesis profiles for gradest's property-based tests.

``ci`` (the default) runs few, derandomized examples so that every CI run tests the same
problems and the property files stay within about a minute on a 2-core box; ``long`` runs
many random examples for a local soak of the properties::

    GRADEST_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_properties.py

Test modules ``import _hypothesis_profiles`` (pytest puts ``tests/`` on ``sys.path``) and
scale their example counts with :func:`examples`. Registering profiles is global to the
process; loading the selected one here is idempotent.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV_VAR = "GRADEST_HYPOTHESIS_PROFILE"

# Building a model and its dense Jacobians takes tens of milliseconds per example, so
# hypothesis's "too slow" and "data too large" checks would flag ordinary examples.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci",
    max_examples=10,
    deadline=None,
    derandomize=True,  # the same examples on every run: reproducible CI
    database=None,  # nothing written to .hypothesis/ (derandomized runs never replay)
    print_blob=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "long",
    max_examples=400,
    deadline=None,
    print_blob=True,
    suppress_health_check=_QUIET,
)

PROFILE = os.environ.get(ENV_VAR, "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"{ENV_VAR}={PROFILE!r} is not a profile; use 'ci' (default) or 'long'")
settings.load_profile(PROFILE)


def examples(ci: int) -> settings:
    """Settings with ``ci`` examples under the ``ci`` profile, 40x as many under ``long``."""
    return settings(max_examples=ci if PROFILE == "ci" else 40 * ci)
