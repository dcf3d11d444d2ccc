"""The fine-tuning loop: every estimator in both modes, descent, determinism, logs,
checkpoints, argument validation and the CLI helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path

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
from gradest_digits.finetune import LOG_KEYS, finetune
from gradest_digits.finetune_cli import run_finetune_from_args
from gradest_digits.finetune_records import summarize_info

import gradest
from gradest.rl.flow_grpo import group_advantages, grpo_objective
from gradest.samplers import FlowSDE

SPECS = (
    "exact",
    "exact:checkpoint=true",
    "jagg:window=2",
    "jagg:window=3,shared_knots=true",
    "sdo:samples=2",
    "truncated:k=2",
    "truncated:random=uniform",
    "jagg:window=3,debias=1",
    "telescope:mean_depth=2",
    "draft_lv",
    "refl",
    "auto:candidates=(exact,sdo,truncated),draws=2",
)
TERMINAL_ONLY = ("draft_lv", "refl")
# Keys each built-in reports in result.info (summarised into the log).
INFO_KEYS = {
    "jagg": "fallback_fraction",
    "sdo": "sampled_steps",
    "truncated": "k",
    "telescope": "depth",
    "draft_lv": "renoise",
    "refl": "step",
    "auto": "auto_choice",
}


# -- every estimator, both modes --------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "spec"),
    [
        (mode, spec)
        for spec in SPECS
        for mode in ("reward", "grpo")
        if mode == "reward" or spec not in TERMINAL_ONLY
    ],
)
def test_finetune_runs_with_every_estimator(tmp_path, mode, spec):
    before = {n: p.detach().clone() for n, p in tiny_dit().named_parameters()}
    model, result = run_finetune(tmp_path, estimator=spec, mode=mode)
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == result["history"] and len(records) == 2
    name = gradest.registry.parse_spec(spec)[0]
    for step, record in enumerate(records):
        assert set(LOG_KEYS) <= set(record)
        assert record["step"] == step
        for key in ("reward_mean", "reward_std", "loss", "grad_norm"):
            assert math.isfinite(record[key])
        assert record["grad_norm"] > 0
        assert record["cost"]["param_vjps"] >= 1
        assert record["cost"]["sample_forwards"] == STEPS
        assert record["cost"]["objective_model_units"] == 0  # no base model in these modes
        assert all(record[k] >= 0 for k in LOG_KEYS if k.endswith("_seconds"))
        if name in INFO_KEYS:
            assert INFO_KEYS[name] in record["info"]
        if mode == "grpo":
            assert len(record["losses"]) == len(record["grad_norms"]) == 2
    assert math.isfinite(result["initial_reward"]) and math.isfinite(result["final_reward"])
    changed = [not torch.equal(before[n], p) for n, p in model.named_parameters()]
    assert all(changed)


# -- descent: the gradient points the right way ---------------------------------------------


def test_one_reward_step_decreases_the_loss_on_its_batch():
    """One small SGD step on ``-reward`` must lower ``-reward`` of that same batch by
    ``lr |g|^2`` to first order; the second-order remainder is O(lr) relative to it (about
    2% at lr=1e-2 here, measured), so 5% at lr=1e-3 pins the gradient's direction and size."""
    seed, lr = 3, 1e-3
    noise, _ = first_training_batch(seed)
    cond = {"y": torch.full((BATCH,), TARGET)}
    flow, reward = gradest.RectifiedFlow(steps=STEPS), LinearClassifierReward()

    def loss(model):
        with torch.no_grad():
            return -float(reward(gradest.rollout(model, flow, noise, cond).states[-1]).mean())

    before = loss(tiny_dit())
    model, result = run_finetune(steps=1, optimizer="sgd", lr=lr, seed=seed)
    after = loss(model)
    record = result["history"][0]
    assert record["loss"] == pytest.approx(before, rel=1e-5)
    predicted = lr * record["grad_norm"] ** 2
    assert after < before
    assert before - after == pytest.approx(predicted, rel=0.05)


