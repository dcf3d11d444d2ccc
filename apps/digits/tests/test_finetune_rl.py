"""The RL objectives of gradest.rl in the fine-tuning workload: mode="adjoint_matching" and
GRPO's kl_weight (2-step runs on the tiny DiT, the CLI path, resuming)."""

from __future__ import annotations

import json

import pytest
import torch
from digits_support import (
    BATCH,
    STEPS,
    TARGET,
    LinearClassifierReward,
    first_training_batch,
    parse_finetune_args,
    run_finetune,
    shipped_assets,
    tiny_dit,
    without_timings,
)
from gradest_digits.finetune import LOG_KEYS, start_run
from gradest_digits.finetune_cli import run_finetune_from_args
from gradest_digits.finetune_config import FinetuneConfig
from gradest_digits.run_state import check_same_run

import gradest
from gradest import rl


@pytest.mark.parametrize("spec", ["exact", "jagg:window=2", "sdo:samples=2"])
def test_adjoint_matching_runs(tmp_path, spec):
    before = {n: p.detach().clone() for n, p in tiny_dit().named_parameters()}
    model, result = run_finetune(tmp_path, mode="adjoint_matching", estimator=spec)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert records == result["history"] and len(records) == 2
    for record in records:
        assert set(LOG_KEYS) <= set(record)
        assert record["loss"] > 0 and record["grad_norm"] > 0
        # The lean adjoint: N base forwards with graph + N state VJPs, beside the estimator's.
        assert record["cost"]["objective_model_units"] == 2 * STEPS
    assert result["config"]["mode"] == "adjoint_matching"
    assert "kl_weight" not in result["config"] and "noise_level" not in result["config"]
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_first_adjoint_matching_step_follows_the_reward_gradient():
    """At step 0 the model is the base, so the adjoint-matching gradient is the exact
    gradient of ``-mean reward`` through the memoryless SDE on the same rollout."""
    seed = 3
    noise, generator = first_training_batch(seed)
    cond = {"y": torch.full((BATCH,), TARGET)}
    flow, reward = rl.memoryless_flow(STEPS), LinearClassifierReward()
    model = tiny_dit()
    trajectory = gradest.rollout(model, flow, noise, cond, generator=generator)
    terminal = gradest.TerminalObjective(lambda images: -reward(images).mean())
    expected = gradest.estimator("exact").estimate(
        model, flow, terminal, trajectory=trajectory, cond=cond
    )
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in expected.grads.values()])))
    _, result = run_finetune(mode="adjoint_matching", steps=1, seed=seed, optimizer="sgd", lr=1e-3)
    assert result["history"][0]["grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_base_model_is_a_frozen_copy_of_the_initial_model():
    model = tiny_dit()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    run, sampler = start_run(
        model, LinearClassifierReward(), mode="adjoint_matching", batch_size=BATCH,
        sampler_steps=STEPS, labels=TARGET, steps=2,
    )  # fmt: skip
    assert isinstance(sampler, gradest.FlowSDE) and sampler.noise_level == rl.MEMORYLESS_NOISE_LEVEL
    run.step(0, sampler)
    run.step(1, sampler)
    assert run.base is not None and run.base is not model
    assert all(not p.requires_grad for p in run.base.parameters())
    for name, p in run.base.named_parameters():
        assert torch.equal(p, initial[name])
        assert not torch.equal(dict(model.named_parameters())[name], initial[name])
    plain, _ = start_run(tiny_dit(), LinearClassifierReward(), mode="grpo", labels=TARGET)
    assert plain.base is None  # no copy unless a mode needs it


def test_grpo_kl_weight_zero_is_the_old_run_and_positive_differs(tmp_path):
    runs = {}
    for name, extra in (("default", {}), ("zero", {"kl_weight": 0.0}), ("kl", {"kl_weight": 5.0})):
        model, result = run_finetune(tmp_path / name, mode="grpo", seed=4, **extra)
        lines = (tmp_path / name / "log.jsonl").read_text().splitlines()
        runs[name] = ([without_timings(json.loads(line)) for line in lines], result, model)
    default, zero, kl = runs["default"], runs["zero"], runs["kl"]
    assert default[0] == zero[0]
    assert all(
        torch.equal(a, b)
        for a, b in zip(default[2].parameters(), zero[2].parameters(), strict=True)
    )
    assert default[1]["config"]["kl_weight"] == 0.0 and kl[1]["config"]["kl_weight"] == 5.0
    # The same rollouts (the KL changes only the updates after the first batch's)...
    assert kl[0][0]["reward_mean"] == default[0][0]["reward_mean"]
    # ... N reference forwards for the KL, none without it ...
    assert kl[0][0]["cost"]["objective_model_units"] == STEPS
    assert default[0][0]["cost"]["objective_model_units"] == 0
    # ... and a different first update.
    assert (
        kl[0][0]["losses"] != default[0][0]["losses"]
        or kl[0][0]["grad_norms"] != (default[0][0]["grad_norms"])
    )


def test_old_grpo_checkpoints_resume_with_the_default_kl_weight():
    record = FinetuneConfig(mode="grpo").record("Exact()")
    saved = {key: value for key, value in record.items() if key != "kl_weight"}
    check_same_run(saved, record)  # a checkpoint written before kl_weight existed
    with pytest.raises(ValueError, match=r"kl_weight: checkpoint 0\.0, now 0\.04"):
        check_same_run(saved, FinetuneConfig(mode="grpo", kl_weight=0.04).record("Exact()"))


def test_adjoint_matching_resumes_bitwise(tmp_path):
    """The base model is the model passed in, before the checkpoint is loaded."""
    whole, _ = run_finetune(tmp_path / "whole", mode="adjoint_matching", steps=3, seed=2)
    folder = tmp_path / "split"
    run_finetune(folder, mode="adjoint_matching", steps=2, seed=2, checkpoint_dir=folder / "ckpt")
    resumed, _ = run_finetune(
        folder, mode="adjoint_matching", steps=3, seed=2, checkpoint_dir=folder / "ckpt",
        resume=folder / "ckpt",
    )  # fmt: skip
    assert all(
        torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters(), strict=True)
    )


