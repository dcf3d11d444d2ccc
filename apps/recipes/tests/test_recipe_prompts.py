"""``python -m gradest_recipes.prompts`` for SD3 and Flux, with real (tiny) text encoders.

Each test saves a tiny random ``StableDiffusion3Pipeline`` / ``FluxPipeline`` like a hub
model, all built offline in code: CLIP tokenizers with a letter vocabulary, a T5
(Unigram) tokenizer, 1-layer CLIP / T5 text encoders, and the recipes' own tiny
transformer, VAE and scheduler (:mod:`gradest_recipes.families`), so the encoders' widths
are the ones the tiny transformer takes (``joint_attention_dim`` 16, ``pooled_projection_dim``
8). Checked: the file ``prompts.main`` writes equals the pipeline's own ``encode_prompt``
(SD3: CLIP-L + CLIP-G zero-padded to T5's width and concatenated with T5 along the
tokens, the pooled outputs concatenated, CFG's empty negative prompt; Flux: T5 tokens,
CLIP's pooled output, ``text_ids``), and the recipe trains 2 steps on it with
``--pretrained`` pointing at the same folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

from gradest_recipes import prompts  # noqa: E402
from gradest_recipes.embeddings import TINY_POOLED_DIM, TINY_TEXT_DIM  # noqa: E402
from gradest_recipes.families import tiny_denoiser, tiny_scheduler, tiny_vae  # noqa: E402
from recipe_support import RECIPE_WARNINGS, assert_run_outputs, script  # noqa: E402

pytestmark = [
    *RECIPE_WARNINGS,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CLIP_TOKENS = 6  # the CLIP tokenizers' model_max_length (77 in the real models)
T5_TOKENS = 8  # --max-sequence-length (SD3: 256, Flux: 512 by default)
PROMPTS = ["a red cat", "blue sky", "a very long prompt that both tokenizers truncate"]
SMALL = ["--resolution", "16", "--num-inference-steps", "3", "--steps", "2",
         "--lora-rank", "2", "--sample-count", "2", "--save-every", "0"]  # fmt: skip


def clip_tokenizer():
    """A CLIP BPE tokenizer over single letters (no merges), built in memory."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in LETTERS:
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    try:
        return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_TOKENS)
    except TypeError:  # transformers < 5 reads vocabulary files
        pytest.skip("needs transformers >= 5 to build a tokenizer in memory")


def t5_tokenizer():
    """A T5 (Unigram) tokenizer over ``▁`` and single letters, built in memory."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(letter, -3.0) for letter in LETTERS]
    try:
        return transformers.T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    except TypeError:  # transformers < 5 reads a sentencepiece model
        pytest.skip("needs transformers >= 5 to build a tokenizer in memory")


def clip_config(hidden: int, projection: int):
    return transformers.CLIPTextConfig(
        vocab_size=2 + 2 * len(LETTERS), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
        projection_dim=projection, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip


def t5_encoder():
    config = transformers.T5Config(
        vocab_size=3 + 1 + len(LETTERS), d_model=TINY_TEXT_DIM, d_kv=4, d_ff=32,
        num_layers=1, num_heads=2, relative_attention_num_buckets=8,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5EncoderModel(config)


def tiny_sd3_pipeline_folder(folder: Path) -> Path:
    """SD3: CLIP-L (width 4) + CLIP-G (width 8), zero-padded to T5's 16 =
    ``joint_attention_dim``; pooled: projections 3 + 5 = 8 = ``pooled_projection_dim``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        clip_l = transformers.CLIPTextModelWithProjection(clip_config(4, 3))
        clip_g = transformers.CLIPTextModelWithProjection(clip_config(8, TINY_POOLED_DIM - 3))
        t5 = t5_encoder()
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=tiny_denoiser("sd3"), scheduler=tiny_scheduler("sd3"), vae=tiny_vae(),
        text_encoder=clip_l, tokenizer=clip_tokenizer(),
        text_encoder_2=clip_g, tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5, tokenizer_3=t5_tokenizer(),
    )  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


