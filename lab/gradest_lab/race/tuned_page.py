"""``report.md`` of a tuned race (:class:`gradest_lab.race.tuned_race.TunedRaceReport`).

Every number on the page comes from the report's :meth:`summary`, which recomputes it from
the raw runs; nothing here computes a statistic of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gradest_lab.race.decision_rule import (
    RULE,
    RuleCell,
    missing_estimators,
    score_rule,
    tally_sentence,
)
from gradest_lab.race.horizon import horizon_sentence
from gradest_lab.race.plain_race import REFERENCE, _num, _seed_text
from gradest_lab.race.shards import lr_label


def format_lr(lr: float | None) -> str:
    """A learning rate as the tables show it (``0.00025``, ``0.000403``: every rate a race
    tries has at most 3 significant digits)."""
    return "-" if lr is None else f"{lr:.3g}"


def format_gap(gap: float | None) -> str:
    """A residual tuning gap as the tables show it (``-`` where not measurable)."""
    return "-" if gap is None else f"{gap:.2g}"


def _interval(interval: Mapping[str, Any], spec: str = ".4g") -> str:
    low, high = _num(interval["low"], spec), _num(interval["high"], spec)
    return f"{_num(interval['mean'], spec)} [{low}, {high}]"


def _signed(interval: Mapping[str, Any]) -> str:
    return _interval(interval, "+.3g")


def _steps(value: float) -> str:
    return f"{value:.3g}"


def _time_cell(entry: Mapping[str, Any]) -> str:
    n = len(entry["per_seed"])
    compute = entry["compute"]
    if entry["reached"] < n:
        return f"not reached ({entry['reached']}/{n})"
    return f"{_interval(compute, '.3g')} ({n}/{n})"


def tuned_race_markdown(report: Any) -> str:
    """The page: settings, the decision table, time to target, reward per budget, tuning."""
    config, summary = report.config, report.summary()
    fractions = config["fractions"]
    ceiling = summary["ceiling"]
    gain = ceiling["attainable_gain"]
    specs = config["estimators"]
    budget = config["budget_exact_steps"]
    lrs = ", ".join(format_lr(lr) for lr in config["lrs"])
    task_ceiling = ceiling["task_ceiling"]
    targets = " / ".join(
        f"{100 * float(level):g}% -> {summary['targets'][level]:.4g}"
        for level in summary["targets"]
    )
    lines = [
        f"# Tuned race: {config['task']}",
        "",
        f"Budget {budget:.3g} exact steps = {config['budget']:.4g} backward FLOPs (one forward "
        f"{config['forward_flops'] / 1e6:.3g} MFLOP; an exact step "
        f"{config['exact_step_model_units']:.4g} forward-equivalents). Every estimator runs at "
        f"its own learning rate, chosen from the grid {{{lrs}}}{_refinement_text(report)} on "
        f"the tuning seeds {_seed_text(config['tune_seeds'])} and reported on the disjoint seeds "
        f"{_seed_text(config['seeds'])} ({len(config['seeds'])} seeds). Task settings: "
        + ", ".join(f"{k}={v!r}" for k, v in config["task_settings"].items())
        + f". Reward and drift on one fixed evaluation set of {config['eval_samples']} samples, "
        f"at {', '.join(f'{f:g}' for f in fractions)} of the budget.",
        "",
        f"Pretrained reward {report.initial['reward']:.4g}. Ceiling (attainable reward) "
        f"{ceiling['value']:.4g}: the pretrained reward plus the attainable gain "
        f"{_interval(gain['gain'])}, measured apart from the report: `{ceiling['spec']}` at lr "
        f"{format_lr(ceiling['lr'])} (the best mean final reward of the grid's tuning runs) "
        f"run for {ceiling['budget_exact_steps']:.3g} exact steps on tuning seeds "
        f"{_seed_text(ceiling['seeds'])}, "
        + (
            "evaluated on the task's evaluation set apart from the report's (other noise, "
            "other held-out draws)"
            if ceiling["evaluation"] == "apart"
            else "evaluated on the report's own evaluation set (the task has no other)"
        )
        + f"; per run, the mean of its last {gain['settled_points']} of "
        f"{len(report.ceiling_rows[0]['curve'])} evaluations minus the pretrained reward on "
        f"that set (over those last evaluations the runs still rose by {gain['rise']:+.3g} "
        f"on average against the ones before)"
        + (
            f" (the task states {task_ceiling:.4g})."
            if isinstance(task_ceiling, int | float)
            else "."
        )
        + f" Targets (share of this attainable gain -> reward): {targets}.",
        "",
        f"Means over the report seeds; [low, high] are 95% percentile bootstrap intervals "
        f"({config['bootstrap']['resamples']} resamples of the seeds, fixed seed); differences "
        f"and ratios to `{REFERENCE}` are paired by seed, each estimator at its own chosen lr. "
        f"An estimator is ahead of (behind) `{REFERENCE}` only when the interval lies above "
        f"(below) zero by more than the margin: the two estimators' residual tuning gaps (the "
        f"reward a finer lr could still add, from a quadratic fit in log lr to the tuning "
        f"means around the choice). Compute in exact training steps.",
    ]
    lines += ["", "## Horizon", "", horizon_sentence(config["task"], summary["horizon"])]
    if summary["warnings"]:
        lines += ["", "## Not ready to quote", ""]
        lines += [f"- {note}" for note in summary["warnings"]]
    lines += [
        "",
        "## Decision: who beats exact at equal compute",
        "",
        *decision_table(summary),
        "",
        *rule_section(report, summary),
        "",
        "## Time to target (exact steps of compute, at the lr chosen for "
        f"{100 * config['primary_level']:g}%)",
        "",
        *time_to_target_table(config, summary),
    ]
    lines += [
        "",
        "Per seed the first crossing of the target, linearly interpolated between evaluation "
        "points; the mean and interval need every seed to reach it, and a ratio needs every "
        "seed of both estimators to.",
        "",
        "## Reward at each budget (each estimator at its lr for that budget; Δ: minus exact, "
        "paired)",
        "",
        "| estimator | " + " | ".join(f"{_steps(f * budget)} steps" for f in fractions) + " |",
        "|---|" + "---|" * len(fractions),
    ]
    for spec in specs:
        cells = []
        for point in summary["final"][spec]:
            cell = _num(point["reward"]["mean"])
            if spec != REFERENCE:
                above = f"{point['seeds_above_exact']}/{point['reward']['n']} above"
                cell += (
                    f" (Δ {_signed(point['reward_minus_exact'])}, margin "
                    f"{format_gap(point['margin'])}, {above})"
                )
            cells.append(cell)
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Chosen learning rates and drift",
        "",
        "| estimator | lr per budget ("
        + ", ".join(_steps(f * budget) for f in fractions)
        + " steps) | residual tuning gap per budget "
        "| final reward [CI] | drift at the full budget [CI] | steps in budget |",
        "|---|---|---|---|---|---|",
    ]
    for spec in specs:
        last = summary["final"][spec][-1]
        chosen = ", ".join(format_lr(p["lr"]) for p in summary["final"][spec])
        gaps = ", ".join(format_gap(p["residual_gap"]) for p in summary["final"][spec])
        lines.append(
            f"| `{spec}` | {chosen} | {gaps} | {_interval(last['reward'])} | "
            f"{_interval(last['drift'])} | {_num(last['steps']['mean'], '.3g')} |"
        )
    every_lr = sorted({lr for spec in specs for lr in report.tried_lrs(spec)})
    lines += [
        "",
        f"## Tuning: mean final reward on the tuning seeds ({len(config['tune_seeds'])}) per lr",
        "",
        "The chosen lr for the full budget is in bold; * marks the one chosen for time to "
        f"{100 * config['primary_level']:g}% (mean compute to it on the tuning seeds in brackets "
        "when every tuning seed reached it); - where the estimator was not run at that lr (the "
        "grid's rates are run by all, the refinement's only beside each estimator's choices).",
        "",
        "| estimator | " + " | ".join(format_lr(lr) for lr in every_lr) + " |",
        "|---|" + "---|" * len(every_lr),
    ]
    for spec in specs:
        tuning = summary["tuning"][spec]
        chosen = tuning["chosen"]
        cells = []
        for lr in every_lr:
            entry = tuning["per_lr"].get(lr_label(lr))
            if entry is None:
                cells.append("-")
                continue
            text = _interval(entry["final_reward"])
            if lr == chosen["by_fraction"][-1]:
                text = f"**{text}**"
            time_mean = entry["time_to_primary"]["mean"]
            if time_mean is not None and math.isfinite(time_mean):
                text += f" ({time_mean:.3g})"
            if lr == chosen["primary"]:
                text += " *"
            cells.append(text)
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def estimator_names(entries: list[dict[str, Any]], with_ci: bool) -> str:
    """Backticked specs of a decision row's entries, each with its paired interval."""
    if not entries:
        return "none"
    if with_ci:
        return "; ".join(
            f"`{e['spec']}` {_signed(e['minus_exact'])}" + _margin_text(e) for e in entries
        )
    return ", ".join(f"`{e['spec']}`" for e in entries)


