"""The `gradest cost` figures of the shipped presets (docs/cost.md#the-presets-table).

Every preset at its pipeline's resolution and step count, batch 1, the default
estimators of `gradest cost`, each setting named by what it trains, its guidance and its
VAE decode (`.cfg` / `.nocfg`, `.vaegc` / `.vae`):

* `full.nocfg.vae`, `full+gc.nocfg.vaegc`, `lora16.nocfg.vae`, `lora16+gc.nocfg.vaegc`:
  bf16, full fine-tuning or LoRA rank 16, with and without gradient checkpointing (of the
  transformer, `--gradient-checkpointing`, and of the VAE, `--decoder-checkpointing`,
  together), no CFG (Flux: its guidance embedding, one row per sample), the whole step of
  the aesthetic reward (`--reward aesthetic`: the family's VAE decode and the aesthetic
  predictor's CLIP ViT-L/14);
* `lora16+gc.cfg.vaegc`: the same with the guidance the recipes run: SD3 and SDXL their
  recipe's CFG scale (`--cfg`, 2B rows), Flux true CFG around its embedding
  (`--true-cfg 4`, 2B rows; the Flux recipe's `true_cfg_scale`);
* `recipe`, `recipe.bf16`: what the reward recipe of the family runs by default
  (`--recipe-defaults`: LoRA 8, no transformer checkpointing, the VAE checkpointed, the
  family's guidance, the brightness reward (`--reward pixels`), fp32 as its
  `mixed_precision = "no"`), and the same in bf16 (`mixed_precision = "bf16"`); every
  estimator of the line-up (the recipes' is `sdo`);
* `recipe.grpo` (SD3, SD3.5 and Flux, the families with a grpo recipe): what the grpo
  recipe runs by default (`--recipe-defaults grpo`: `exact` one timestep at a time, LoRA
  32 on the 8 projections of both streams, batch 4, fp32, the family's sampling);
* sd3-medium alone: `lora16+gc.nocfg.vaegc+tile512`, the VAE decoding in 512 px tiles;
  and Flow-GRPO's SD3 training step (`--objective stepwise`: 512 px, 10 steps, CFG 4.5,
  LoRA 32, transformer checkpointing, the loss on the velocities, no decode):
  `grpo.lora32+gc.cfg` prices `exact` with one surrogate over the steps and
  `exact:checkpoint=true`, `grpo.lora32+gc.cfg.per-timestep` `exact` with one backward per
  timestep (`--per-timestep`), as Flow-GRPO and the grpo recipe train.

One JSON per setting (what `gradest cost --json` writes) and a markdown table::

    python -m benchmarks.cost_presets --out docs/results/cost_presets

Resumable: a setting whose JSON exists is not traced again (delete it to redo it). All
traced on the meta device, no GPU (`"seconds"` in each JSON: the time of each). The
tables of docs/cost.md are rendered from these JSONs (`gradest_lab.cost.doc_figures`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gradest_lab.cost.command import default_estimators
from gradest_lab.cost.diffusers_presets import PRESETS
from gradest_lab.cost.doc_figures import presets_table
from gradest_lab.cost.recipe_defaults import GRPO_FAMILIES, cost_options, recipe_family

from gradest.cli import main as gradest_main
from gradest.plugin import format_spec_list

_AESTHETIC = ["--reward", "aesthetic"]
_PLAIN = ["--no-gradient-checkpointing", "--no-decoder-checkpointing"]
_GC = ["--gradient-checkpointing", "--decoder-checkpointing"]
_LORA16 = ["--lora-rank", "16"]
#: Flow-GRPO's SD3 training step (its config/grpo.py: 512 px, 10 sampling steps, CFG 4.5,
#: LoRA rank 32; the transformer checkpointed), on the stepwise objective.
_FLOW_GRPO = [
    "--objective", "stepwise", "--reward", "latent", "--steps", "10", "--height", "512",
    "--width", "512", "--cfg", "4.5", "--lora-rank", "32", "--gradient-checkpointing",
]  # fmt: skip


def _guidance(preset: str) -> list[str]:
    """The CFG of the family's recipe: SD3 / SDXL their ``guidance_scale`` as CFG, Flux
    true CFG (around its guidance embedding at the recipe's value)."""
    family = recipe_family(PRESETS[preset].config)
    scale = str(cost_options(family)["cfg"])
    if family == "flux":
        return ["--cfg", scale, "--true-cfg", "4.0"]
    return ["--cfg", scale]


def settings(preset: str) -> dict[str, list[str]]:
    """Each setting's ``gradest cost`` options for ``preset`` (see the module docstring)."""
    line_up = ["--estimators", format_spec_list(default_estimators())]
    out = {
        "full.nocfg.vae": _AESTHETIC + _PLAIN,
        "full+gc.nocfg.vaegc": _AESTHETIC + _GC,
        "lora16.nocfg.vae": _AESTHETIC + _LORA16 + _PLAIN,
        "lora16+gc.nocfg.vaegc": _AESTHETIC + _LORA16 + _GC,
        "lora16+gc.cfg.vaegc": _AESTHETIC + _LORA16 + _GC + _guidance(preset),
        "recipe": ["--recipe-defaults", *line_up],
        "recipe.bf16": ["--recipe-defaults", "--dtype", "bf16", *line_up],
    }
    if recipe_family(PRESETS[preset].config) in GRPO_FAMILIES:
        out["recipe.grpo"] = ["--recipe-defaults", "grpo"]
    if preset == "sd3-medium":
        out["lora16+gc.nocfg.vaegc+tile512"] = (
            _AESTHETIC + _LORA16 + _GC + ["--decoder-tile", "512"]
        )
        out["grpo.lora32+gc.cfg"] = _FLOW_GRPO + ["--estimators", "exact,exact:checkpoint=true"]
        out["grpo.lora32+gc.cfg.per-timestep"] = _FLOW_GRPO + [
            "--per-timestep", "--estimators", "exact",
        ]  # fmt: skip
    return out


#: The order the settings are traced in: the ones the page quotes in prose first.
ORDER = (
    "recipe", "lora16+gc.cfg.vaegc", "lora16+gc.nocfg.vaegc", "recipe.bf16", "lora16.nocfg.vae",
    "full+gc.nocfg.vaegc", "full.nocfg.vae", "lora16+gc.nocfg.vaegc+tile512",
    "grpo.lora32+gc.cfg", "grpo.lora32+gc.cfg.per-timestep", "recipe.grpo",
)  # fmt: skip


def run(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(s, p) for s in ORDER for p in PRESETS if s in settings(p)]
    for number, (setting, preset) in enumerate(jobs, 1):
        target = out / f"{preset}.{setting}.json"
        if target.exists():  # resumable: a finished setting is not traced again
            continue
        started = time.perf_counter()
        argv = ["cost", "--model", preset, "--quiet", "--json", str(target)]
        code = gradest_main([*argv, *settings(preset)[setting]])
        if code:
            raise SystemExit(f"gradest cost failed for {preset} {setting}")
        elapsed = time.perf_counter() - started
        print(f"[{number}/{len(jobs)}] {preset} {setting}: {elapsed:.0f} s", flush=True)
    (out / "table.md").write_text(presets_table(out))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/cost_presets", type=Path)
    run(parser.parse_args().out)
