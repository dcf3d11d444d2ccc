"""Tiny random diffusers pipelines built offline from configs (tests/test_pipelines.py).

CLIP tokenizers over single letters, a T5 (Unigram) tokenizer, 1-2 layer CLIP / T5 text
encoders, a micro transformer or UNet, a micro ``AutoencoderKL`` and the scheduler each
pipeline ships with (SDXL: ``DDIMScheduler`` from SDXL's scheduler config). Nothing is
downloaded; diffusers and transformers are imported where used.
"""

from __future__ import annotations

import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz"
CLIP_TOKENS = 6
TEXT_DIM, POOLED_DIM = 16, 8


def clip_tokenizer():
    """A CLIP BPE tokenizer over single letters (no merges), built in memory."""
    import transformers

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in LETTERS:
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_TOKENS)


def t5_tokenizer():
    import transformers

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(letter, -3.0) for letter in LETTERS]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def clip_config(hidden: int, projection: int):
    import transformers

    return transformers.CLIPTextConfig(
        vocab_size=2 + 2 * len(LETTERS), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
        projection_dim=projection, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip


def t5_encoder():
    import transformers

    config = transformers.T5Config(
        vocab_size=3 + 1 + len(LETTERS), d_model=TEXT_DIM, d_kv=4, d_ff=32,
        num_layers=1, num_heads=2, relative_attention_num_buckets=8,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5EncoderModel(config)


def tiny_vae():
    import diffusers

    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4,
        norm_num_groups=4, sample_size=16,
    )  # fmt: skip


def tiny_sd3_pipeline():
    """SD3: CLIP-L (width 4) + CLIP-G (width 8) padded to T5's 16 = joint_attention_dim;
    pooled 3 + 5 = 8. 16 px images: 8x8 latents, 4x4 patches of 2."""
    import diffusers
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        clip_l = transformers.CLIPTextModelWithProjection(clip_config(4, 3))
        clip_g = transformers.CLIPTextModelWithProjection(clip_config(8, POOLED_DIM - 3))
        t5 = t5_encoder()
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
            caption_projection_dim=16, pooled_projection_dim=POOLED_DIM, pos_embed_max_size=8,
        )  # fmt: skip
        vae = tiny_vae()
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae, text_encoder=clip_l, tokenizer=clip_tokenizer(),
        text_encoder_2=clip_g, tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5, tokenizer_3=t5_tokenizer(),
    )  # fmt: skip
    return _ready(pipe)


def tiny_flux_pipeline(guidance_embeds: bool = True):
    """Flux: T5 width 16 = joint_attention_dim, CLIP's pooled 8; packed 16 channels."""
    import diffusers
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        clip = transformers.CLIPTextModel(clip_config(POOLED_DIM, 4))
        t5 = t5_encoder()
        transformer = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=POOLED_DIM, guidance_embeds=guidance_embeds,
            axes_dims_rope=(2, 2, 4),
        )  # fmt: skip
        vae = tiny_vae()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )  # fmt: skip
    pipe = diffusers.FluxPipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=clip, tokenizer=clip_tokenizer(),
        text_encoder_2=t5, tokenizer_2=t5_tokenizer(),
    )  # fmt: skip
    return _ready(pipe)


def _ready(pipe):
    # Built in code, the models are in training mode (T5's dropout is 0.1): a loaded
    # pipeline's are in eval mode.
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: SDXL's scheduler_config.json, as DDIM (SDXL ships EulerDiscreteScheduler).
SDXL_SCHEDULER = dict(
    beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
    set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading",
)  # fmt: skip


def tiny_sdxl_pipeline():
    """SDXL: CLIP-L (width 4) + CLIP-G (width 12, projection 8) concatenated = 16 =
    cross_attention_dim; the UNet's text_time embedding takes the pooled 8 + 6 ids x 4."""
    import diffusers
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        clip_l = transformers.CLIPTextModel(clip_config(4, 4))
        clip_g = transformers.CLIPTextModelWithProjection(clip_config(12, POOLED_DIM))
        unet = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(8, 16), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=TEXT_DIM,
            attention_head_dim=2, norm_num_groups=4, addition_embed_type="text_time",
            addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 * 4 + POOLED_DIM,
        )  # fmt: skip
        vae = tiny_vae()
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=vae, text_encoder=clip_l, text_encoder_2=clip_g, tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(), unet=unet,
        scheduler=diffusers.DDIMScheduler(**SDXL_SCHEDULER),
    )  # fmt: skip
    return _ready(pipe)