def tiny_flux_pipeline_folder(folder: Path) -> Path:
    """Flux: T5 of width 16 = ``joint_attention_dim``; CLIP's pooled output of width 8 =
    ``pooled_projection_dim``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        clip = transformers.CLIPTextModel(clip_config(TINY_POOLED_DIM, 4))
        t5 = t5_encoder()
    pipe = diffusers.FluxPipeline(
        transformer=tiny_denoiser("flux"), scheduler=tiny_scheduler("flux"), vae=tiny_vae(),
        text_encoder=clip, tokenizer=clip_tokenizer(),
        text_encoder_2=t5, tokenizer_2=t5_tokenizer(),
    )  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


def encode(tmp_path: Path, family: str, model: Path, *extra: str) -> dict:
    (tmp_path / "prompts.txt").write_text("\n".join([PROMPTS[0], "", *PROMPTS[1:]]) + "\n")
    out_file = tmp_path / "prompts.pt"
    argv = ["--family", family, "--pretrained", str(model), "--prompts",
            str(tmp_path / "prompts.txt"), "--out", str(out_file), "--device", "cpu",
            "--max-sequence-length", str(T5_TOKENS), *extra]  # fmt: skip
    assert prompts.main(argv) == 0
    data = torch.load(out_file, weights_only=True)
    assert data["family"] == family and data["prompts"] == PROMPTS
    return data


def train_on(tmp_path: Path, family: str, model: Path) -> None:
    run = tmp_path / "run"
    argv = ["--pretrained", str(model), "--embeddings", str(tmp_path / "prompts.pt"),
            "--out", str(run), *SMALL]  # fmt: skip
    assert script(family).main(argv) == 0
    assert_run_outputs(run, steps=2)


def test_sd3_prompts_match_the_pipeline_and_the_recipe_trains_on_them(tmp_path):
    model = tiny_sd3_pipeline_folder(tmp_path / "pipe")
    data = encode(tmp_path, "sd3", model, "--dtype", "float32")
    tokens = CLIP_TOKENS + T5_TOKENS
    assert data["prompt_embeds"].shape == (3, tokens, TINY_TEXT_DIM)
    assert data["pooled_prompt_embeds"].shape == (3, TINY_POOLED_DIM)
    assert data["negative_prompt_embeds"].shape == (1, tokens, TINY_TEXT_DIM)
    assert data["negative_pooled_prompt_embeds"].shape == (1, TINY_POOLED_DIM)

    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(str(model))
    with torch.no_grad():  # as the pipeline's __call__ (grad mode picks other kernels)
        want, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=PROMPTS, prompt_2=None, prompt_3=None, device="cpu",
            do_classifier_free_guidance=True, negative_prompt="",
            max_sequence_length=T5_TOKENS,
        )  # fmt: skip
        ids = pipe.tokenizer_3(PROMPTS, padding="max_length", max_length=T5_TOKENS,
                               truncation=True, return_tensors="pt").input_ids  # fmt: skip
        t5 = pipe.text_encoder_3(ids)[0]
    assert torch.equal(data["prompt_embeds"], want)
    assert torch.equal(data["pooled_prompt_embeds"], pooled)
    assert torch.equal(data["negative_prompt_embeds"], negative[:1])
    assert torch.equal(data["negative_pooled_prompt_embeds"], negative_pooled[:1])
    # The negative prompt's rows agree (to batched round-off): the file keeps one.
    torch.testing.assert_close(negative, negative[:1].expand_as(negative))
    # The layout the transformer reads: CLIP-L | CLIP-G | zeros on the first tokens, T5 after.
    assert torch.equal(data["prompt_embeds"][:, :CLIP_TOKENS, 12:], torch.zeros(3, 6, 4))
    assert torch.equal(data["prompt_embeds"][:, CLIP_TOKENS:], t5)
    assert not torch.equal(data["prompt_embeds"][0], data["prompt_embeds"][1])

    train_on(tmp_path, "sd3", model)


def test_flux_prompts_match_the_pipeline_and_the_recipe_trains_on_them(tmp_path):
    model = tiny_flux_pipeline_folder(tmp_path / "pipe")
    data = encode(tmp_path, "flux", model, "--dtype", "float32")
    assert data["prompt_embeds"].shape == (3, T5_TOKENS, TINY_TEXT_DIM)
    assert data["pooled_prompt_embeds"].shape == (3, TINY_POOLED_DIM)
    assert "negative_prompt_embeds" not in data  # Flux: a guidance embedding, no CFG

    pipe = diffusers.FluxPipeline.from_pretrained(str(model))
    with torch.no_grad():  # as the pipeline's __call__ (grad mode picks other kernels)
        want, pooled, text_ids = pipe.encode_prompt(
            prompt=PROMPTS, prompt_2=None, device="cpu", max_sequence_length=T5_TOKENS
        )
        ids = pipe.tokenizer(PROMPTS, padding="max_length", max_length=CLIP_TOKENS,
                             truncation=True, return_tensors="pt").input_ids  # fmt: skip
        clip_pooled = pipe.text_encoder(ids).pooler_output
    assert torch.equal(data["prompt_embeds"], want)
    assert torch.equal(data["pooled_prompt_embeds"], pooled)
    assert torch.equal(data["text_ids"], text_ids)
    assert torch.equal(data["pooled_prompt_embeds"], clip_pooled)
    assert not torch.equal(data["prompt_embeds"][0], data["prompt_embeds"][1])

    train_on(tmp_path, "flux", model)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_default_bfloat16_encoding_is_close_to_float32(family, tmp_path):
    """The default ``--dtype bfloat16`` runs the encoders in bfloat16 and stores float32."""
    build = {"sd3": tiny_sd3_pipeline_folder, "flux": tiny_flux_pipeline_folder}[family]
    model = build(tmp_path / "pipe")
    (tmp_path / "f32").mkdir()
    (tmp_path / "bf16").mkdir()
    full = encode(tmp_path / "f32", family, model, "--dtype", "float32")
    half = encode(tmp_path / "bf16", family, model)
    for key, value in full.items():
        if isinstance(value, torch.Tensor):
            assert half[key].dtype == torch.float32 and half[key].shape == value.shape
            torch.testing.assert_close(half[key], value, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_batches_of_prompts_give_the_same_rows(family, tmp_path):
    """``encode_prompts`` in batches of 2 (3 prompts: a short last batch) gives the rows of
    one batch, to float32 round-off; the negative prompt's row comes from the last batch."""
    build = {"sd3": tiny_sd3_pipeline_folder, "flux": tiny_flux_pipeline_folder}[family]
    model = str(build(tmp_path / "pipe"))
    options = {"device": "cpu", "dtype": torch.float32, "max_sequence_length": T5_TOKENS}
    whole = prompts.encode_prompts(family, model, PROMPTS, **options)
    batched = prompts.encode_prompts(family, model, PROMPTS, batch_size=2, **options)
    assert whole.prompts == batched.prompts == tuple(PROMPTS)
    assert sorted(whole.tensors) == sorted(batched.tensors)
    for key, value in whole.tensors.items():
        torch.testing.assert_close(batched.tensors[key], value)