def test_one_grpo_step_decreases_the_surrogate_on_its_batch():
    """As above, for the clipped surrogate on the recorded trajectory (the ratio starts at
    1, inside the band, so the first step sees the unclipped policy gradient)."""
    seed, lr = 3, 1e-3
    noise, generator = first_training_batch(seed)
    cond = {"y": torch.full((BATCH,), TARGET)}
    sde, reward = FlowSDE(STEPS), LinearClassifierReward()
    trajectory = gradest.rollout(tiny_dit(), sde, noise, cond, generator=generator)
    with torch.no_grad():
        advantages = group_advantages(reward(trajectory.states[-1]).double(), 2).float()
    objective = grpo_objective(sde, trajectory, sde.trajectory_log_probs(trajectory), advantages)

    def surrogate(model):
        total = 0.0
        with torch.no_grad():
            for k in range(STEPS):
                t = torch.full((BATCH,), float(sde.times[k]))
                v = model(trajectory.states[k], t, **cond)
                total += float(objective.loss_fn(k, v, trajectory))
        return total

    before = surrogate(tiny_dit())
    model, result = run_finetune(
        steps=1, mode="grpo", inner_epochs=1, optimizer="sgd", lr=lr, seed=seed
    )
    record = result["history"][0]
    assert record["loss"] == pytest.approx(before, rel=1e-5, abs=1e-7)
    after = surrogate(model)
    assert before - after == pytest.approx(lr * record["grad_norm"] ** 2, rel=0.05)


def test_reward_fine_tuning_raises_the_reward():
    _, result = run_finetune(steps=4, lr=3e-2, seed=0)
    # About 2 nats on the fixed evaluation batch (log p(target) from -5.1 to -3.0).
    assert result["final_reward"] > result["initial_reward"] + 1.0


def test_grpo_fine_tuning_raises_the_reward():
    gains = []
    for seed in range(3):
        _, result = run_finetune(
            mode="grpo",
            steps=6,
            batch_size=8,
            group_size=4,
            lr=3e-2,
            seed=seed,
            log_prob_reduction="mean",
        )
        gains.append(result["final_reward"] - result["initial_reward"])
    # Policy-gradient steps are noisy; the mean gain over seeds is what GRPO promises.
    assert sum(gains) / len(gains) > 0.2


# -- determinism, logs, checkpoints --------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "spec"), [("grpo", "sdo:samples=2"), ("reward", "truncated:random=uniform")]
)
def test_same_seed_gives_the_same_run(tmp_path, mode, spec):
    runs = []
    for index, seed in enumerate((5, 5, 6)):
        folder = tmp_path / str(index)
        model, result = run_finetune(folder, mode=mode, estimator=spec, seed=seed, steps=3)
        lines = (folder / "log.jsonl").read_text().splitlines()
        runs.append(([without_timings(json.loads(line)) for line in lines], result, model))
    (first, result_a, model_a), (second, result_b, model_b), (other, _, _) = runs
    assert first == second
    assert result_a["final_reward"] == result_b["final_reward"]
    assert all(
        torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )
    assert first != other


def test_checkpoints_load(tmp_path):
    model, result = run_finetune(
        tmp_path, steps=3, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2
    )
    assert [Path(p).name for p in result["checkpoints"]] == ["step_000002.pt", "step_000003.pt"]
    state = torch.load(result["checkpoints"][-1], weights_only=True)
    assert state["step"] == 3
    assert state["config"]["estimator"] == repr(gradest.estimator("exact"))
    fresh = tiny_dit(seed=1)
    fresh.load_state_dict(state["model"])
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    optimizer.load_state_dict(state["optimizer"])
    assert optimizer.state_dict()["state"][0]["step"] == 3
    torch.Generator().set_state(state["generators"][0])
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state["torch_rng"][0])


def test_summarize_info():
    infos = [
        {"fallback_fraction": 0.0, "groups": [[0, 1]], "gate_cosines": [0.9], "name": "a"},
        {"fallback_fraction": 0.5, "groups": [[0, 1]], "gate_cosines": [0.8], "name": "b"},
    ]
    assert summarize_info(infos) == {"fallback_fraction": 0.25, "gate_cosines": [0.8], "name": "b"}
    assert summarize_info([]) == {}
    assert summarize_info([{"k": 2}, {"k": 2}]) == {"k": 2}