def _margin_text(entry: Mapping[str, Any]) -> str:
    margin = entry.get("margin")
    return "" if not margin else f" (margin {format_gap(margin)})"


def refinement_state(report: Any) -> str:
    """How far the race's lrs were refined, in words: ``refined until bracketed at 1.26x``
    only when every choice is; else what is missing."""
    ratio = report.config.get("bracket_ratio")
    if ratio is None:
        return "not refined"
    if any(choice["unbracketed"] for choice in report.choices().values()):
        return f"refined toward a {ratio:g}x bracket, not every choice bracketed yet"
    return f"refined until bracketed at {ratio:g}x"


def _refinement_text(report: Any) -> str:
    return f" ({refinement_state(report)})"


def decision_table(summary: Mapping[str, Any], fractions: list[float] | None = None) -> list[str]:
    """The decision table's lines: per budget (all, or those ``fractions``), who beats exact
    at equal compute (the paired interval above the margin of the two residual tuning
    gaps), who falls behind (below minus the margin), who neither."""
    lines = [
        "| budget (exact steps) | exact: lr, share of attainable gain | beat exact: Δ reward "
        "[95% CI] (margin) | no clear difference | behind exact |",
        "|---|---|---|---|---|",
    ]
    for row in summary["decision"]:
        if fractions is not None and row["fraction"] not in fractions:
            continue
        share = row["exact_share_of_attainable"]
        exact_cell = f"{format_lr(row['exact_lr'])}, " + (
            "-" if share is None else f"{100 * share:.1f}%"
        )
        lines.append(
            f"| {_steps(row['budget_exact_steps'])} | {exact_cell} | "
            f"{estimator_names(row['beats_exact'], True)} | "
            f"{estimator_names(row['no_clear_difference'], False)} | "
            f"{estimator_names(row['behind_exact'], False)} |"
        )
    return lines


