"""Every ``gradest cost`` figure README.md and docs/cost.md quote comes from the committed
``--json`` files (``gradest_lab.cost.doc_figures``), and each JSON holds the settings its
name and the page say.

* The generated blocks (tables, the command's printed output) and the figures in
  sentences equal what their JSONs give; no memory or FLOP figure stands outside them.
* ``table.md`` is the presets table of the same JSONs.
* Each JSON's recorded settings are the ones its setting's name says (what trains,
  gradient checkpointing, CFG, the VAE's checkpointing, the dtype, the reward), the ones
  ``benchmarks/cost_presets.py`` asks for, and the ones its recorded command gives; the
  ``recipe`` JSONs are the recipes' defaults (``--recipe-defaults``).
* The recipes' default figure is the one the page quotes for each preset.
* A number edited by hand, in a table, in the printed output or in a sentence, or a
  figure written outside the generated text, fails (on copies of the page).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

import pytest
from gradest_lab.cost import doc_figures
from gradest_lab.cost.command import add_arguments, resolve_options
from gradest_lab.cost.diffusers_presets import PRESETS
from gradest_lab.cost.recipe_defaults import cost_options, recipe_family

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / doc_figures.FOLDER
PAGE = ROOT / "docs" / "cost.md"
PAGES = [ROOT / "README.md", PAGE]
JSONS = sorted(FOLDER.glob("*.json"))


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "cost_presets_benchmark", ROOT / "benchmarks" / "cost_presets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def presets_script():
    return _benchmark()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_pages_cost_figures_are_the_jsons(page: Path) -> None:
    assert doc_figures.page_problems(ROOT, page.read_text(encoding="utf-8")) == []


def test_the_command_checks_the_page() -> None:
    assert doc_figures.main([str(PAGE), "--root", str(ROOT), "--check"]) == 0


def test_table_md_is_the_presets_table() -> None:
    assert (FOLDER / "table.md").read_text() == doc_figures.presets_table(FOLDER)


def test_every_setting_the_benchmark_runs_is_committed_and_nothing_else(presets_script) -> None:
    wanted = {f"{p}.{s}.json" for p in PRESETS for s in presets_script.settings(p)}
    assert {path.name for path in JSONS} == wanted
    assert set(presets_script.ORDER) == {s for p in PRESETS for s in presets_script.settings(p)}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _named(name: str, preset: str) -> dict:
    """The settings a JSON's name says (``lora16+gc.cfg.vaegc``, ``recipe.bf16``, ...)."""
    if name == "recipe.grpo":
        family = recipe_family(PRESETS[preset].config)
        options = cost_options(family, "grpo")
        return {
            "recipe_defaults": family,
            "recipe_objective": "grpo",
            "objective": "stepwise",
            "per_timestep": True,
            "lora_rank": options["lora_rank"],
            "lora_targets": options["lora_targets"],
            "batch": options["batch"],
            "dtype": options["dtype"],
            "reward": "latent",
            "cfg": options["cfg"],
            "steps": options["steps"],
            "height": options["height"],
        }
    if name.startswith("recipe"):
        options = cost_options(recipe_family(PRESETS[preset].config))
        return {
            "recipe_defaults": recipe_family(PRESETS[preset].config),
            "lora_rank": options["lora_rank"],
            "gradient_checkpointing": options["gradient_checkpointing"],
            "decoder_checkpointing": options["decoder_checkpointing"],
            "dtype": "bf16" if name == "recipe.bf16" else options["dtype"],
            "reward": options["reward"],
            "cfg": options["cfg"],
            "true_cfg": options["true_cfg"],
            "steps": options["steps"],
            "height": options["height"],
        }
    if name.startswith("grpo."):  # Flow-GRPO's SD3 step: benchmarks/cost_presets.py
        return {
            "recipe_defaults": None,
            "objective": "stepwise",
            "per_timestep": name.endswith(".per-timestep"),
            "lora_rank": 32,
            "gradient_checkpointing": True,
            "reward": "latent",
            "cfg": 4.5,
            "rows_per_sample": 2,
            "steps": 10,
            "height": 512,
            "width": 512,
            "dtype": "bf16",
        }
    train, guidance, vae = name.split(".")
    named = {
        "recipe_defaults": None,
        "lora_rank": 16 if train.startswith("lora16") else None,
        "gradient_checkpointing": "+gc" in train,
        "decoder_checkpointing": vae.startswith("vaegc"),
        "decoder_tile": 512 if vae.endswith("+tile512") else None,
        "dtype": "bf16",
        "reward": "aesthetic",
        "rows_per_sample": 2 if guidance == "cfg" else 1,
    }
    assert guidance in ("cfg", "nocfg") and vae in ("vae", "vaegc", "vaegc+tile512"), name
    return named