# -- validation: errors before any work ----------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"mode": "ppo"}, ValueError, "mode must be one of reward, grpo"),
        ({"steps": 0}, ValueError, "steps must be >= 1"),
        ({"steps": 2.5}, TypeError, "steps must be an int"),
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"lr": 0.0}, ValueError, "lr must be a finite float > 0"),
        ({"lr": math.inf}, ValueError, "lr must be a finite float > 0"),
        ({"optimizer": "adam"}, ValueError, "optimizer must be one of adamw, sgd"),
        ({"sampler_steps": 0}, ValueError, "sampler_steps must be >= 1"),
        ({"estimator": "nope"}, gradest.UnknownEstimatorError, "available: .*exact, jagg"),
        ({"estimator": "refl", "mode": "grpo"}, ValueError, "estimator='refl' is for terminal"),
        ({"estimator": "jagg:windw=4"}, TypeError, "windw"),
        ({"estimator": "jagg:window=1"}, ValueError, "window"),
        ({"estimator": "sdo:samples=9"}, ValueError, "samples=9 exceeds the sampler's N=4 steps"),
        ({"estimator": "truncated:k=5"}, ValueError, r"k=5 exceeds the sampler's N=4 steps"),
        ({"estimator": 3}, TypeError, "spec string"),
        ({"mode": "grpo", "group_size": 3}, ValueError, "multiple of group_size=3"),
        ({"mode": "grpo", "group_size": 1}, ValueError, "group_size must be >= 2"),
        ({"mode": "grpo", "clip": 1.5}, ValueError, "clip must be in"),
        ({"mode": "grpo", "noise_level": 0.0}, ValueError, "noise_level must be a finite"),
        ({"mode": "grpo", "inner_epochs": 0}, ValueError, "inner_epochs must be >= 1"),
        ({"checkpoint_every": 2}, ValueError, "needs checkpoint_dir"),
        ({"labels": torch.zeros(BATCH + 1, dtype=torch.long)}, ValueError, "labels must be"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ],
)
def test_finetune_validates_before_any_work(tmp_path, overrides, error, match):
    reward = LinearClassifierReward()
    with pytest.raises(error, match=match):
        run_finetune(tmp_path, reward=reward, **overrides)
    assert reward.calls == 0
    assert not (tmp_path / "log.jsonl").exists()


def test_finetune_rejects_a_batch_reduced_reward():
    with pytest.raises(ValueError, match=r"one reward per sample, shape \[4\]"):
        run_finetune(reward=lambda images: images.sum())


# -- CLI helpers ---------------------------------------------------------------------------


def test_cli_defaults_and_parsing():
    args = parse_finetune_args(
        "--estimator jagg:window=4 --steps 50 --lr 1e-4 --mode reward --out runs/ft".split()
    )
    assert (args.estimator, args.steps, args.lr, args.mode, args.out) == (
        "jagg:window=4", 50, 1e-4, "reward", "runs/ft"
    )  # fmt: skip
    assert args.target == 3 and args.labels == "null" and args.sampler_steps == 10


@pytest.mark.usefixtures("tiny_digits_assets")
def test_run_finetune_from_args_with_injected_assets(tmp_path):
    """The CLI path, with the shipped checkpoints replaced by the tiny test model."""
    out = tmp_path / "ft"
    argv = "--estimator sdo:samples=2 --steps 2 --batch-size 4 --sampler-steps 4 --target 2"
    args = parse_finetune_args(
        [*argv.split(), "--out", str(out), "--checkpoint-every", "1", "--quiet"]
    )
    result = run_finetune_from_args(args)
    assert len((out / "log.jsonl").read_text().splitlines()) == 2
    summary = json.loads((out / "result.json").read_text())
    assert summary["target"] == 2 and summary["final_reward"] == result["final_reward"]
    assert len(list((out / "checkpoints").glob("step_*.pt"))) == 2


def test_run_finetune_from_args_validates_first(tmp_path):
    with pytest.raises(gradest.UnknownEstimatorError):
        run_finetune_from_args(parse_finetune_args(["--estimator", "nope", "--out", str(tmp_path)]))
    with pytest.raises(ValueError, match="--target must be a digit"):
        run_finetune_from_args(parse_finetune_args(["--target", "12", "--out", str(tmp_path)]))


# -- the shipped digits checkpoints ------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "spec", "labels"),
    [("reward", "jagg:window=2", "null"), ("grpo", "sdo:samples=2", "target")],
)
def test_cli_path_on_the_shipped_digits_model(tmp_path, mode, spec, labels):
    assets = shipped_assets()
    out = tmp_path / "ft"
    argv = (
        f"--estimator {spec} --mode {mode} --labels {labels} --steps 2 --batch-size 4 "
        f"--group-size 2 --inner-epochs 1 --sampler-steps 4 --lr 1e-4 --target 3 --quiet"
    )
    args = parse_finetune_args([*argv.split(), "--out", str(out)])
    result = run_finetune_from_args(args)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(set(LOG_KEYS) <= set(r) for r in records)
    # log p(3 | x) of a 10-class classifier: finite and at most 0.
    assert all(-50 < r["reward_mean"] <= 0 for r in records)
    state = torch.load(result["checkpoints"][-1], weights_only=True)
    model = assets.load_pretrained_dit()
    model.load_state_dict(state["model"])
    assert not all(
        torch.equal(a, b)
        for a, b in zip(model.parameters(), assets.load_pretrained_dit().parameters(), strict=True)
    )