def rule_section(report: Any, summary: Mapping[str, Any]) -> list[str]:
    """The page's section on the rule for a task not raced
    (:data:`gradest_lab.race.decision_rule.RULE`): scored on this race, budget by budget,
    when the race can score it (raced after the rule was written, with both estimators the
    rule prefers); else why it cannot. ``summary``: the report's ``summary()``."""
    lines = [
        "## The rule for a task not raced",
        "",
        f"> {RULE.text}",
        "",
        f"Written on {RULE.written} from the short-horizon races committed then "
        "(`gradest_lab.race.decision_rule.RULE`, never edited after the fact). Scored per "
        "budget: confirmed where the estimator it prefers there is ahead of exact in the "
        "table above, not confirmed where level, refuted where behind.",
        "",
    ]
    if report.config.get("identity") in RULE.raced_before:
        return [
            *lines,
            "This race was committed before the rule was written (the rule was drawn from "
            "the races of that date), so it does not score it.",
        ]
    missing = missing_estimators(report)
    if missing:
        return [
            *lines,
            "This race cannot score it: it did not run "
            + " or ".join(f"`{spec}`" for spec in missing)
            + " (add it to `--estimators` to score the rule).",
        ]
    cells = score_rule(report, summary=summary)
    lines += [
        f"On this race: {tally_sentence(cells, 'budgets')}"
        + (
            " (provisional: the race is not ready to quote, above)." if summary["warnings"] else "."
        ),
        "",
        *rule_score_table([(None, cell) for cell in cells]),
    ]
    return lines


def rule_score_table(cells: Sequence[tuple[str | None, RuleCell]]) -> list[str]:
    """The rule's score as table lines, one row per (task label, cell): with a task column
    when the cells carry labels (several races, as the docs quote it), without one when
    they do not (one race's page)."""
    labelled = any(label is not None for label, _ in cells)
    task_head, task_rule = ("| task ", "|---") if labelled else ("", "")
    lines = [
        f"{task_head}| budget (exact steps) | the rule prefers | its verdict against exact "
        "| outcome |",
        f"{task_rule}|---|---|---|---|",
    ]
    for label, cell in cells:
        task = f"| `{label}` " if labelled else ""
        lines.append(
            f"{task}| {_steps(cell.budget_exact_steps)} | `{cell.prefers}` | {cell.verdict} | "
            f"{cell.outcome} |"
        )
    return lines


