"""Compare estimators: cost measurements (and, later, bias, variance and reports)."""

from gradest.harness.cost import (
    count_flops,
    interleaved_wall_times,
    median_wall_time,
    peak_allocated_bytes,
    ratio,
    retained_activation_bytes,
    speedup,
)

__all__ = [
    "count_flops",
    "interleaved_wall_times",
    "median_wall_time",
    "peak_allocated_bytes",
    "ratio",
    "retained_activation_bytes",
    "speedup",
]
