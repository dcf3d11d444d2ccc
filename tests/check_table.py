"""Reading ``gradest check``'s table back in tests: each estimator's spec on a line of its
own, its objectives' rows indented under it, each failure reason on a ``FAIL:`` line under
the row it belongs to."""

from __future__ import annotations


def check_rows(stdout: str) -> dict[str, list[str]]:
    """Per estimator spec, in the table's order, its objective rows (each row followed by
    its ``FAIL:`` reasons, joined on one string)."""
    lines = stdout.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith("estimator") and "decisions" in line
    )
    rows: dict[str, list[str]] = {}
    spec = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        if not line.startswith(" "):
            if " " in line.strip():
                break  # the verdict after the table
            spec = line.strip()
            rows[spec] = []
        elif spec is not None and line.strip().startswith("FAIL:") and rows[spec]:
            rows[spec][-1] += " " + line.strip()
        elif spec is not None:
            rows[spec].append(line.strip())
    return rows