def time_to_target_table(
    config: Mapping[str, Any], summary: Mapping[str, Any], specs: list[str] | None = None
) -> list[str]:
    """The time-to-target table's lines (every estimator, or those ``specs``)."""
    levels = config["levels"]
    primary = f"{config['primary_level']:g}"
    lines = [
        "| estimator | lr (tuning gap, steps) | "
        + " | ".join(f"to {100 * level:g}% [CI] (seeds reached)" for level in levels)
        + f" | ratio to exact at {100 * config['primary_level']:g}% [CI] |",
        "|---|---|" + "---|" * len(levels) + "---|",
    ]
    for spec in config["estimators"] if specs is None else specs:
        entry = summary["time_to_target"][spec]
        cells = [_time_cell(entry["levels"][f"{level:g}"]) for level in levels]
        ratio = entry["levels"][primary]["ratio_to_exact"]
        if spec == REFERENCE:
            ratio_cell = "-"
        elif ratio is None:
            ratio_cell = "undefined (a seed did not reach it)"
        else:
            ratio_cell = _interval(ratio, ".3g")
        lines.append(
            f"| `{spec}` | {format_lr(entry['lr'])} ({format_gap(entry.get('residual_gap'))}) | "
            + " | ".join(cells)
            + f" | {ratio_cell} |"
        )
    return lines


def task_labels(configs: list[Mapping[str, Any]]) -> list[str]:
    """A short label per race: its task's name and the settings in which it differs from the
    other races of the same task (``digits target=5``), so a matrix row says what varied."""
    labels = []
    for config in configs:
        same_task = [c["task_settings"] for c in configs if c["task"] == config["task"]]
        varied = [
            key
            for key, value in config["task_settings"].items()
            if key != "device" and any(other.get(key) != value for other in same_task)
        ]
        settings = " ".join(f"{key}={config['task_settings'][key]}" for key in varied)
        labels.append(f"{config['task']} {settings}".strip())
    return labels


def matrix_table(reports: list[Any], fractions: list[float]) -> list[str]:
    """The decision across tasks: per race (a task) and budget fraction, who beats exact at
    equal compute, each at its tuned lr for that budget, and by how much; "none" where no
    estimator does. A race not ready to quote (its report's ``grid_warnings``) has its rows
    marked provisional, so the table never passes its verdicts off as settled. The lines of
    a markdown table."""
    lines = [
        "| task | budget (exact steps) | exact's share of attainable gain | beat exact: Δ reward "
        "[95% CI] | behind exact |",
        "|---|---|---|---|---|",
    ]
    labels = task_labels([report.config for report in reports])
    for label, report in zip(labels, reports, strict=True):
        task = f"`{label}`" + (" (provisional)" if report.grid_warnings() else "")
        for row in report.summary()["decision"]:
            if row["fraction"] not in fractions:
                continue
            share = row["exact_share_of_attainable"]
            lines.append(
                f"| {task} | {_steps(row['budget_exact_steps'])} | "
                + ("-" if share is None else f"{100 * share:.1f}%")
                + f" | {estimator_names(row['beats_exact'], True)} | "
                f"{estimator_names(row['behind_exact'], False)} |"
            )
    return lines


def tally_table(reports: list[Any], fractions: list[float]) -> list[str]:
    """Per estimator and budget fraction, on how many of the races (tasks) that ran it it beat
    exact, fell behind, or neither: the decision table's prediction for a task not raced."""
    verdicts: dict[str, dict[float, list[str]]] = {}
    for report in reports:
        for row in report.summary()["decision"]:
            if row["fraction"] not in fractions:
                continue
            for key, word in (
                ("beats_exact", "ahead"),
                ("no_clear_difference", "level"),
                ("behind_exact", "behind"),
            ):
                for entry in row[key]:
                    verdicts.setdefault(entry["spec"], {}).setdefault(row["fraction"], [])
                    verdicts[entry["spec"]][row["fraction"]].append(word)
    lines = [
        "| estimator | "
        + " | ".join(f"at {100 * f:g}% of the budget: ahead / level / behind" for f in fractions)
        + " |",
        "|---|" + "---|" * len(fractions),
    ]
    for spec, by_fraction in verdicts.items():
        cells = []
        for fraction in fractions:
            words = by_fraction.get(fraction, [])
            cells.append(
                f"{words.count('ahead')} / {words.count('level')} / {words.count('behind')}"
                f" of {len(words)}"
            )
        lines.append(f"| `{spec}` | " + " | ".join(cells) + " |")
    return lines
