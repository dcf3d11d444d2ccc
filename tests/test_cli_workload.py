"""`gradest finetune` end to end through the CLI, including LoRA adapters."""

from __future__ import annotations

import json

import pytest
import torch

from gradest.cli import main

pytest.importorskip("peft")


def test_finetune_with_lora_trains_only_the_adapters(tmp_path, capsys):
    out = tmp_path / "ft"
    code = main(
        [
            "finetune",
            "--estimator",
            "sdo",
            "--lora-rank",
            "2",
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--sampler-steps",
            "4",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    checkpoint = sorted((out / "checkpoints").glob("*.pt"))[-1]
    state = torch.load(checkpoint, weights_only=True)["model"]
    assert any("lora_A" in name for name in state)


def test_negative_lora_rank_is_a_one_line_error(tmp_path, capsys):
    code = main(["finetune", "--lora-rank", "-1", "--out", str(tmp_path / "x"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "--lora-rank must be >= 0" in err and "Traceback" not in err
