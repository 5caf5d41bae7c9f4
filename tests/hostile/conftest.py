"""Hypothesis profiles for the hostile-input fuzzer (tests/hostile/test_fuzz.py).

- `ci` (default): a few dozen examples per property; the whole fuzz file runs in well under
  a minute on two cores.
- `long` (HYPOTHESIS_PROFILE=long): 20,000 examples per property, no deadline; for fuzzing
  by hand or nightly, e.g. `HYPOTHESIS_PROFILE=long pytest tests/hostile/test_fuzz.py`.

tests/conftest.py registers profiles of the same names for the rest of the suite; these
registrations replace them when tests/hostile is collected (`ci` keeps its 40 examples, so
other tests are unaffected; `long` becomes 20,000 examples).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CI_EXAMPLES = 40
LONG_EXAMPLES = 20_000

settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "long",
    max_examples=LONG_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