def test_kl_weight_is_validated():
    with pytest.raises(ValueError, match="kl_weight must be a finite float >= 0"):
        FinetuneConfig(mode="grpo", kl_weight=-1.0)
    with pytest.raises(TypeError, match="kl_weight must be a float"):
        FinetuneConfig(mode="grpo", kl_weight="a lot")


@pytest.mark.usefixtures("tiny_digits_assets")
def test_cli_mode_adjoint_matching_with_injected_assets(tmp_path):
    for mode, extra in (("adjoint_matching", []), ("grpo", ["--kl-weight", "0.04"])):
        out = tmp_path / mode
        argv = f"--mode {mode} --steps 2 --batch-size 4 --sampler-steps 4 --group-size 2 --target 2"
        args = parse_finetune_args([*argv.split(), *extra, "--quiet", "--out", str(out)])
        assert args.mode == mode
        result = run_finetune_from_args(args)
        assert len((out / "log.jsonl").read_text().splitlines()) == 2
        assert json.loads((out / "result.json").read_text())["config"]["mode"] == mode
        assert result["final_reward"] == result["final_reward"]  # finite, not NaN


def test_cli_adjoint_matching_on_the_shipped_digits_model(tmp_path):
    shipped_assets()
    out = tmp_path / "ft"
    argv = "--mode adjoint_matching --steps 2 --batch-size 4 --sampler-steps 4 --lr 1e-4 --quiet"
    result = run_finetune_from_args(parse_finetune_args([*argv.split(), "--out", str(out)]))
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(-50 < r["reward_mean"] <= 0 for r in records)
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in records)
    assert result["config"]["mode"] == "adjoint_matching"
