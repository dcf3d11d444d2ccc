"""The reward fine-tuning recipes (``gradest_recipes``, ``examples/recipes/*_reward.py``).

Every recipe runs end to end on CPU with tiny random models built in code (``--tiny``: a
micro SD3 / Flux transformer or SD UNet, a micro ``AutoencoderKL``, random prompt
embeddings), in-process through the scripts' ``main(argv)``; one run goes through the
script as a subprocess, one through ``torchrun`` and one through ``accelerate launch``
with two CPU processes each (DDP over gloo), and one loads every part from a
``save_pretrained`` folder with ``--pretrained``. Checked: the outputs (log.jsonl,
tensorboard events, PNG grid, checkpoint, diffusers LoRA file), that only LoRA weights
change, that a resumed run equals an uninterrupted one bit for bit, that config files and
command-line overrides take effect, that bad values name the setting, and that the
classifier-free-guidance wrapper is the guidance formula and ``exact`` differentiates
through it like a hand-written autograd loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

from recipe_support import (  # noqa: E402
    ACCELERATE_TWO_CPU_PROCESSES,
    FAMILIES,
    LAUNCHER_ENV,
    RECIPE_WARNINGS,
    SCRIPTS,
    UNET_FAMILIES,
    assert_run_outputs,
    comparable,
    documented_lora_load,
    launch,
    lora_file,
    records,
    reset_accelerate,
    script,
)

pytestmark = RECIPE_WARNINGS

from gradest_recipes import RecipeConfigError, load_config  # noqa: E402
from gradest_recipes.config import config_from_argv  # noqa: E402
from gradest_recipes.embeddings import tiny_embeddings  # noqa: E402
from gradest_recipes.families import (  # noqa: E402
    build_family,
    pack_latents,
    tiny_denoiser,
    tiny_scheduler,
    tiny_vae,
    unpack_latents,
)
from gradest_recipes.rewards import decode_images, resolve_reward, reward_objective  # noqa: E402
from gradest_recipes.train import train  # noqa: E402

import gradest  # noqa: E402
from gradest.errors import InvalidValue  # noqa: E402
from gradest.integrations.diffusers import DiffusersVelocity, sampler_from_scheduler  # noqa: E402
from gradest.integrations.guidance import ClassifierFreeGuidance, EmbeddedGuidance  # noqa: E402

# -- 1. each recipe end to end ---------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_runs_end_to_end_and_trains_only_lora(family, tmp_path):
    out = tmp_path / family
    assert script(family).main(["--tiny", "--out", str(out), "--steps", "2"]) == 0
    assert_run_outputs(out, steps=2)

    # Only LoRA moved: rerun in-process to get the model, compare with a fresh tiny one.
    config = load_config(family, overrides={"tiny": True, "out": str(tmp_path / "again")})
    run = train(family, config)
    assert comparable(records(run.out)) == comparable(records(out))  # deterministic
    fresh = dict(tiny_denoiser(family).named_parameters())
    lora_b_moved = lora_a_moved = 0
    for name, parameter in run.family.denoiser.named_parameters():
        if "lora_" in name:
            assert parameter.requires_grad and parameter.dtype == torch.float32
            lora_b_moved += "lora_B" in name and bool(parameter.detach().abs().max() > 0)
            lora_a_moved += "lora_A" in name
            continue
        assert not parameter.requires_grad, name
        original = fresh[name.replace(".base_layer", "")]
        assert torch.equal(parameter.detach(), original.detach()), name
    assert lora_b_moved == lora_a_moved > 0  # every adapter's B left its zero init


def test_the_script_runs_as_a_subprocess(tmp_path):
    out = tmp_path / "sd3"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "sd3_reward.py"), "--tiny", "--out", str(out)],
        env={**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_run_outputs(out, steps=2)
    # One closing line says where the results are (the progress bar hides off a terminal).
    (line,) = done.stdout.splitlines()
    assert line.startswith("sd3: 2 steps done, last reward ")
    assert str(out / "lora" / "pytorch_lora_weights.safetensors") in line


def test_the_lora_export_loads_into_diffusers_and_reproduces_the_model(tmp_path):
    """``lora/pytorch_lora_weights.safetensors`` is diffusers' format; alpha is folded in.
    It is loaded with the call docs/recipes.md gives, read from the page and run as written
    on the run's ``lora`` folder (a call diffusers 0.42 refuses fails here)."""
    from safetensors.torch import load_file

    config = load_config(
        "sd3", overrides={"tiny": True, "out": str(tmp_path), "lr": 1e-2, "lora_alpha": 4.0}
    )
    trained = train("sd3", config).family.denoiser.eval()
    folder = tmp_path / "lora"
    state = load_file(str(folder / "pytorch_lora_weights.safetensors"))
    assert all(k.startswith("transformer.") and ".default." not in k for k in state)
    loaded = tiny_denoiser("sd3")
    loaded.load_lora_adapter(str(folder), **documented_lora_load())  # exactly the page's call
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8, generator=g),
        timestep=torch.tensor([500.0, 250.0]),
        encoder_hidden_states=torch.randn(2, 6, 16, generator=g),
        pooled_projections=torch.randn(2, 8, generator=g),
        return_dict=False,
    )
    with torch.no_grad():
        want = trained(**inputs)[0]
        got = loaded.eval()(**inputs)[0]
        base = tiny_denoiser("sd3").eval()(**inputs)[0]
    assert (want - base).abs().max() > 1e-4  # the adapters do something
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- 2. resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "sd_unet"])
def test_resume_continues_bit_for_bit(family, tmp_path):
    """A run stopped after step 2 and resumed to step 4 equals a run of 4 steps, bitwise.

    Why bitwise: every random draw of a step (prompts, noise, the estimator's generator)
    comes from a generator seeded by (seed, step, micro-step, process), not from a stream
    that a restart would cut; the checkpoint holds the LoRA tensors and AdamW's state
    exactly (safetensors / torch.save of the float32 tensors); the frozen weights are
    rebuilt identically; and on CPU the same operations in the same order round the same.
    """
    common = ["--tiny", "--estimator", "jagg:window=2", "--gradient-accumulation", "2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    main = script(family).main
    main([*common, "--out", str(whole), "--steps", "4", "--save-every", "2"])
    main([*common, "--out", str(split), "--steps", "2"])
    main(["--resume", str(split), "--steps", "4"])  # settings come from the checkpoint
    assert comparable(records(split)) == comparable(records(whole))
    assert [r["step"] for r in records(split)] == [1, 2, 3, 4]
    a, b = (lora_file(out / "checkpoints" / "step_000004") for out in (whole, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for out in (whole, split):
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
            "step_000002",
            "step_000004",
        ]


def test_resume_after_a_crash_shows_each_step_once_in_tensorboard(tmp_path):
    """A run that got past its last checkpoint (step 3 of a run checkpointed at 2) and is
    resumed redoes step 3: log.jsonl is cut back, and TensorBoard's purge_step hides the
    first attempt's step-3 events, so every step shows once, with the resumed values."""
    import time

    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    main = script("sd3").main
    out = tmp_path / "run"
    main(["--tiny", "--out", str(out), "--steps", "3", "--save-every", "2"])
    first = records(out)
    for leftover in (out / "checkpoints" / "step_000003").iterdir():
        leftover.unlink()  # the crash: step 3 ran and logged, its checkpoint never landed
    (out / "checkpoints" / "step_000003").rmdir()
    # TensorBoard orders event files by the second in their name; a real resume is a
    # later process, here wait for the next second.
    started = int(time.time())
    while int(time.time()) == started:
        time.sleep(0.05)
    main(["--resume", str(out), "--steps", "4"])
    resumed = records(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert comparable(resumed[:3]) == comparable(first)  # the redone step 3 is the same
    board = event_accumulator.EventAccumulator(str(out / "tensorboard"), {"scalars": 0})
    board.Reload()
    shown = [(e.step, e.value) for e in board.Scalars("train/seconds")]
    assert [step for step, _ in shown] == [1, 2, 3, 4]
    # the wall time of step 3 differs between attempts: TensorBoard shows the resumed one
    assert shown[2][1] == pytest.approx(resumed[2]["seconds"], rel=1e-6)
    assert shown[2][1] != pytest.approx(first[2]["seconds"], rel=1e-6)


def test_resume_refuses_changed_settings_and_finished_runs(tmp_path):
    main = script("sd3").main
    main(["--tiny", "--out", str(tmp_path)])
    with pytest.raises(RecipeConfigError, match=r"setting lr=0\.5 differs from the resumed"):
        main(["--resume", str(tmp_path), "--steps", "3", "--lr", "0.5"])
    with pytest.raises(ValueError, match=r"steps=2 .*already at step 2"):
        main(["--resume", str(tmp_path)])
    # The run folder's rule (gradest_lab.storage.run_folder): the folder's run.json, not its
    # log.jsonl,
    # says it holds a run, and the refusal names the documented resume and --out.
    with pytest.raises(
        InvalidValue, match=r"output_dir .*holds an earlier run.*--resume_from_checkpoint latest"
    ):
        main(["--tiny", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"resume=.*no checkpoint there"):
        main(["--tiny", "--resume", str(tmp_path / "nothing")])


# -- 3. configuration ------------------------------------------------------------------------------


def test_config_file_and_command_line_overrides_take_effect(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'tiny = true\nlr = 1e-3\nlora_rank = 3\nestimator = "truncated:k=1"\n'
        'lora_targets = ["to_q", "to_v"]\nreward = "color:r=0,g=1,b=0"\n'
    )
    out = tmp_path / "run"
    argv = ["--config", str(toml), "--lr", "2e-3", "--set", "lora_alpha=6", "--out", str(out)]
    config, _ = config_from_argv("sd3", argv)
    assert (config.lr, config.lora_rank, config.lora_alpha) == (2e-3, 3, 6.0)  # CLI > file
    assert config.lora_targets == ("to_q", "to_v") and config.estimator == "truncated:k=1"
    assert config.resolution == 16 and config.num_inference_steps == 3  # tiny defaults
    script("sd3").main(argv)
    saved = (out / "config.toml").read_text()
    assert "lr = 0.002" in saved and "lora_rank = 3" in saved and "lora_alpha = 6.0" in saved
    lora = lora_file(out / "checkpoints" / "step_000002")
    assert {tuple(v.shape) for k, v in lora.items() if "lora_A" in k} == {(3, 16)}  # rank 3
    assert not any("to_k" in k for k in lora)
    # The saved config.toml is itself a valid config file.
    assert load_config("sd3", file=out / "config.toml").lr == 2e-3


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--lr", "-1"], r"setting lr=-1\.0 is invalid: must be a finite number > 0"),
        (["--lr", "fast"], r"setting lr='fast' is invalid: must be a number"),
        (["--steps", "0"], r"setting steps=0 is invalid: must be an integer >= 1"),
        (["--mixed-precision", "fp8"], r"setting mixed_precision='fp8'.*'no', 'fp16', 'bf16'"),
        (["--resolution", "20"], r"setting resolution=20 .*multiple of 8.*use 16"),
        (["--lora-targets", ""], r"setting lora_targets=\(\).*non-empty"),
        (["--set", "lora_rnk=4"], r"unknown setting 'lora_rnk'.*did you mean 'lora_rank'"),
        (
            ["--set", "gradient_checkpointing=maybe"],
            r"gradient_checkpointing=.maybe. .*true or false",
        ),
        (["--no-tiny"], r"setting pretrained=None .*--pretrained /path/to/model"),
        (["--estimator", "nope"], r"setting estimator='nope' is invalid: unknown estimator"),
        (["--estimator", "jagg:windw=2"], r"setting estimator='jagg:windw=2' is invalid"),
        (
            ["--estimator", "telescope:mean_depth=4"],
            r"setting estimator='telescope:mean_depth=4' is invalid: .*mean_depth=4 exceeds "
            r"the sampler's N=3 steps",
        ),
        (["--reward", "sparkle"], r"setting reward='sparkle' is invalid.*module:function"),
        (["--reward", "color:q=1"], r"setting reward='color:q=1'.*takes options r, g, b"),
        (["--reward", "no_such_module:f"], r"setting reward=.*cannot import 'no_such_module'"),
        (["--eta", "0.5"], r"setting eta=0\.5 is invalid for the sd3 recipe"),
        (["--eta", "2"], r"setting eta=2\.0 is invalid: DDIM's eta must be in \[0, 1\]"),
    ],
)
def test_bad_values_name_the_setting(argv, match, tmp_path):
    with pytest.raises(RecipeConfigError, match=match):
        script("sd3").main(["--tiny", "--out", str(tmp_path / "out"), *argv])


def test_scripts_print_a_bad_setting_as_one_line(capsys, tmp_path):
    from gradest_recipes.train import script_main

    assert script_main("flux", ["--tiny", "--out", str(tmp_path), "--lr", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("error: setting lr=-1.0 is invalid: must be a finite number > 0")
    assert "\n" not in err


def test_bad_files_name_the_setting(tmp_path):
    main = script("sd3").main
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("lr = [1\n")
    with pytest.raises(RecipeConfigError, match=r"config file .*bad\.toml.* not valid TOML"):
        main(["--config", str(bad_toml)])
    typo = tmp_path / "typo.toml"
    typo.write_text("learning_rat = 1e-4\n")
    with pytest.raises(RecipeConfigError, match=r"unknown setting 'learning_rat' in config"):
        main(["--config", str(typo)])
    missing = ["--pretrained", str(tmp_path), "--embeddings", str(tmp_path / "none.pt")]
    with pytest.raises(ValueError, match=r"setting embeddings=.*none\.pt.*no such file"):
        main(["--out", str(tmp_path / "a"), *missing])
    embeddings = tmp_path / "e.pt"
    tiny_embeddings("flux").to_file(embeddings)
    with pytest.raises(ValueError, match=r"embeddings=.*holds 'flux' embeddings.*'sd3'"):
        main(["--out", str(tmp_path / "b"), "--pretrained", str(tmp_path),
              "--embeddings", str(embeddings)])  # fmt: skip
    tiny_embeddings("sd3").to_file(embeddings)
    with pytest.raises(ValueError, match=r"pretrained=.*cannot load SD3Transformer2DModel"):
        main(["--out", str(tmp_path / "c"), "--pretrained", str(tmp_path / "nowhere"),
              "--embeddings", str(embeddings)])  # fmt: skip


def test_fp16_on_a_cpu_is_refused_and_bf16_runs(tmp_path):
    main = script("sd3").main
    if not torch.cuda.is_available():
        with pytest.raises(RecipeConfigError, match=r"mixed_precision='fp16' is invalid on a"):
            main(["--tiny", "--out", str(tmp_path / "fp16"), "--mixed-precision", "fp16"])
    main(["--tiny", "--out", str(tmp_path / "bf16"), "--mixed-precision", "bf16"])
    reset_accelerate()
    config = load_config("sd3", overrides={"tiny": True, "out": str(tmp_path / "fp32")})
    train("sd3", config)
    bf16, fp32 = records(tmp_path / "bf16"), records(tmp_path / "fp32")
    assert [r["step"] for r in bf16] == [1, 2]
    assert bf16[0]["reward"] != fp32[0]["reward"]  # bf16 really ran (frozen weights in bf16)
    assert abs(bf16[0]["reward"] - fp32[0]["reward"]) < 1e-2


def test_gradient_checkpointing_gives_the_same_run(tmp_path):
    """diffusers' ``enable_gradient_checkpointing()`` recomputes activations in the
    backward: the same operations, so the same numbers (float32 CPU: bit for bit)."""
    main = script("sd_unet").main
    main(["--tiny", "--out", str(tmp_path / "plain"), "--estimator", "exact"])
    reset_accelerate()
    main(["--tiny", "--out", str(tmp_path / "ckpt"), "--estimator", "exact",
          "--gradient-checkpointing"])  # fmt: skip
    assert comparable(records(tmp_path / "ckpt")) == comparable(records(tmp_path / "plain"))


# -- 4. real-weight loading path, a reward hook, two processes --------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_folders_and_embedding_files_load(family, tmp_path):
    """``--pretrained`` reads transformer|unet / vae / scheduler subfolders with
    from_pretrained and ``--embeddings`` a .pt file: the same run as ``--tiny``."""
    model = tmp_path / "model"
    tiny_denoiser(family).save_pretrained(model / ("unet" if family in UNET_FAMILIES else
                                                   "transformer"))  # fmt: skip
    tiny_vae().save_pretrained(model / "vae")
    tiny_scheduler(family).save_pretrained(model / "scheduler")
    tiny_embeddings(family).to_file(tmp_path / "prompts.pt")
    small = ["--resolution", "16", "--num-inference-steps", "3", "--batch-size", "2",
             "--lora-rank", "2", "--sample-count", "2", "--steps", "2"]  # fmt: skip
    real = tmp_path / "real"
    script(family).main(
        ["--pretrained", str(model), "--embeddings", str(tmp_path / "prompts.pt"),
         "--out", str(real), *small]
    )  # fmt: skip
    config = load_config(family, overrides={"tiny": True, "out": str(tmp_path / "tiny")})
    train(family, config)
    assert comparable(records(real)) == comparable(records(tmp_path / "tiny"))


def tiny_sd_pipeline_folder(folder: Path) -> Path:
    """A tiny random StableDiffusionPipeline saved like a hub model: a CLIP tokenizer with
    a 54-token vocabulary (letters), a 1-layer CLIP text encoder of width 16."""
    transformers = pytest.importorskip("transformers")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in "abcdefghijklmnopqrstuvwxyz":
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    try:
        tokenizer = transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=6)
    except TypeError:  # transformers < 5 reads vocabulary files
        pytest.skip("needs transformers >= 5 to build a tokenizer in memory")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        encoder = transformers.CLIPTextModel(
            transformers.CLIPTextConfig(
                vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=6,
                projection_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=1,
            )
        )  # fmt: skip
    pipe = diffusers.StableDiffusionPipeline(
        vae=tiny_vae(), text_encoder=encoder, tokenizer=tokenizer,
        unet=tiny_denoiser("sd_unet"), scheduler=tiny_scheduler("sd_unet"),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_precomputed_prompts_from_real_text_encoders_train(tmp_path):
    """``python -m gradest_recipes.prompts`` encodes prompts with a saved pipeline's own
    tokenizer and text encoder (``encode_prompt``, CFG's empty negative prompt too), and
    the sd_unet recipe trains on that file with ``--pretrained`` pointing at the pipeline:
    the whole real-weight path, at tiny size (SD3's and Flux's T5 encoders are not built
    here)."""
    from gradest_recipes import prompts

    model = tiny_sd_pipeline_folder(tmp_path / "pipe")
    (tmp_path / "prompts.txt").write_text("a red cat\n\nblue sky\n")
    out_file = tmp_path / "prompts.pt"
    argv = ["--family", "sd_unet", "--pretrained", str(model), "--prompts",
            str(tmp_path / "prompts.txt"), "--out", str(out_file), "--device", "cpu",
            "--dtype", "float32"]  # fmt: skip
    assert prompts.main(argv) == 0
    data = torch.load(out_file, weights_only=True)
    assert data["prompts"] == ["a red cat", "blue sky"] and data["family"] == "sd_unet"
    assert data["prompt_embeds"].shape == (2, 6, 16)
    assert data["negative_prompt_embeds"].shape == (1, 6, 16)
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(model))
    want, negative = pipe.encode_prompt(["blue sky"], "cpu", 1, True, negative_prompt=[""])
    assert torch.equal(data["prompt_embeds"][1:], want)
    assert torch.equal(data["negative_prompt_embeds"], negative)
    run = tmp_path / "run"
    small = ["--resolution", "16", "--num-inference-steps", "3", "--steps", "2",
             "--lora-rank", "2", "--sample-count", "2", "--save-every", "0"]  # fmt: skip
    script("sd_unet").main(
        ["--pretrained", str(model), "--embeddings", str(out_file), "--out", str(run), *small]
    )
    assert_run_outputs(run, steps=2)


def test_a_reward_hook_from_a_file_gets_images_and_prompts(tmp_path):
    hook = tmp_path / "my_reward.py"
    hook.write_text(
        "import json, pathlib\n"
        "SEEN = pathlib.Path(__file__).with_name('seen.jsonl')\n"
        "def redness(images, prompts):\n"
        "    with SEEN.open('a') as f:\n"
        "        f.write(json.dumps({'shape': list(images.shape), 'prompts': prompts}) + '\\n')\n"
        "    return images[:, 0].mean(dim=(1, 2)) - images[:, 1:].mean(dim=(1, 2, 3))\n"
    )
    out = tmp_path / "out"
    script("flux").main(["--tiny", "--out", str(out), "--reward", f"{hook}:redness"])
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert seen and all(s["shape"] == [2, 3, 16, 16] for s in seen)
    assert all(len(s["prompts"]) == 2 and s["prompts"][0].startswith("tiny prompt") for s in seen)
    assert len(records(out)) == 2


GLOO = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)


def assert_two_process_run(out: Path, family: str, tmp_path: Path, **overrides) -> None:
    """One DDP run of 2 processes: one log, one checkpoint with both processes' RNG
    states, and a logged reward that is not a single process's."""
    assert_run_outputs(out, steps=2)
    checkpoint = out / "checkpoints" / "step_000002"
    assert sorted(p.name for p in checkpoint.glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    one = tmp_path / "one"
    train(family, load_config(family, overrides={"tiny": True, "out": str(one), **overrides}))
    # The logged reward is the mean over both processes' batches (other noise than one's).
    assert records(out)[0]["reward"] != records(one)[0]["reward"]


@pytest.mark.slow
@GLOO
def test_two_processes_under_torchrun_train_data_parallel(tmp_path):
    """``torchrun --nproc_per_node 2``: one DDP run over gloo on CPU."""
    out = tmp_path / "ddp"
    launch(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPTS / "sd3_reward.py"), "--tiny", "--out", str(out)],
        tmp_path,
    )  # fmt: skip
    assert_two_process_run(out, "sd3", tmp_path)


@pytest.mark.slow
@GLOO
def test_two_processes_under_accelerate_launch_train_data_parallel(tmp_path):
    """``accelerate launch`` with 2 CPU processes, every setting a flag (no config file):
    sd_unet with a jagg estimator, one DDP run over gloo."""
    out = tmp_path / "ddp"
    launch(
        [sys.executable, "-m", "accelerate.commands.launch", *ACCELERATE_TWO_CPU_PROCESSES,
         str(SCRIPTS / "sd_unet_reward.py"), "--tiny", "--out", str(out),
         "--estimator", "jagg:window=2"],
        tmp_path,
    )  # fmt: skip
    assert "jagg:window=2" in (out / "config.toml").read_text()  # the script's own flags
    assert_two_process_run(out, "sd_unet", tmp_path, estimator="jagg:window=2")


# -- 5. classifier-free guidance ---------------------------------------------------------------

GUIDANCE = 4.5


def tiny_sd3_float64():
    transformer = tiny_denoiser("sd3").to(torch.float64).eval()
    return DiffusersVelocity(transformer)


def guided_inputs(batch: int = 2):
    g = torch.Generator().manual_seed(5)

    def normal(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64)

    cond = {
        "encoder_hidden_states": normal(batch, 6, 16),
        "pooled_projections": normal(batch, 8),
        "negative_encoder_hidden_states": normal(1, 6, 16).expand(batch, 6, 16),
        "negative_pooled_projections": normal(1, 8).expand(batch, 8),
    }
    return normal(batch, 4, 8, 8), cond


def test_the_cfg_wrapper_is_the_guidance_formula():
    """One batched call on [uncond; cond] against two separate calls. Equal to float64
    round-off, not bitwise: a batch of 2B rows may take other BLAS kernels than B rows."""
    model = tiny_sd3_float64()
    z, cond = guided_inputs()
    t = torch.tensor([0.7, 0.3], dtype=torch.float64)
    plain = {k: v for k, v in cond.items() if not k.startswith("negative_")}
    uncond = {k[len("negative_") :]: v for k, v in cond.items() if k.startswith("negative_")}
    with torch.no_grad():
        v_c, v_u = model(z, t, **plain), model(z, t, **uncond)
        guided = ClassifierFreeGuidance(model, GUIDANCE)(z, t, **cond)
        unguided = ClassifierFreeGuidance(model, 1.0)(z, t, **cond)
    torch.testing.assert_close(guided, v_u + GUIDANCE * (v_c - v_u), rtol=1e-12, atol=1e-12)
    assert torch.equal(unguided, v_c)  # w = 1: the conditional call alone
    with pytest.raises(ValueError, match=r"'negative_pooled_projections'.*no 'pooled_proj"):
        ClassifierFreeGuidance(model, GUIDANCE)(
            z, t, encoder_hidden_states=cond["encoder_hidden_states"],
            negative_pooled_projections=cond["negative_pooled_projections"],
        )  # fmt: skip


def test_exact_through_the_cfg_wrapper_equals_a_handwritten_autograd_loop():
    """``exact`` (estimate and surrogate) on the guided model, with the reward decoded by
    a VAE, equals backpropagation through a hand-written Euler loop that calls the model
    twice per step (float64; every transformer parameter trainable)."""
    model = tiny_sd3_float64()
    vae = tiny_vae().to(torch.float64).requires_grad_(False)
    flow = sampler_from_scheduler(tiny_scheduler("sd3"), 3)
    noise, cond = guided_inputs()
    reward = resolve_reward("contrast")
    objective = reward_objective(reward, vae, lambda z: z, ["a", "b"])
    guided = ClassifierFreeGuidance(model, GUIDANCE)
    params = [p for p in model.parameters() if p.requires_grad]
    plain = {k: v for k, v in cond.items() if not k.startswith("negative_")}
    uncond = {k[len("negative_") :]: v for k, v in cond.items() if k.startswith("negative_")}

    z = noise
    for k in range(flow.num_steps):
        t = torch.full((2,), float(flow.times[k]), dtype=torch.float64)
        v_c, v_u = model(z, t, **plain), model(z, t, **uncond)
        z = z + float(flow.times[k + 1] - flow.times[k]) * (v_u + GUIDANCE * (v_c - v_u))
    loss = -reward(decode_images(vae, z)).mean()
    by_hand = torch.autograd.grad(loss, params)
    by_hand_flat = torch.cat([g.reshape(-1) for g in by_hand])

    est = gradest.estimator("exact")
    result = est.estimate(guided, flow, objective, noise=noise, cond=cond)
    names = [n for n, p in guided.named_parameters() if p.requires_grad]
    got = torch.cat([result.grads[n].reshape(-1) for n in names])
    assert abs(result.info["loss"] - loss.item()) < 1e-12
    assert (got - by_hand_flat).norm() <= 1e-10 * by_hand_flat.norm()
    model.zero_grad(set_to_none=True)
    est.surrogate(guided, flow, objective, noise=noise, cond=cond).loss.backward()
    surrogate = torch.cat([p.grad.reshape(-1) for p in params])
    assert (surrogate - by_hand_flat).norm() <= 1e-10 * by_hand_flat.norm()


# -- 6. family plumbing against the diffusers pipelines ----------------------------------------


def test_flux_packing_ids_and_sigmas_are_the_pipelines():
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    latents = torch.randn(2, 4, 8, 6)
    packed = pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 4, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), latents)
    # FluxPipeline._unpack_latents takes the image size in pixels (vae_scale_factor 2 here)
    unpacked = FluxPipeline._unpack_latents(packed, 16, 12, 2)
    assert torch.equal(unpacked.reshape(latents.shape), latents)

    config = load_config("flux", overrides={"tiny": True})
    family = build_family("flux", config, tiny_embeddings("flux"))
    ids = FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)
    # The guidance embedding's wrapper (FLUX.1-dev) around the DiffusersVelocity.
    assert isinstance(family.velocity, EmbeddedGuidance)
    assert family.velocity.scale == config.guidance_scale
    assert torch.equal(family.velocity.model.fixed_kwargs["img_ids"], ids)
    scheduler = tiny_scheduler("flux")
    c = scheduler.config
    n = config.num_inference_steps
    mu = calculate_shift(16, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    import numpy as np

    retrieve_timesteps(scheduler, n, "cpu", sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    torch.testing.assert_close(
        family.sampler.times, scheduler.sigmas.to(torch.float64), rtol=0, atol=1e-7
    )
    assert family.latent_shape == (16, 16)


def test_sd_unet_uses_ddim_with_eta():

    config = load_config("sd_unet", overrides={"tiny": True, "eta": 0.5})
    family = build_family("sd_unet", config, tiny_embeddings("sd_unet"))
    want = sampler_from_scheduler(tiny_scheduler("sd_unet"), 3, eta=0.5)
    assert family.sampler.eta == 0.5
    assert torch.equal(family.sampler.times, want.times)
    assert isinstance(family.velocity, ClassifierFreeGuidance)
    assert family.velocity.model.input_name == "sample"