def test_one_reward_step_on_the_shipped_digits_model():
    """Descent on the real model and reward: one small SGD step lowers ``-log p(3 | x)``
    of its own batch by about ``lr |g|^2`` (as on the tiny model above). The real loss is
    more curved than the tiny one (the remainder is 7% at lr=1e-4, 2% at lr=3e-5,
    measured), hence the smaller step."""
    assets = shipped_assets()
    from gradest_digits.rewards import ClassifierReward

    seed, lr, target = 0, 3e-5, 3
    reward = ClassifierReward(assets.load_digit_classifier(), target)
    generator = torch.Generator().manual_seed(seed)
    torch.randn((BATCH, 1, 8, 8), generator=generator)  # finetune's evaluation noise
    noise = torch.randn((BATCH, 1, 8, 8), generator=generator)
    cond = {"y": torch.full((BATCH,), target)}
    flow = gradest.RectifiedFlow(steps=STEPS)

    def loss(model):
        with torch.no_grad():
            return -float(reward(gradest.rollout(model, flow, noise, cond).states[-1]).mean())

    before = loss(assets.load_pretrained_dit())
    model = assets.load_pretrained_dit()
    result = finetune(
        model,
        reward,
        estimator="exact",
        steps=1,
        batch_size=BATCH,
        lr=lr,
        optimizer="sgd",
        seed=seed,
        sampler_steps=STEPS,
        labels=target,
        progress=False,
    )
    record = result["history"][0]
    assert record["loss"] == pytest.approx(before, rel=1e-5)
    assert before - loss(model) == pytest.approx(lr * record["grad_norm"] ** 2, rel=0.05)


# -- prior preservation -----------------------------------------------------------------------


def _prior(count: int = 12) -> torch.Tensor:
    """Stand-in real samples, shaped like the micro DiT's (1, 4, 4)."""
    return torch.randn(count, 1, 4, 4, generator=torch.Generator().manual_seed(9))


def _fm_loss(model: torch.nn.Module, data: torch.Tensor) -> float:
    """The flow-matching loss on ``data`` at fixed (t, eps): what prior preservation keeps low."""
    gen = torch.Generator().manual_seed(3)
    t = torch.rand(data.shape[0], generator=gen)
    eps = torch.randn(data.shape, generator=gen)
    z = t.reshape(-1, 1, 1, 1) * eps + (1 - t.reshape(-1, 1, 1, 1)) * data
    with torch.no_grad():
        return float((model(z, t) - (eps - data)).pow(2).mean())


def test_prior_preservation_pulls_towards_the_data():
    data = _prior()
    plain, _ = run_finetune(steps=6, lr=3e-2)
    kept, result = run_finetune(steps=6, lr=3e-2, prior_weight=5.0, prior_data=data)
    assert result["config"]["prior_weight"] == 5.0
    # The reward pulls the model away from its pretraining loss; the prior term holds it.
    assert _fm_loss(kept, data) < _fm_loss(plain, data)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"prior_weight": 1.0}, "prior_weight=1.0 needs prior_data="),
        ({"prior_data": _prior()}, "prior_data= is only used with prior_weight > 0"),
        (
            {"prior_weight": 1.0, "prior_data": torch.zeros(3, 2, 2)},
            r"prior_data must be a tensor \[M, 1, 4, 4\]",
        ),
        ({"prior_weight": -1.0}, "prior_weight must be a finite float >= 0"),
    ],
)
def test_prior_settings_are_checked_before_any_work(overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        run_finetune(**overrides)


def test_start_run_steps_like_finetune():
    # The stepping API the paired benchmark interleaves runs with gives finetune's run.
    from gradest_digits.finetune import start_run

    _, reference = run_finetune(steps=2)
    run, sampler = start_run(
        tiny_dit(),
        LinearClassifierReward(),
        estimator="exact",
        mode="reward",
        steps=2,
        batch_size=BATCH,
        lr=1e-2,
        sampler_steps=STEPS,
        group_size=2,
        inner_epochs=2,
        labels=TARGET,
    )
    records = [run.step(k, sampler) for k in range(2)]
    assert [without_timings(r) for r in records] == [
        without_timings(r) for r in reference["history"]
    ]
    assert float(run.evaluate().mean()) == pytest.approx(reference["final_reward"], rel=1e-6)


def test_every_estimator_samples_the_same_noise_for_a_seed():
    # The estimators' draws have a stream of their own: with a learning rate too small to
    # move the model, exact and sdo (which draws a step every call) see the same batches,
    # so their logged rewards agree at every step.
    _, exact = run_finetune(steps=3, lr=1e-30)
    _, sdo = run_finetune(steps=3, lr=1e-30, estimator="sdo:samples=2")
    assert [r["reward_mean"] for r in exact["history"]] == [
        r["reward_mean"] for r in sdo["history"]
    ]
    assert {tuple(r["info"]["sampled_steps"]) for r in sdo["history"]} != {()}