def test_bad_arguments_name_the_flag_and_the_fix(tmp_path, capsys, monkeypatch):
    model = tiny_flux_pipeline_folder(tmp_path / "pipe")
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "empty").mkdir()
    base = ["--out", str(tmp_path / "p.pt"), "--device", "cpu", "--dtype", "float32"]

    def refused(family: str, folder: Path, text: str, *extra: str) -> str:
        argv = ["--family", family, "--pretrained", str(folder), "--prompts",
                str(tmp_path / text), *base, *extra]  # fmt: skip
        capsys.readouterr()  # drop earlier output (progress bars)
        assert prompts.script_main(argv) == 2
        lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
        errors = [line for line in lines if "error" in line]
        assert len(errors) == 1  # one line
        assert errors[0].startswith("python -m gradest_recipes.prompts: error: ")
        return errors[0]

    assert "--pretrained" in refused("flux", tmp_path / "missing", "prompts.txt")
    err = refused("flux", tmp_path / "empty", "prompts.txt")
    assert "--pretrained" in err and "model_index.json" in err
    err = refused("sd3", model, "prompts.txt")  # a Flux folder for SD3
    assert "holds a FluxPipeline, not a StableDiffusion3Pipeline; use --family flux" in err
    err = refused("flux", model, "prompts.txt", "--max-sequence-length", "600")
    assert "--max-sequence-length" in err and "1 to 512" in err
    err = refused("sd_unet", model, "prompts.txt", "--max-sequence-length", "8")
    assert "--max-sequence-length" in err and "leave it unset" in err
    assert "--prompts" in refused("flux", model, "blank.txt")
    assert "--prompts" in refused("flux", model, "nowhere.txt")
    assert not (tmp_path / "p.pt").exists()

    encode_prompt = diffusers.FluxPipeline.encode_prompt

    def overflowing(self, *args, **kwargs):  # as T5 does in float16
        embeds, pooled, text_ids = encode_prompt(self, *args, **kwargs)
        return embeds * float("inf"), pooled, text_ids

    monkeypatch.setattr(diffusers.FluxPipeline, "encode_prompt", overflowing)
    err = refused("flux", model, "prompts.txt", "--max-sequence-length", "8")
    assert "--dtype" in err and "non-finite prompt_embeds" in err


