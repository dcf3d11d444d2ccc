"""A repeated key in a benchmark mode spec is refused (``--modes grpo:lr=1e-4,lr=3e-4``).

``rl_objectives_benchmark.parse_mode`` read ``grpo:lr=1e-4,lr=3e-4`` as ``lr=3e-4`` (the
last one won), so the benchmark ran and recorded a mode other than the one written. Now
it is one line naming the spec, the key and the fix, before the first run, as gradest's
estimator specs refuse ``jagg:window=2,window=4``.
"""

from __future__ import annotations

import pytest
from gradest_digits import rl_objectives_benchmark as bench


@pytest.mark.parametrize(
    ("spec", "key"),
    [("grpo:lr=1e-4,lr=3e-4", "lr"), ("grpo:kl=0.1,lr=3e-4,kl=0.1", "kl")],
)
def test_a_mode_option_given_twice_is_refused(spec: str, key: str) -> None:
    with pytest.raises(SystemExit) as refused:
        bench.parse_mode(spec)
    line = str(refused.value)
    assert "\n" not in line
    assert f"--modes {spec!r} sets {key!r} twice" in line and "give each key once" in line


def test_the_benchmark_refuses_it_before_any_run(tmp_path) -> None:
    out = tmp_path / "results"
    with pytest.raises(SystemExit, match="sets 'lr' twice"):
        bench.main(["--modes", "reward", "grpo:lr=1e-4,lr=3e-4", "--out", str(out)])
    assert not out.exists()