@pytest.mark.parametrize("path", JSONS, ids=lambda p: p.stem)
def test_each_json_holds_the_settings_its_name_and_command_say(path: Path, presets_script) -> None:
    payload = json.loads(path.read_text())
    preset = next(p for p in PRESETS if path.stem.startswith(p + "."))
    setting = path.stem[len(preset) + 1 :]
    settings = payload["settings"]
    assert payload["model"] == preset
    for key, value in _named(setting, preset).items():
        assert settings[key] == value, (key, settings[key], value)
    # The guidance in words says what the rows say, and Flux is never priced as CFG
    # without --true-cfg (its --cfg is the guidance embedding's value).
    words = settings["guidance"]
    assert words.endswith(f"({settings['rows_per_sample']} row per sample)") or words.endswith(
        f"({settings['rows_per_sample']} rows per sample: conditional and unconditional)"
    )
    if preset == "flux-dev":
        assert ("true cfg" in words) == (settings["rows_per_sample"] == 2)
        assert "embedding" in words
    # What benchmarks/cost_presets.py runs for the name, and what the recorded command gives.
    asked = ["--model", preset, *presets_script.settings(preset)[setting]]
    recorded = payload["command"].split()
    assert recorded[:2] == ["gradest", "cost"]
    assert vars(_parse(recorded[2:])) == vars(_parse(asked))
    resolved = resolve_options(_parse(recorded[2:]))
    for key in ("lora_rank", "gradient_checkpointing", "dtype", "cfg", "true_cfg",
                "decoder_tile", "recipe_defaults"):  # fmt: skip
        assert getattr(resolved, key) == settings[key], key
    assert resolved.decoder_checkpointing in (None, settings["decoder_checkpointing"])
    assert (resolved.reward or "aesthetic") == settings["reward"]


def test_the_recipe_defaults_figure_is_the_one_quoted() -> None:
    """For every preset the page quotes the recipe's estimator (``sdo``) on the recipe's
    defaults, and the table of how the recipes run shows it."""
    text = PAGE.read_text(encoding="utf-8")
    for preset in PRESETS:
        assert f"<!-- cost {preset}.recipe sdo peak -->" in text, preset
        assert re.search(
            rf"<!-- cost-quote table \S+ preset={re.escape(preset)} settings=recipe,", text
        )
    assert cost_options("sd3")["estimators"] == "sdo"


# -- a number edited by hand fails ----------------------------------------------------------


def _bump(token: str) -> str:
    """The token with its last digit changed."""
    index = max(i for i, c in enumerate(token) if c.isdigit())
    return token[:index] + str((int(token[index]) + 3) % 10) + token[index + 1 :]


_DIGITS = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def _edits(pattern: re.Pattern[str], text: str) -> list[str]:
    """For each generated block or figure of ``text``: the page with the block's first
    decimal figure (else its first number) edited, plain and in bold; a figure without a
    number (a fit of ``none``) given one."""
    pages = []
    for match in pattern.finditer(text):
        numbers = list(_DIGITS.finditer(match["body"]))
        number = next((n for n in numbers if "." in n.group()), numbers[0] if numbers else None)
        if number is None:
            assert match["body"] == "none", match["args"]
            pages.append(text[: match.start("body")] + "80 GiB" + text[match.end("body") :])
            continue
        start = match.start("body") + number.start()
        end = start + len(number.group())
        for replacement in (_bump(number.group()), f"**{_bump(number.group())}**"):
            pages.append(text[:start] + replacement + text[end:])
    return pages


def test_a_number_edited_by_hand_fails() -> None:
    text = PAGE.read_text(encoding="utf-8")
    blocks = _edits(doc_figures._BLOCK, text)
    figures = _edits(doc_figures._FIGURE, text)
    assert len(blocks) >= 2 * 6 and len(figures) >= 2 * 40
    rendered: dict[str, str] = {}
    real = doc_figures.render

    def render_once(root: Path, args: str) -> str:  # each table rendered once
        if args not in rendered:
            rendered[args] = real(root, args)
        return rendered[args]

    doc_figures.render = render_once  # type: ignore[assignment]
    try:
        for edited in blocks + figures:
            assert doc_figures.page_problems(ROOT, edited), "an edited figure passed"
    finally:
        doc_figures.render = real  # type: ignore[assignment]


def test_a_figure_written_outside_the_generated_text_fails(tmp_path: Path) -> None:
    text = PAGE.read_text(encoding="utf-8")
    stray = text.replace("### What it says\n", "### What it says\n\nSD3 fits in 20.9 GiB.\n", 1)
    assert doc_figures.page_problems(ROOT, stray) == [
        "a cost figure outside a generated block: 20.9 GiB"
    ]
    assert doc_figures.stray_figures("a 855 TFLOP step, 24 GiB, `--memory 80GiB`") == ["855 TFLOP"]
    # The command on a copy: 1 with --check, and without it the figures are written back.
    copy = tmp_path / "cost.md"
    match = next(doc_figures._FIGURE.finditer(text))
    edited = text[: match.start("body")] + "1.0 GiB" + text[match.end("body") :]
    copy.write_text(edited, encoding="utf-8")
    assert doc_figures.main([str(copy), "--root", str(ROOT), "--check"]) == 1
    assert copy.read_text(encoding="utf-8") == edited
    assert doc_figures.main([str(copy), "--root", str(ROOT)]) == 0
    assert copy.read_text(encoding="utf-8") == text
