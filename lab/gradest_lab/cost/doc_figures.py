"""``gradest cost`` figures in markdown pages, generated from the committed ``--json`` files.

The race numbers' rule (:mod:`gradest_lab.race.quoting`), for cost figures: a page quotes
the JSONs that ``python -m benchmarks.cost_presets`` writes (``gradest cost --json``, one
per preset and setting, in ``docs/results/cost_presets/``) in **generated blocks** ::

    <!-- cost-quote KIND ARGS -->
    <!-- /cost-quote -->

and, inside a sentence, in **generated figures** ::

    <!-- cost PRESET.SETTING PART QUANTITY -->29.7 GiB<!-- /cost -->

whose text is what the JSON gives. ``python -m gradest_lab.cost.doc_figures PAGE ...``
writes them; ``--check`` writes nothing and fails on any block or figure that differs
from its JSON, and on a memory or FLOP figure (a number with a unit: ``20.9 GiB``, ``855
TFLOP``) outside them, so no cost figure on a page escapes the check. The words around a
figure come from the JSON too where they name a setting: a table's columns are named by
each setting's recorded settings (training, gradient checkpointing, the VAE's, the
guidance, the dtype, the reward) and the command line that wrote it.

Blocks (``KIND``):

* ``table FOLDER preset=NAME settings=A,B,.. [flops=A,..]``: per estimator, the whole
  step's peak under each setting (the smallest of the ``--memory`` sizes it fits, the
  transformer's alone in brackets), the TFLOP of the ``flops`` settings, and a legend
  naming each setting's recorded settings and its command;
* ``presets FOLDER``: ``table`` for every preset with :data:`PRESET_SETTINGS` (the page's
  presets table, also ``table.md``);
* ``output FILE``: what the command printed for that JSON (its header, parts and table),
  after its command line.

Figures (``PART`` an estimator spec, or ``decoder`` / ``reward`` for a pixel part):
``peak`` / ``peak-max`` (the whole step's mean and largest peak), ``alone`` (the
transformer's peak), ``added`` (what the decode and the reward add to it), ``retained``,
``tflop``, ``fit`` (the smallest memory size it fits), ``ratio`` (FLOPs over exact's) and
``seconds``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gradest import InvalidValue
from gradest_lab.generated_pages import page_command
from gradest_lab.race.task_options import parse_key_values

__all__ = [
    "FOLDER",
    "figure",
    "page_problems",
    "presets_table",
    "render",
    "setting_words",
    "stray_figures",
    "update_page",
]

#: Where the figures' JSONs live, relative to the repository root.
FOLDER = "docs/results/cost_presets"
#: The presets table's settings (no CFG; the transformer's and the VAE's checkpointing
#: together), and the settings whose FLOPs it shows.
PRESET_SETTINGS = (
    "full.nocfg.vae",
    "full+gc.nocfg.vaegc",
    "lora16.nocfg.vae",
    "lora16+gc.nocfg.vaegc",
)
PRESET_FLOPS = ("full.nocfg.vae", "lora16.nocfg.vae")
PRESETS = ("sd3-medium", "sd3.5-large", "flux-dev", "sdxl-unet")

_BLOCK = re.compile(
    r"(?P<open><!-- cost-quote (?P<args>[^>]*?) -->\n)(?P<body>.*?)(?P<close><!-- /cost-quote -->)",
    re.S,
)
_FIGURE = re.compile(
    r"(?P<open><!-- cost (?P<args>[^>]*?) -->)(?P<body>[^<]*)(?P<close><!-- /cost -->)"
)
#: A memory or FLOP figure: a number and its unit.
_UNIT_FIGURE = re.compile(
    r"(?<![\w.])(?P<number>\d[\d,]*(?:\.\d+)?)\s?(?P<unit>[KMGT]iB|[KMGT]B|[kMGTP]FLOPs?)(?![\w])"
)
#: Device sizes (``--memory``'s defaults) are budgets, not figures: they may stand anywhere.
_BUDGETS = {"24", "48", "80"}


def _load(root: Path, path: str) -> dict[str, Any]:
    file = root / path
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InvalidValue(f"cost-quote: cannot read {path} ({err}); run python -m "
                           f"benchmarks.cost_presets --out {FOLDER}") from err  # fmt: skip


def _run(folder: Path, preset: str, setting: str) -> dict[str, Any]:
    return _load(folder, f"{preset}.{setting}.json")


def _gib(value: float) -> str:
    return f"{value / 2**30:,.1f}"


def _smallest_fit(payload: Mapping[str, Any], peak: float) -> str:
    fits = [label for label, limit in payload["memory"].items() if peak <= limit]
    return fits[0].replace("GiB", "") if fits else "none"


def _sizes(memory: Mapping[str, int]) -> str:
    """``24 / 48 / 80 GiB`` (the ``--memory`` labels)."""
    labels = list(memory)
    if all(label.endswith("GiB") for label in labels):
        return " / ".join(label[: -len("GiB")] for label in labels) + " GiB"
    return " / ".join(labels)


def _guidance_words(settings: Mapping[str, Any]) -> str:
    words = str(settings["guidance"]).split(" (", 1)[0]
    return "no CFG" if words == "none" else words.replace("cfg", "CFG")


def setting_words(settings: Mapping[str, Any]) -> str:
    """A run's recorded settings in words: what it trains, the transformer's and the VAE's
    checkpointing, the guidance, the dtype, the reward."""
    rank = settings.get("lora_rank")
    words = ["full fine-tuning" if rank is None else f"LoRA {rank}"]
    words.append("transformer GC" if settings["gradient_checkpointing"] else "no transformer GC")
    if settings.get("decoder") is not None:
        vae = "VAE GC" if settings["decoder_checkpointing"] else "VAE plain (no GC)"
        if settings.get("decoder_tile"):
            vae += f", {settings['decoder_tile']} px tiles"
        words.append(vae)
    rows = settings["rows_per_sample"]
    words.append(_guidance_words(settings) + f" ({rows} row{'s' if rows > 1 else ''} per sample)")
    words += [str(settings["dtype"]), f"batch {settings['batch']}", f"reward {settings['reward']}"]
    if settings.get("recipe_defaults"):
        words.append(f"the {settings['recipe_defaults']} recipe's defaults")
    return ", ".join(words)


# -- blocks ----------------------------------------------------------------------------------


def _table(folder: Path, preset: str, settings: Sequence[str], flops: Sequence[str]) -> str:
    runs = {s: _run(folder, preset, s) for s in settings}
    first = runs[settings[0]]
    lines = [
        f"{first['settings']['height']}x{first['settings']['width']}, "
        f"{first['settings']['steps']} steps, {first['settings']['prompt_tokens']} prompt "
        f"tokens. Cells: the whole step's peak GiB (the smallest of "
        f"{_sizes(first['memory'])} it fits), in brackets the transformer's alone (a "
        f"reward on the latents); TFLOP per training step, decode and reward included.",
        "",
        "| estimator | "
        + " | ".join([*(f"TFLOP `{s}`" for s in flops), *(f"`{s}`" for s in settings)])
        + " |",
        "|---|" + "---|" * (len(flops) + len(settings)),
    ]
    for spec in first["estimators"]:
        cells = [f"`{spec}`"]
        cells += [f"{runs[s]['estimators'][spec]['flops'] / 1e12:,.0f}" for s in flops]
        for setting in settings:
            est = runs[setting]["estimators"][spec]
            low, high = est["peak_range"]
            text = _gib(est["peak_bytes"])
            if high != low:
                text += f" (to {_gib(high)})"
            alone = est.get("transformer", est)["peak_bytes"]
            cells.append(f"{text} ({_smallest_fit(runs[setting], high)}) [{_gib(alone)}]")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for setting, payload in runs.items():
        lines.append(f"- `{setting}`: {setting_words(payload['settings'])}; `{payload['command']}`")
    return "\n".join(lines) + "\n"


def presets_table(folder: Path | str) -> str:
    """Every preset's ``table`` of :data:`PRESET_SETTINGS` (``table.md``, and the page's
    presets table)."""
    return "\n".join(
        f"#### {preset}\n\n" + _table(Path(folder), preset, PRESET_SETTINGS, PRESET_FLOPS)
        for preset in PRESETS
    )


def _output(root: Path, path: str) -> str:
    from gradest_lab.cost.command import format_report

    payload = _load(root, path)
    return f"```text\n$ {payload['command']}\n{format_report(payload)}\n```\n"


def _options(args: str, items: Sequence[str]) -> dict[str, str]:
    return parse_key_values(
        items, what=f"cost-quote {args!r}: option", fix="write key=value, e.g. preset=sd3-medium"
    )


def render(root: Path, args: str) -> str:
    """The text of the block ``<!-- cost-quote ARGS -->`` (``KIND PATH [key=value ...]``)."""
    words = args.split()
    if len(words) < 2 or words[0] not in ("table", "presets", "output"):
        raise InvalidValue(
            f"cost-quote {args!r}: give KIND PATH [key=value ...], KIND one of table, "
            f"presets, output"
        )
    kind, path, options = words[0], words[1], _options(args, words[2:])
    if kind == "output":
        return _output(root, path)
    if kind == "presets":
        return presets_table(root / path)
    settings = options["settings"].split(",")
    flops = options["flops"].split(",") if options.get("flops") else []
    return _table(root / path, options["preset"], settings, flops)


# -- figures in sentences ------------------------------------------------------------------------


def figure(root: Path, args: str) -> str:
    """The text of ``<!-- cost PRESET.SETTING PART QUANTITY -->``."""
    words = args.split()
    if len(words) != 3:
        raise InvalidValue(
            f"cost figure {args!r}: give PRESET.SETTING PART QUANTITY, e.g. "
            f"sd3-medium.recipe sdo peak"
        )
    run, part, quantity = words
    payload = _load(root, f"{FOLDER}/{run}.json")
    if quantity == "seconds":
        return f"{payload['seconds']:.0f} s"
    if part in payload["parts"]:
        entry = payload["parts"][part]
        values = {"peak": entry["peak_bytes"], "retained": entry["retained_bytes"]}
        if quantity == "tflop":
            return f"{entry['flops'] / 1e12:,.1f} TFLOP"
    elif part in payload["estimators"]:
        entry = payload["estimators"][part]
        values = {
            "peak": entry["peak_bytes"],
            "peak-max": entry["peak_range"][1],
            "alone": entry.get("transformer", entry)["peak_bytes"],
            "added": entry["peak_bytes"] - entry.get("transformer", entry)["peak_bytes"],
            "retained": entry["retained_bytes"],
        }
        if quantity == "tflop":
            return f"{entry['flops'] / 1e12:,.0f} TFLOP"
        if quantity == "fit":
            fit = _smallest_fit(payload, entry["peak_range"][1])
            return "none" if fit == "none" else f"{fit} GiB"
        if quantity == "ratio":
            return f"{entry['flops'] / payload['estimators']['exact']['flops']:.2f}x"
    else:
        raise InvalidValue(
            f"cost figure {args!r}: {run} has no estimator or part {part!r}; one of "
            f"{', '.join([*payload['estimators'], *payload['parts']])}"
        )
    if quantity not in values:
        raise InvalidValue(
            f"cost figure {args!r}: no quantity {quantity!r} for {part}; one of "
            f"{', '.join([*values, 'tflop', 'fit', 'ratio', 'seconds'])}"
        )
    value = values[quantity]
    if abs(value) < 0.1 * 2**30:  # a few MiB would read 0.0 GiB
        return f"{value / 2**20:,.1f} MiB"
    return f"{_gib(value)} GiB"


# -- pages -----------------------------------------------------------------------------------------


def update_page(root: Path, page: str) -> str:
    """The page with every generated block and figure rewritten from its JSON."""
    page = _BLOCK.sub(lambda m: m["open"] + render(root, m["args"]) + m["close"], page)
    return _FIGURE.sub(lambda m: m["open"] + figure(root, m["args"]) + m["close"], page)


def stray_figures(page: str) -> list[str]:
    """Memory and FLOP figures outside the generated blocks and figures (and outside code:
    a command's ``--memory 80GiB`` is a setting): each could be edited by hand unchecked.
    The device sizes 24, 48 and 80 GiB are budgets, not figures."""
    text = _BLOCK.sub(" ", page)
    text = _FIGURE.sub(" ", text)
    text = re.sub(r"(?ms)^```.*?^```", " ", text)
    text = re.sub(r"`[^`]*`", " ", text)
    return [
        f"{m['number']} {m['unit']}"
        for m in _UNIT_FIGURE.finditer(text)
        if not (m["number"] in _BUDGETS and m["unit"] == "GiB")
    ]


def page_problems(root: Path, page: str) -> list[str]:
    """What ``--check`` finds: a block or figure that differs from its JSON, and a memory
    or FLOP figure outside them."""
    problems = []
    if update_page(root, page) != page:
        problems.append("a cost-quote block or figure differs from its JSON")
    problems += [f"a cost figure outside a generated block: {item}" for item in stray_figures(page)]
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradest_lab.cost.doc_figures PAGES [--root ROOT] [--check]``."""
    return page_command(
        argv,
        prog="python -m gradest_lab.cost.doc_figures",
        description="Write (or --check) the gradest cost figures of pages from their JSONs.",
        problems_of=page_problems,
        updated=update_page,
        stale="a cost-quote block or figure differs from its JSON",
    )


if __name__ == "__main__":
    sys.exit(main())
