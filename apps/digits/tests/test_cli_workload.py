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
    assert code == 2 and "argument --lora-rank: must be a whole number >= 0, got -1" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def _records(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_a_config_file_sets_the_run_and_flags_override_it(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        'estimator = "truncated:k=1"\n'
        "steps = 3\n"
        "batch-size = 4\n"
        "sampler_steps = 4\n"
        "lr = 1e-3\n"
        "quiet = true\n"
    )
    out = tmp_path / "ft"
    # --steps on the command line wins over the file, whether it comes before or after.
    code = main(["finetune", "--steps", "2", "--config", str(config), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["steps"] == 2
    assert result["config"]["estimator"].startswith("Truncated(k=1,")
    assert result["config"]["batch_size"] == 4 and result["config"]["lr"] == 1e-3
    assert [r["step"] for r in _records(out)] == [0, 1]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\n", "unknown setting 'stepz'; known: "),
        ('steps = "3"\n', "steps = '3' in "),
        ("lr = true\n", "expected a number"),
        ('labels = "all"\n', "must be one of 'null', 'target'"),
        ("steps = \n", "is not valid TOML"),
        ("[finetune]\nsteps = 3\n", "[finetune] tables are not settings"),
    ],
)
def test_a_bad_config_file_is_a_one_line_error_naming_the_key(tmp_path, capsys, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text)
    code = main(["finetune", "--config", str(config), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_a_missing_config_file_is_named(tmp_path, capsys):
    code = main(["finetune", "--config", str(tmp_path / "nope.toml")])
    err = capsys.readouterr().err
    assert code == 2 and "nope.toml" in err and "no such file" in err


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu", "is not a device; use cpu, cuda or cuda:N"),
        ("meta", "runs on cpu or cuda"),
        pytest.param(
            "cuda",
            "torch.cuda.is_available() is False",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here"),
        ),
    ],
)
def test_a_bad_device_is_refused_before_any_work(tmp_path, capsys, device, message):
    code = main(["finetune", "--device", device, "--out", str(tmp_path / "x"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_estimator_options_beyond_the_sampler_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "x"
    argv = ["finetune", "--estimator", "telescope:mean_depth=5", "--sampler-steps", "3"]
    code = main([*argv, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "mean_depth=5 exceeds the sampler's N=3 steps" in err
    assert "Traceback" not in err and not out.exists()
