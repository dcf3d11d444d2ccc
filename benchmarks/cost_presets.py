"""The `gradest cost` table of the shipped presets (docs/benchmarks.md#cost-at-scale).

Every preset at its pipeline's resolution and step count, bf16, batch 1, full
fine-tuning and LoRA rank 16, with and without diffusers' gradient checkpointing; the
default estimators of `gradest cost`; the whole step of a pixel reward (the family's
VAE decode and the aesthetic predictor's CLIP ViT-L/14, `--reward aesthetic`), the VAE
with its own gradient checkpointing where the transformer has it
(`--decoder-checkpointing`). One JSON per setting (what `gradest cost --json` writes)
and a markdown table::

    python -m benchmarks.cost_presets --out docs/results/cost_presets

All traced on the meta device, no GPU (`"seconds"` in each JSON: the time of each).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gradest_lab.cost.diffusers_presets import PRESETS
from tqdm import tqdm

from gradest.cli import main as gradest_main

_REWARD = ["--reward", "aesthetic"]
_GC = ["--gradient-checkpointing", "--decoder-checkpointing"]
SETTINGS = {
    "full": _REWARD,
    "full+gc": _REWARD + _GC,
    "lora16": _REWARD + ["--lora-rank", "16"],
    "lora16+gc": _REWARD + ["--lora-rank", "16", *_GC],
}
MEMORIES = (24, 48, 80)


def _smallest_fit(peak: float) -> str:
    fits = [m for m in MEMORIES if peak <= m * 2**30]
    return f"{fits[0]}" if fits else "none"


def table(folder: Path) -> str:
    """Markdown: per preset, each estimator's FLOPs and peak GiB under every setting,
    with the smallest of 24 / 48 / 80 GiB it fits."""
    lines = []
    for preset in PRESETS:
        runs = {s: json.loads((folder / f"{preset}.{s}.json").read_text()) for s in SETTINGS}
        first = runs["full"]["settings"]
        lines += [
            f"### {preset}",
            "",
            f"{first['height']}x{first['width']}, {first['steps']} steps, "
            f"{first['prompt_tokens']} prompt tokens, bf16, batch 1, reward "
            f"{first['reward']} on the VAE-decoded images. Cells: the whole step's peak GiB "
            "(smallest of 24 / 48 / 80 GiB it fits), in brackets the transformer's alone "
            "(a reward on the latents). FLOPs per training step, decode and reward included.",
            "",
            "| estimator | TFLOP full | TFLOP LoRA | full | full + GC | LoRA 16 | LoRA 16 + GC |",
            "|---|---|---|---|---|---|---|",
        ]
        for spec in runs["full"]["estimators"]:
            cells = [f"`{spec}`"]
            for setting in ("full", "lora16"):
                cells.append(f"{runs[setting]['estimators'][spec]['flops'] / 1e12:,.0f}")
            for setting in SETTINGS:
                est = runs[setting]["estimators"][spec]
                peak, high = est["peak_bytes"], est["peak_range"][1]
                text = f"{peak / 2**30:,.1f}"
                if high != est["peak_range"][0]:
                    text += f" (to {high / 2**30:,.1f})"
                alone = est.get("transformer", est)["peak_bytes"] / 2**30
                cells.append(f"{text} ({_smallest_fit(high)}) [{alone:,.1f}]")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def run(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(p, s) for p in PRESETS for s in SETTINGS]
    for preset, setting in tqdm(jobs, desc="cost presets"):
        target = out / f"{preset}.{setting}.json"
        if target.exists():  # resumable: a finished setting is not traced again
            continue
        started = time.perf_counter()
        code = gradest_main(
            ["cost", "--model", preset, "--quiet", "--json", str(target), *SETTINGS[setting]]
        )
        if code:
            raise SystemExit(f"gradest cost failed for {preset} {setting}")
        tqdm.write(f"{preset} {setting}: {time.perf_counter() - started:.0f} s")
    (out / "table.md").write_text(table(out))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/cost_presets", type=Path)
    run(parser.parse_args().out)
