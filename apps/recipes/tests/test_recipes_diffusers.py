"""The recipes speak diffusers (issue 23): diffusers' training-script flag names, LoRA
checkpoints diffusers loads, ``--resume_from_checkpoint latest``, accelerate's trackers
(TensorBoard and offline wandb, both read back), lr schedules, EMA, gradient
accumulation, clipping, and a missing dependency named in one line.

All on CPU with the tiny random models of ``--tiny``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

from gradest_recipes import RecipeConfigError  # noqa: E402
from gradest_recipes.config import ALIASES, config_from_argv, read_toml  # noqa: E402
from recipe_support import (  # noqa: E402
    FAMILIES,
    LAUNCHER_ENV,
    RECIPE_WARNINGS,
    SCRIPTS,
    UNET_FAMILIES,
    assert_lora_loads_into_fresh_denoiser,
    comparable,
    lora_export,
    lora_file,
    records,
    script,
    tensorboard_scalars,
    wandb_offline_history,
)

pytestmark = RECIPE_WARNINGS

# diffusers flag -> (value on the command line, recipe setting, value it takes)
DIFFUSERS_FLAGS = [
    ("pretrained_model_name_or_path", "/models/x", "pretrained", "/models/x"),
    ("output_dir", "runs/x", "out", "runs/x"),
    ("seed", "7", "seed", 7),
    ("train_batch_size", "3", "batch_size", 3),
    ("max_train_steps", "9", "steps", 9),
    ("learning_rate", "3e-4", "lr", 3e-4),
    ("lr_scheduler", "cosine_with_restarts", "lr_scheduler", "cosine_with_restarts"),
    ("lr_warmup_steps", "2", "lr_warmup_steps", 2),
    ("lr_num_cycles", "3", "lr_num_cycles", 3),
    ("lr_power", "2.0", "lr_power", 2.0),
    ("gradient_accumulation_steps", "4", "gradient_accumulation", 4),
    ("mixed_precision", "bf16", "mixed_precision", "bf16"),
    ("checkpointing_steps", "5", "save_every", 5),
    ("checkpoints_total_limit", "3", "keep_checkpoints", 3),
    ("rank", "16", "lora_rank", 16),
    ("lora_layers", "to_q,to_v", "lora_targets", ("to_q", "to_v")),
    ("report_to", "all", "report_to", "all"),
    ("validation_prompt", "a cat", "validation_prompt", "a cat"),
    ("validation_steps", "10", "sample_every", 10),
    ("num_validation_images", "3", "sample_count", 3),
    ("adam_beta1", "0.8", "adam_beta1", 0.8),
    ("adam_beta2", "0.99", "adam_beta2", 0.99),
    ("adam_weight_decay", "0.01", "weight_decay", 0.01),
    ("adam_epsilon", "1e-6", "adam_epsilon", 1e-6),
    ("max_grad_norm", "0.5", "max_grad_norm", 0.5),
]
BOOLEAN_FLAGS = [("gradient_checkpointing", "gradient_checkpointing"), ("use_ema", "use_ema")]


@pytest.mark.parametrize("spelling", ["underscore", "hyphen"])
def test_every_diffusers_flag_in_both_spellings_sets_one_setting(spelling):
    def flag(name: str) -> str:
        return "--" + (name if spelling == "underscore" else name.replace("_", "-"))

    argv = ["--tiny"]
    for name, value, _, _ in DIFFUSERS_FLAGS:
        argv += [flag(name), value]
    argv += [flag(name) for name, _ in BOOLEAN_FLAGS]
    config, _ = config_from_argv("sd3", argv)
    for name, _, key, want in DIFFUSERS_FLAGS:
        assert getattr(config, key) == want, name
    assert config.gradient_checkpointing and config.use_ema
    negated = ["--tiny"] + ["--" + ("no_" + n if spelling == "underscore" else "no-" +
               n.replace("_", "-")) for n, _ in BOOLEAN_FLAGS]  # fmt: skip
    config, _ = config_from_argv("sd3", [*negated, "--use_ema", "--no-use-ema"])
    assert not config.gradient_checkpointing and not config.use_ema
    # the recipe's own names still work and are the same setting (the last one given wins)
    config, _ = config_from_argv("sd3", ["--tiny", "--out", "a", "--output_dir", "b",
                                         "--lr", "1e-3", "--lora-rank", "4"])  # fmt: skip
    assert (config.out, config.lr, config.lora_rank) == ("b", 1e-3, 4)
    assert config_from_argv("sd3", ["--tiny", "--resume_from_checkpoint", "x"])[1]["resume"] == "x"


def test_toml_keys_in_either_spelling_and_diffusers_names(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('tiny = true\nlearning-rate = 2e-4\noutput_dir = "o"\ntrain_batch_size = 3\n'
                    'lora-rank = 5\nuse-ema = true\nlr_scheduler = "linear"\n')  # fmt: skip
    assert read_toml(file)["lr"] == 2e-4
    config, _ = config_from_argv("sd3", ["--config", str(file), "--set", "max-train-steps=7"])
    assert (config.lr, config.out, config.batch_size, config.lora_rank) == (2e-4, "o", 3, 5)
    assert config.use_ema and config.lr_scheduler == "linear" and config.steps == 7
    file.write_text("lr = 1e-3\nlearning_rate = 2e-3\n")
    with pytest.raises(RecipeConfigError, match=r"setting lr is given twice"):
        read_toml(file)
    for bad, match in [
        (["--lr_scheduler", "cosine_annealing"], r"lr_scheduler='cosine_annealing'.*constant"),
        (["--lr_scheduler", "piecewise_constant"], r"lr_step_rules=None.*needs rules"),
        (["--report_to", "comet"], r"report_to='comet'"),
        (["--adam_beta2", "1.0"], r"adam_beta2=1\.0.*\[0, 1\)"),
        (["--adam_epsilon", "0"], r"adam_epsilon=0\.0"),
    ]:
        with pytest.raises(RecipeConfigError, match=match):
            config_from_argv("sd3", ["--tiny", *bad])
    assert set(ALIASES.values()) <= set(config.to_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_diffusers_flags_resume_latest_and_diffusers_loadable_checkpoints(family, tmp_path):
    """A run with diffusers' flag names (underscore for sd3, hyphen for flux, both for
    sd_unet), stopped after 2 steps and resumed with ``--resume_from_checkpoint latest``
    alone (every setting from the run) to 3, equals 3 uninterrupted steps: logs, LoRA,
    the EMA, the lr schedule; every checkpoint holds diffusers-loadable LoRA."""
    main = script(family).main
    flags = {
        "train_batch_size": "1", "learning_rate": "1e-2", "lr_scheduler": "cosine",
        "lr_warmup_steps": "1", "gradient_accumulation_steps": "2", "rank": "2",
        "checkpointing_steps": "1", "checkpoints_total_limit": "2", "max_grad_norm": "0.5",
        "adam_beta1": "0.8", "adam_weight_decay": "0.01", "validation_prompt": "a red cat",
        "validation_steps": "2", "seed": "3",
    }  # fmt: skip

    def argv(out: Path, steps: int) -> list[str]:
        words = ["--tiny", "--use_ema", "--gradient_checkpointing"]
        for i, (name, value) in enumerate(flags.items()):
            hyphen = family == "flux" or (family == "sd_unet" and i % 2)
            words += ["--" + (name.replace("_", "-") if hyphen else name), value]
        return [*words, "--output_dir", str(out), "--max_train_steps", str(steps)]

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(argv(straight, 3)) == 0
    assert main(argv(split, 2)) == 0
    assert main(["--resume_from_checkpoint", "latest", "--output_dir", str(split),
                 "--max_train_steps", "3"]) == 0  # fmt: skip
    assert comparable(records(split)) == comparable(records(straight))
    rows = records(straight)
    assert [r["model_forwards"] > 0 for r in rows] == [True] * 3
    lrs = [r["lr"] for r in rows]  # warmup 1, then cosine over the remaining 2 steps
    assert lrs == pytest.approx(
        [0.0, 1e-2, 1e-2 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi / 2)).item())]
    )
    saved = read_toml(straight / "config.toml")
    assert "resume" not in saved and saved["validation_prompt"] == "a red cat"
    checkpoints = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000003"]  # checkpoints_total_limit 2
    ema_files = [run / "checkpoints" / "step_000003" / "custom_checkpoint_1.pkl"
                 for run in (straight, split)]  # fmt: skip
    emas = [torch.load(f, weights_only=True)["shadow_params"] for f in ema_files]
    assert len(emas[0]) == len(emas[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*emas, strict=True))  # the EMA resumed
    for step_name in ("step_000002", "step_000003"):
        folder = straight / "checkpoints" / step_name
        checkpointed = lora_file(folder)  # the velocity wrapper's names: a prefix
        prefix = "unet." if family in UNET_FAMILIES else "transformer."
        exported = lora_export(folder)
        trained = {}
        for key in exported:  # no ".default", no "model." prefix: diffusers' own keys
            assert key.startswith(prefix) and ".default" not in key and "model." not in key
            own = key[len(prefix) :].replace(".weight", ".default.weight")
            (match,) = [k for k in checkpointed if k == own or k.endswith("." + own)]
            trained[own] = checkpointed[match]
        assert len(trained) == len(checkpointed) > 0
        assert_lora_loads_into_fresh_denoiser(family, folder, trained)
        for key, value in lora_file(split / "checkpoints" / step_name).items():
            assert torch.equal(value, checkpointed[key]), key
    # the EMA export is other weights than the trained ones, equal after resume
    ema, ema_split = (lora_export(run / "lora" / "ema") for run in (straight, split))
    final = lora_export(straight / "lora")
    assert ema.keys() == final.keys()
    assert any(not torch.equal(ema[k], final[k]) for k in ema if "lora_B" in k)
    assert all(torch.equal(ema[k], ema_split[k]) for k in ema)
    # optimizer settings reached AdamW
    group = torch.load(straight / "checkpoints" / "step_000003" / "optimizer.bin",
                       weights_only=True)["param_groups"][0]  # fmt: skip
    assert group["betas"] == (0.8, 0.999) and group["weight_decay"] == 0.01
    assert group["eps"] == 1e-8
    assert (straight / "samples" / "step_000002.png").is_file()


def test_saved_config_starts_a_run_and_lineage_pruning_keeps_newer(tmp_path, capsys):
    main = script("sd3").main
    out = tmp_path / "run"
    main(["--tiny", "--output-dir", str(out), "--max-train-steps", "4",
          "--checkpointing-steps", "1", "--checkpoints-total-limit", "2"])  # fmt: skip
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003",
                                                                       "step_000004"]  # fmt: skip
    state = json.loads((out / "checkpoints" / "step_000004" / "recipe_state.json").read_text())
    assert "resume" not in state["config"]
    # the saved config as --config starts a new run (it names no resume)
    again = tmp_path / "again"
    assert main(["--config", str(out / "config.toml"), "--output_dir", str(again)]) == 0
    assert comparable(records(again)) == comparable(records(out))
    # resuming from the older step 3 abandons step 4: moved aside, never deleted
    main(["--resume_from_checkpoint", str(out / "checkpoints" / "step_000003"),
          "--max_train_steps", "4"])  # fmt: skip
    assert "newer checkpoint was moved to" in capsys.readouterr().err
    assert (out / "checkpoints" / "abandoned" / "step_000004" / "lora_0.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "abandoned", "step_000003", "step_000004"]  # fmt: skip
    # latest with no checkpoint yet: a new run, as diffusers' scripts do
    fresh = tmp_path / "fresh"
    main(["--tiny", "--resume_from_checkpoint", "latest", "--output_dir", str(fresh)])
    assert [r["step"] for r in records(fresh)] == [1, 2]


def test_bare_resume_compares_only_explicit_flags_and_never_imports_run_code(tmp_path):
    main = script("sd3").main
    counter = tmp_path / "imports.txt"
    hook = tmp_path / "hook.py"
    hook.write_text(f"from pathlib import Path\nP = Path({str(counter)!r})\n"
                    "P.write_text(P.read_text() + 'x' if P.exists() else 'x')\n"
                    "def reward(images):\n    return images.mean(dim=(1, 2, 3))\n")  # fmt: skip
    out = tmp_path / "run"
    main(["--tiny", "--output_dir", str(out), "--reward", f"{hook}:reward",
          "--checkpointing_steps", "1"])  # fmt: skip
    assert counter.read_text() == "x"
    with pytest.raises(RecipeConfigError, match=r"reward .*is code.*pass --reward"):
        main(["--resume_from_checkpoint", "latest", "--output_dir", str(out),
              "--max_train_steps", "3"])  # fmt: skip
    assert counter.read_text() == "x"  # nothing named by the run's files was imported
    with pytest.raises(RecipeConfigError, match=r"setting lr=0\.5 differs from the resumed"):
        main(
            [
                "--resume_from_checkpoint",
                "latest",
                "--output_dir",
                str(out),
                "--max_train_steps",
                "3",
                "--reward",
                f"{hook}:reward",
                "--learning_rate",
                "0.5",
            ]
        )
    with pytest.raises(RecipeConfigError, match=r"setting reward=.*differs"):
        main(["--resume_from_checkpoint", "latest", "--output_dir", str(out),
              "--max_train_steps", "3", "--reward", "brightness"])  # fmt: skip
    # the step count and output / logging settings may change; the rest comes from the run
    main(
        [
            "--resume_from_checkpoint",
            str(out),
            "--max_train_steps",
            "3",
            "--reward",
            f"{hook}:reward",
            "--checkpoints_total_limit",
            "1",
            "--report_to",
            "none",
        ]
    )
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000003"]


@pytest.mark.parametrize(
    "schedule",
    [
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "piecewise_constant",
    ],
)
def test_lr_schedules_and_warmup_show_in_the_logged_lr(schedule, tmp_path):
    """Each of get_scheduler's schedules, with warmup, as logged (log.jsonl and
    TensorBoard's ``train/lr``): the lr of every step, as a reference LambdaLR gives it."""
    from diffusers.optimization import get_scheduler

    steps, lr = 5, 1e-3
    options = ["--lr_warmup_steps", "2", "--lr_num_cycles", "2", "--lr_power", "2.0",
               "--lr_step_rules", "1:3,0.1"]  # fmt: skip
    out = tmp_path / schedule
    script("sd3").main(["--tiny", "--output_dir", str(out), "--max_train_steps", str(steps),
                        "--learning_rate", str(lr), "--lr_scheduler", schedule, *options,
                        "--num_inference_steps", "1", "--resolution", "8"])  # fmt: skip
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    reference = get_scheduler(schedule, optimizer, step_rules="1:3,0.1", num_warmup_steps=2,
                              num_training_steps=steps, num_cycles=2, power=2.0)  # fmt: skip
    want = []
    for _ in range(steps):
        want.append(reference.get_last_lr()[0])
        optimizer.step()
        reference.step()
    logged = [r["lr"] for r in records(out)]
    assert logged == pytest.approx(want, rel=1e-12, abs=1e-15)
    if schedule in ("constant_with_warmup", "linear", "cosine", "polynomial"):
        assert logged[:3] == pytest.approx([0.0, lr / 2, lr])  # the warmup
    if schedule == "piecewise_constant":
        assert logged == pytest.approx([lr, lr, lr, lr / 10, lr / 10])
    shown = tensorboard_scalars(out / "tensorboard", "train/lr")
    assert [s for s, _ in shown] == list(range(1, steps + 1))
    assert [v for _, v in shown] == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_wandb_offline_logs_what_log_jsonl_holds(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    script("flux").main(["--tiny", "--output-dir", str(out), "--report-to", "all",
                         "--max-train-steps", "3", "--lr-scheduler", "linear",
                         "--validation-prompt", "a cat"])  # fmt: skip
    rows = records(out)
    history, summary = wandb_offline_history(out)
    scalars = [h for h in history if "train/reward" in h]
    assert [h["_step"] for h in scalars] == [1, 2, 3]
    for row, logged in zip(rows, scalars, strict=True):
        for key in ("reward", "loss", "lr", "grad_norm", "model_forwards"):
            assert logged[f"train/{key}"] == pytest.approx(row[key], rel=1e-12), key
    assert summary["train/reward"] == pytest.approx(rows[-1]["reward"], rel=1e-12)
    assert summary["samples/_type"] == "image-file" and summary["samples/caption"] == "a cat"
    # the same scalars in TensorBoard (report_to all)
    shown = tensorboard_scalars(out / "tensorboard", "train/reward")
    assert [v for _, v in shown] == pytest.approx([r["reward"] for r in rows], rel=1e-6)


def test_max_grad_norm_clips_and_adam_epsilon_reaches_adamw(tmp_path):
    """One AdamW step from zero state moves by ``lr * g / (|g| + eps)``; with eps far above
    |g| that is ``lr * g / eps``, so the LoRA update's norm is ``lr * max_grad_norm / eps``
    when clipping acts (the logged norm, before clipping, is larger); gradient
    accumulation 2 runs two micro-steps' forwards in the step."""
    from safetensors.torch import load_file

    lr, clip, eps = 1000.0, 1e-5, 10.0  # an update far above float32's resolution
    runs = {}
    settings = {"clipped": ["--max_grad_norm", str(clip)], "zero": ["--learning_rate", "1e-30"]}
    for name, extra in settings.items():
        out = tmp_path / name
        argv = ["--tiny", "--output_dir", str(out), "--max_train_steps", "1",
                "--learning_rate", str(lr), "--adam_epsilon", str(eps), "--rank", "2",
                "--gradient_accumulation_steps", "2", *extra]  # fmt: skip
        script("sd3").main(argv)
        runs[name] = load_file(str(out / "checkpoints" / "step_000001" / "lora_0.safetensors"))
    moved = torch.cat([(runs["clipped"][k] - runs["zero"][k]).flatten() for k in runs["zero"]])
    row = records(tmp_path / "clipped")[0]
    assert row["grad_norm"] > 10 * clip
    # torch's clip_grad_norm_ scales by max_norm / (norm + 1e-6)
    clipped = clip * row["grad_norm"] / (row["grad_norm"] + 1e-6)
    assert moved.norm().item() == pytest.approx(lr * clipped / eps, rel=1e-3)
    # gradient accumulation 2: two micro-steps' forwards in the one step
    single = tmp_path / "single"
    script("sd3").main(["--tiny", "--output_dir", str(single), "--max_train_steps", "1"])
    assert row["model_forwards"] == 2 * records(single)[0]["model_forwards"]


def test_a_missing_dependency_is_one_line_naming_the_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    code = ("import sys, runpy; sys.modules['accelerate'] = None; "
            f"sys.argv = ['sd3_reward.py', '--tiny', '--out', {str(tmp_path / 'x')!r}]; "
            f"runpy.run_path({str(SCRIPTS / 'sd3_reward.py')!r}, run_name='__main__')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert "accelerate" in line and "pip install . ./apps/recipes" in line
    # the recipes package itself missing: the script's own one line
    code = code.replace("sys.modules['accelerate'] = None", "sys.modules['gradest_recipes'] = None")
    done = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "gradest_recipes is not installed" in line and "pip install . ./apps/recipes" in line