def test_a_validation_prompt_is_encoded_with_the_pipelines_text_encoders(tmp_path):
    """``--validation_prompt`` with ``--pretrained``: the sample grids' prompt, encoded by
    the pipeline's own encoders (as ``gradest_recipes.prompts`` encodes), grid written."""
    from gradest_recipes.config import config_from_argv
    from gradest_recipes.train import saved_settings, train

    model = tiny_sd3_pipeline_folder(tmp_path / "pipe")
    encode(tmp_path, "sd3", model, "--dtype", "float32")
    out = tmp_path / "run"
    argv = ["--pretrained_model_name_or_path", str(model), "--embeddings",
            str(tmp_path / "prompts.pt"), "--output_dir", str(out), *SMALL,
            "--validation_prompt", "a red cat", "--validation_steps", "1"]  # fmt: skip
    config, _ = config_from_argv("sd3", argv, saved_from=saved_settings)
    run = train("sd3", config)
    want = prompts.encode_prompts("sd3", str(model), ["a red cat"], device="cpu",
                                  dtype=torch.float32)  # fmt: skip
    assert run.validation is not None and run.validation.prompts == ("a red cat",)
    assert run.validation.tensors.keys() == want.tensors.keys()
    for key, value in want.tensors.items():
        assert torch.equal(run.validation.tensors[key], value), key
    assert (out / "samples" / "step_000001.png").is_file()
    assert (out / "samples" / "step_000002.png").is_file()


def tiny_sdxl_pipeline_folder(folder: Path) -> Path:
    """SDXL: CLIP-L (width 4) + CLIP-G (width 12) concatenated = 16 = the UNet's
    ``cross_attention_dim``; CLIP-G's projection 8 = the pooled ``text_embeds`` the tiny
    UNet's ``text_time`` embedding takes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        clip_l = transformers.CLIPTextModel(clip_config(4, 4))
        clip_g = transformers.CLIPTextModelWithProjection(
            clip_config(TINY_TEXT_DIM - 4, TINY_POOLED_DIM)
        )
    pipe = diffusers.StableDiffusionXLPipeline(
        unet=tiny_denoiser("sdxl"), scheduler=tiny_scheduler("sdxl"), vae=tiny_vae(),
        text_encoder=clip_l, tokenizer=clip_tokenizer(),
        text_encoder_2=clip_g, tokenizer_2=clip_tokenizer(),
    )  # fmt: skip
    pipe.save_pretrained(folder)
    return folder


def test_sdxl_prompts_match_the_pipeline_and_the_recipe_trains_on_them(tmp_path):
    model = tiny_sdxl_pipeline_folder(tmp_path / "pipe")
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    argv = ["--family", "sdxl", "--pretrained", str(model), "--prompts",
            str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "prompts.pt"),
            "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    assert prompts.main(argv) == 0
    data = torch.load(tmp_path / "prompts.pt", weights_only=True)
    assert data["family"] == "sdxl" and data["prompts"] == PROMPTS
    assert data["prompt_embeds"].shape == (3, CLIP_TOKENS, TINY_TEXT_DIM)
    assert data["pooled_prompt_embeds"].shape == (3, TINY_POOLED_DIM)
    assert data["negative_prompt_embeds"].shape == (1, CLIP_TOKENS, TINY_TEXT_DIM)
    assert data["negative_pooled_prompt_embeds"].shape == (1, TINY_POOLED_DIM)

    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(str(model))
    with torch.no_grad():  # as the pipeline's __call__
        want, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=PROMPTS, prompt_2=None, device="cpu", do_classifier_free_guidance=True,
            negative_prompt="",
        )  # fmt: skip
    assert torch.equal(data["prompt_embeds"], want)
    assert torch.equal(data["pooled_prompt_embeds"], pooled)
    assert torch.equal(data["negative_prompt_embeds"], negative[:1])
    assert torch.equal(data["negative_pooled_prompt_embeds"], negative_pooled[:1])
    assert not torch.equal(data["prompt_embeds"][0], data["prompt_embeds"][1])

    train_on(tmp_path, "sdxl", model)
