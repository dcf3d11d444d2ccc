"""The recipes' evaluation on held-out prompts (``eval_prompts``, ``eval_every``;
:mod:`gradest_recipes.evaluation`), with tiny random models on CPU.

Checked: an evaluating run logs a finite ``eval_reward`` at step 0, every ``eval_every``
steps and at the end, and otherwise trains bit for bit as the same run without
evaluations (log records, every checkpoint's LoRA, the exports, the EMA's); evaluations
are deterministic and their noise does not depend on ``seed``; the held-out prompts are
never drawn for training (grpo's group sampler and the reward recipe's draws) and every
evaluation scores each of them; with ``use_ema`` the evaluation scores the EMA weights
and leaves the trained ones bit for bit; a resumed run evaluates at the same steps; the
evaluation's sampler is the family's grid; 2 processes score the same mean as one; bad
settings are refused in one line.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from recipe_support import (
    RECIPE_WARNINGS,
    SCRIPTS,
    comparable,
    launch,
    lora_export,
    lora_file,
    records,
    rl_script,
    script,
)

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

pytestmark = RECIPE_WARNINGS

#: (family, objective) of the runs: Flow-GRPO's recipe and the reward recipe (a
#: flow-matching and a DDIM family).
RUNS = [("sd3", "grpo"), ("flux", "grpo"), ("sd3", "reward"), ("sd_unet", "reward")]
#: The tiny embeddings' prompts (gradest_recipes.embeddings.tiny_embeddings): 4, the
#: last 2 held out.
TRAINED = {"tiny prompt 0", "tiny prompt 1"}
HELD_OUT = {"tiny prompt 2", "tiny prompt 3"}


def _main(family: str, objective: str):
    return (rl_script(family, objective) if objective != "reward" else script(family)).main


def _run(family: str, objective: str, out: Path, *extra: str) -> None:
    argv = ["--tiny", "--out", str(out), "--report_to", "none", "--lr", "1e-2", *extra]
    if objective == "grpo":  # an EMA that moves from the first optimizer step on
        argv += ["--ema_every", "1"]
    assert _main(family, objective)(argv) == 0


def _without_eval(rows: list[dict]) -> list[dict]:
    """The training records, without the evaluation's values and step 0's record."""
    return [
        {k: v for k, v in row.items() if not k.startswith("eval_")}
        for row in comparable(rows)
        if row["step"] > 0
    ]


def _assert_same_lora(a: Path, b: Path, steps: int) -> None:
    for step in range(1, steps + 1):
        name = f"step_{step:06d}"
        first, second = lora_file(a / "checkpoints" / name), lora_file(b / "checkpoints" / name)
        assert set(first) == set(second)
        assert all(torch.equal(first[k], second[k]) for k in first), name
    folders = [Path("lora")] + ([Path("lora/ema")] if (a / "lora" / "ema").is_dir() else [])
    for folder in folders:
        first, second = lora_export(a / folder), lora_export(b / folder)
        assert set(first) == set(second)
        assert all(torch.equal(first[k], second[k]) for k in first), folder


@pytest.mark.parametrize(("family", "objective"), RUNS)
def test_an_evaluating_run_logs_eval_reward_and_trains_as_one_that_does_not(
    family, objective, tmp_path
):
    """eval_every = 1: a record of step 0 holding only the evaluation, then
    ``eval_reward`` finite in every step's record, changing as the model trains; the same
    run with eval_every = 0 (the same held-out split) writes the same training records
    and the same LoRA weights bit for bit: every checkpoint's, the export, the EMA's. A
    second evaluating run logs the same evaluations bit for bit."""
    common = ["--max_train_steps", "3", "--eval_prompts", "2", "--checkpointing_steps", "1",
              "--checkpoints_total_limit", "0"]  # fmt: skip
    on, again, off = tmp_path / "on", tmp_path / "again", tmp_path / "off"
    _run(family, objective, on, *common, "--eval_every", "1")
    _run(family, objective, again, *common, "--eval_every", "1")
    _run(family, objective, off, *common)
    rows = records(on)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"step", "eval_reward"}
    evaluations = [row["eval_reward"] for row in rows]
    assert all(math.isfinite(value) for value in evaluations)
    assert len(set(evaluations)) == len(evaluations)  # the model moves every step
    assert [row["eval_reward"] for row in records(again)] == evaluations  # deterministic
    assert all("eval_reward" not in row for row in records(off))
    assert _without_eval(rows) == comparable(records(off))
    _assert_same_lora(on, off, steps=3)


def test_the_evaluations_noise_does_not_depend_on_the_seed(tmp_path):
    """Step 0 scores the base model (every lora_B is zero whatever the seed draws for the
    LoRA init) on the evaluation's fixed noise: the same value for every seed; after a
    step the runs differ."""
    one, other = tmp_path / "one", tmp_path / "other"
    settings = ["--max_train_steps", "1", "--eval_prompts", "2", "--eval_every", "1"]
    _run("sd3", "reward", one, *settings, "--seed", "1")
    _run("sd3", "reward", other, *settings, "--seed", "2")
    first, second = records(one), records(other)
    assert first[0]["eval_reward"] == second[0]["eval_reward"]
    assert first[1]["eval_reward"] != second[1]["eval_reward"]


def _recording(monkeypatch) -> list[tuple[bool, list[str]]]:
    """Every ``family.make_cond`` call of the runs started afterwards, as ``(in an
    evaluation, the prompts of its rows)``: training draws and evaluations alike build
    their conditioning through it."""
    import gradest_recipes.train as train_module

    calls: list[tuple[bool, list[str]]] = []
    evaluating = [False]
    build_family, evaluate = train_module.build_family, train_module._Run.evaluate

    def recording_build(*args: Any, **kwargs: Any) -> Any:
        family = build_family(*args, **kwargs)
        make_cond = family.make_cond

        def recorded(embeddings, index, device):
            calls.append((evaluating[0], [embeddings.prompts[int(i)] for i in index]))
            return make_cond(embeddings, index, device)

        family.make_cond = recorded
        return family

    def recording_evaluate(self: Any) -> dict[str, float]:
        evaluating[0] = True
        try:
            return evaluate(self)
        finally:
            evaluating[0] = False

    monkeypatch.setattr(train_module, "build_family", recording_build)
    monkeypatch.setattr(train_module._Run, "evaluate", recording_evaluate)
    return calls


@pytest.mark.parametrize("objective", ["grpo", "reward"])
def test_held_out_prompts_are_never_trained_on(objective, monkeypatch, tmp_path):
    """4 tiny prompts, the last 2 held out: over 4 steps (grpo: Flow-GRPO's group sampler,
    2 rollout batches a step; reward: 2 micro-steps of independent draws) the training
    conditions on the first 2 only (both drawn), and each of the 5 evaluations (steps
    0 to 4) samples each held-out prompt exactly once; the sample grids show training
    prompts."""
    calls = _recording(monkeypatch)
    extra = ["--rollout_batches", "2"] if objective == "grpo" else ["--gradient_accumulation", "2"]
    _run("sd3", objective, tmp_path / "run", "--max_train_steps", "4", "--eval_prompts", "2",
         "--eval_every", "1", "--eval_batch_size", "1", *extra)  # fmt: skip
    trained = [p for evaluating, prompts in calls if not evaluating for p in prompts]
    evaluated = [p for evaluating, prompts in calls if evaluating for p in prompts]
    assert set(trained) == TRAINED  # both drawn, no held-out one
    assert sorted(evaluated) == sorted([*HELD_OUT] * 5)


def test_the_held_out_split_and_its_refusals():
    """hold_out: the last n rows (their per-prompt tensors; the negative prompt shared),
    none left to train on or a held-out prompt repeated among the training ones refused in
    one line naming the setting."""
    from gradest_recipes.config import RecipeConfigError
    from gradest_recipes.embeddings import PromptEmbeddings, tiny_embeddings
    from gradest_recipes.evaluation import hold_out

    embeddings = tiny_embeddings("sd3")
    training, held_out = hold_out(embeddings, 1)
    assert held_out is not None
    assert training.prompts == embeddings.prompts[:3] and held_out.prompts == embeddings.prompts[3:]
    for key in ("prompt_embeds", "pooled_prompt_embeds"):
        assert torch.equal(training.tensors[key], embeddings.tensors[key][:3])
        assert torch.equal(held_out.tensors[key], embeddings.tensors[key][3:])
    negative = embeddings.tensors["negative_prompt_embeds"]
    assert all(part.tensors["negative_prompt_embeds"] is negative for part in (training, held_out))
    assert hold_out(embeddings, 0) == (embeddings, None)
    with pytest.raises(RecipeConfigError, match=r"eval_prompts=4 .*4 prompts") as refused:
        hold_out(embeddings, 4)
    assert "\n" not in str(refused.value)
    repeated = PromptEmbeddings(
        family="sd3", prompts=("a", "b", "c", "a"), tensors=dict(embeddings.tensors)
    )
    with pytest.raises(RecipeConfigError, match=r"eval_prompts=1 .*'a' \(row 3\).*row 0"):
        hold_out(repeated, 1)


def _snapshot(run: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.trainable]


def test_the_evaluation_scores_the_ema_weights_and_restores_the_trained_ones(tmp_path):
    """grpo with its EMA (updated every step): the logged evaluation at the end is the
    EMA weights' score, not the trained weights'; evaluating leaves the trained weights
    bit for bit, and evaluates the same again."""
    from gradest_recipes.config import load_config
    from gradest_recipes.train import train

    config = load_config("sd3", overrides={
        "tiny": True, "objective": "grpo", "out": str(tmp_path / "run"), "report_to": "none",
        "lr": 1e-2, "ema_every": 1, "steps": 2, "eval_prompts": 2, "eval_every": 1,
    })  # fmt: skip
    run = train("sd3", config)
    logged = records(tmp_path / "run")[-1]["eval_reward"]
    trained = _snapshot(run)
    ema = [s.detach().clone() for s in run.ema.shadow_params]
    assert any(not torch.equal(a, b) for a, b in zip(trained, ema, strict=True))
    assert run.evaluate()["eval_reward"] == logged
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(run), trained, strict=True))
    keep = run.ema
    run.ema = None  # evaluate whatever the weights are
    try:
        own = run.evaluate()["eval_reward"]
        with torch.no_grad():
            for parameter, value in zip(run.trainable, ema, strict=True):
                parameter.copy_(value)
        assert run.evaluate()["eval_reward"] == logged  # the EMA weights' score
    finally:
        run.ema = keep
    assert own != logged


def test_a_resumed_run_evaluates_at_the_same_steps(tmp_path):
    """eval_every = 2, log_every = 3: records at 0, 2 (evaluations) and 3 (the end). Two
    steps, then a bare resume to 3, writes the same records and LoRA bit for bit as 3
    straight steps (the step-0 record kept through the resume's log cut)."""
    settings = ["--eval_prompts", "2", "--eval_every", "2", "--log_every", "3",
                "--checkpointing_steps", "1", "--checkpoints_total_limit", "0"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run("sd3", "grpo", straight, *settings, "--max_train_steps", "3")
    _run("sd3", "grpo", resumed, *settings, "--max_train_steps", "2")
    assert _main("sd3", "grpo")(
        ["--resume_from_checkpoint", "latest", "--output_dir", str(resumed),
         "--max_train_steps", "3"]
    ) == 0  # fmt: skip
    rows = records(straight)
    assert [row["step"] for row in rows] == [0, 2, 3]
    assert all("eval_reward" in row for row in rows)
    assert comparable(records(resumed)) == comparable(rows)
    _assert_same_lora(straight, resumed, steps=3)


@pytest.mark.parametrize("family", ["sd3", "flux", "sd_unet"])
def test_the_evaluation_samples_deterministically_on_the_familys_grid(family):
    """The evaluation's sampler is the deterministic one of a family built with
    num_inference_steps = eval_num_inference_steps: the same grid (Flux: FluxPipeline's
    sigmas for that many steps), Euler steps of the flow ODE (no step noise), DDIM with
    eta = 0 for the UNet families."""
    from gradest_recipes.config import load_config
    from gradest_recipes.embeddings import tiny_embeddings
    from gradest_recipes.evaluation import eval_sampler
    from gradest_recipes.families import build_family

    import gradest

    config = load_config(family, overrides={"tiny": True, "eval_num_inference_steps": 5})
    built = build_family(family, config, tiny_embeddings(family))
    sampler = eval_sampler(built, config)
    five = load_config(family, overrides={"tiny": True, "num_inference_steps": 5})
    reference = build_family(family, five, tiny_embeddings(family)).sampler
    assert sampler.num_steps == 5
    assert torch.equal(sampler.times, reference.times)
    if family == "sd_unet":
        assert type(sampler) is type(reference)
        for mine, theirs in zip(sampler.coefficients(), reference.coefficients(), strict=True):
            assert torch.equal(mine, theirs)
    else:
        assert type(sampler) is gradest.RectifiedFlow


def test_every_process_scores_its_share_once():
    """eval_batches: the processes' shares cover every held-out row once, each process
    makes the same number of sampling calls, and the stand-ins are not scored."""
    from gradest_recipes.evaluation import eval_batches

    for count, world, size in [(5, 2, 2), (1, 3, 4), (7, 3, 1), (4, 1, 8)]:
        shares = [eval_batches(count, rank, world, size) for rank in range(world)]
        assert len({len(batches) for batches in shares}) == 1
        scored = sorted(
            int(row) for batches in shares for b in batches for row in b.rows[: b.scored]
        )
        assert scored == list(range(count))
        assert all(b.rows.numel() <= size for batches in shares for b in batches)


def test_bad_evaluation_settings_are_refused_in_one_line(tmp_path):
    """Each refused with its name, in one line, before the run's folder is made."""
    from gradest_recipes.config import RecipeConfigError, config_from_argv

    cases = [
        (["--eval_every", "2"], r"eval_every=2 is invalid: an evaluation needs held-out"),
        (["--eval_prompts", "-1"], r"eval_prompts=-1 is invalid: must be an integer >= 0"),
        (["--eval_every", "-1"], r"eval_every=-1 is invalid"),
        (["--eval_num_inference_steps", "0"], r"eval_num_inference_steps=0 is invalid"),
        (["--eval_batch_size", "0"], r"eval_batch_size=0 is invalid"),
        (["--eval_prompts", "1.5"], r"eval_prompts='1.5' is invalid: must be an integer"),
    ]
    for argv, message in cases:
        with pytest.raises(RecipeConfigError, match=message) as refused:
            config_from_argv("sd3", ["--tiny", *argv], objective="grpo")
        assert "\n" not in str(refused.value)
    out = tmp_path / "run"
    with pytest.raises(RecipeConfigError, match=r"eval_prompts=4 is invalid") as refused:
        script("sd3").main(["--tiny", "--out", str(out), "--eval_prompts", "4"])
    assert "\n" not in str(refused.value)
    assert not out.exists()


GLOO = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


@pytest.mark.slow
@GLOO
def test_two_processes_score_the_same_mean_as_one(tmp_path):
    """torchrun with 2 CPU processes, 3 held-out prompts (shares of 2 and 1: the second
    process samples a stand-in it does not score): step 0's evaluation, of the base
    model, is the mean over the 3 prompts, as one process scores it (to float round-off:
    other batches)."""
    settings = ["--tiny", "--report_to", "none", "--max_train_steps", "1",
                "--eval_prompts", "3", "--eval_every", "1", "--eval_batch_size", "2"]  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "sd3_reward.py"), *settings, "--out", str(two)],
        tmp_path,
    )  # fmt: skip
    assert script("sd3").main([*settings, "--out", str(one)]) == 0
    first, second = records(two)[0], records(one)[0]
    assert first["step"] == second["step"] == 0
    assert first["eval_reward"] == pytest.approx(second["eval_reward"], rel=1e-6)
