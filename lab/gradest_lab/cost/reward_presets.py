"""The learned rewards' models as shapes only, for ``gradest cost``.

A pixel-space reward scores the decoded images with a CLIP- or BLIP-sized model, and the
reward's gradient runs back through it to the pixels. :func:`reward_model` builds one on
the meta device (no weights) from a named preset (:data:`REWARD_PRESETS`, the
architectures the recipes' learned rewards load, ``apps/recipes/gradest_recipes/
learned_rewards.py``) or from a JSON config of the same form, and scores as they do:

* ``aesthetic``: LAION's aesthetic predictor, OpenAI CLIP ViT-L/14's image embedding
  (vision tower and projection), L2-normalised, into the MLP 768-1024-128-64-16-1.
* ``pickscore``: PickScore's CLIP ViT-H/14, ``logit_scale * cos(text, image)``.
* ``hpsv2``: HPSv2's open_clip ViT-H-14 (the same architecture, priced on transformers'
  CLIP classes), ``cos(text, image)``.
* ``imagereward``: ImageReward's BLIP ViT-L/16 image encoder, whose tokens the BERT-base
  text encoder cross-attends to; its ``[CLS]`` state into the same MLP.

Each model is frozen; the images are preprocessed as the originals are (antialiased
bicubic resize of the shortest side, width then height, each pass clamped; center crop;
normalisation), and the text side of a CLIP score runs without a graph (its embedding
needs no gradient), at the tokenizer's full length (77 CLIP tokens, 35 ImageReward
tokens: the most a prompt takes).

A config file: ``{"kind": "aesthetic" | "clip-score" | "blip-score", "vision": {...},
"text": {...}, "image_size": 224, "text_tokens": 77, "logit_scale": true}`` with
``vision`` / ``text`` the fields of transformers' ``CLIPVisionConfig`` / ``CLIPTextConfig``
(``BlipVisionConfig`` / ``BlipTextConfig`` for ``blip-score``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradest import InvalidValue, MissingDependency
from gradest_lab.cost.config_checks import check_config, library_config_errors
from gradest_lab.storage.files import read_json

__all__ = [
    "REWARD_KINDS",
    "REWARD_PRESETS",
    "RewardModel",
    "check_reward_config",
    "reward_config",
    "reward_model",
]

_CLIP_L14 = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
    "num_attention_heads": 16, "patch_size": 14, "image_size": 224, "projection_dim": 768,
    "hidden_act": "quick_gelu",
}  # fmt: skip
_CLIP_H14_VISION = {
    "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
    "num_attention_heads": 16, "patch_size": 14, "image_size": 224, "projection_dim": 1024,
    "hidden_act": "gelu",
}  # fmt: skip
_CLIP_H14_TEXT = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
    "num_attention_heads": 16, "max_position_embeddings": 77, "projection_dim": 1024,
    "vocab_size": 49408, "hidden_act": "gelu",
}  # fmt: skip

#: The scoring models of the recipes' learned rewards (the checkpoints' published sizes).
REWARD_PRESETS: dict[str, dict[str, Any]] = {
    # openai/clip-vit-large-patch14 + sac+logos+ava1-l14-linearMSE.pth
    "aesthetic": {"kind": "aesthetic", "vision": _CLIP_L14, "image_size": 224},
    # yuvalkirstain/PickScore_v1 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's architecture)
    "pickscore": {
        "kind": "clip-score",
        "vision": _CLIP_H14_VISION,
        "text": _CLIP_H14_TEXT,
        "image_size": 224,
        "text_tokens": 77,
        "logit_scale": True,
    },  # fmt: skip
    # xswu/HPSv2: open_clip ViT-H-14
    "hpsv2": {
        "kind": "clip-score",
        "vision": _CLIP_H14_VISION,
        "text": _CLIP_H14_TEXT,
        "image_size": 224,
        "text_tokens": 77,
        "logit_scale": False,
    },  # fmt: skip
    # THUDM/ImageReward: BLIP ViT-L/16 and med_config.json's BERT-base with cross-attention
    "imagereward": {
        "kind": "blip-score",
        "vision": {
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "patch_size": 16,
            "image_size": 224,
            "hidden_act": "gelu",
            "layer_norm_eps": 1e-6,
        },
        "text": {
            "vocab_size": 30524,
            "hidden_size": 768,
            "encoder_hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 512,
            "is_decoder": True,
        },
        "image_size": 224,
        "text_tokens": 35,
    },  # fmt: skip
}
REWARD_KINDS = ("aesthetic", "clip-score", "blip-score")
# The config's own fields that are not sizes (the sizes are checked by name).
_FIELD_TYPES: dict[str, type] = {"vision": dict, "text": dict, "logit_scale": bool}
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)


def reward_config(source: str) -> tuple[dict[str, Any], str]:
    """``(config, description)`` of a preset name or a JSON config file, the file's fields
    checked (:func:`check_reward_config`) before any model is built from them."""
    if source in REWARD_PRESETS:
        return dict(REWARD_PRESETS[source]), source
    path = Path(source)
    if not path.is_file():
        raise InvalidValue(
            f"--reward {source!r} is neither a learned reward ({', '.join(REWARD_PRESETS)}), "
            f"'latent' (the transformer alone) nor a reward config .json file"
        )
    config = read_json(path, what="--reward")
    check_reward_config(config, where=f"--reward {source!r}")
    return config, str(source)


def check_reward_config(config: Any, *, where: str) -> None:
    """Refuse a reward config that cannot build its model, in one line naming ``where``,
    the field and the fix (:func:`gradest_lab.cost.config_checks.check_config`: every size
    and count >= 1, in ``vision`` and ``text`` too; ``kind`` one of :data:`REWARD_KINDS`;
    the sections objects, ``logit_scale`` true or false).

    Raises:
        InvalidValue: naming the field, its value and the fix.
    """
    check_config(config, where=where, choices={"kind": REWARD_KINDS}, types=_FIELD_TYPES)
    if "kind" not in config:
        raise InvalidValue(
            f'{where}: field kind is missing; add "kind": one of {", ".join(REWARD_KINDS)}'
        )


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _score_mlp(width: int) -> nn.Sequential:
    # LAION's and ImageReward's head: no nonlinearity, dropouts off at scoring time.
    return nn.Sequential(
        nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
    )  # fmt: skip


class RewardModel(nn.Module):
    """``images [B, 3, H, W]`` in ``[0, 1]`` -> ``[B]``, a frozen learned reward's score."""

    def __init__(
        self,
        kind: str,
        *,
        vision: nn.Module,
        image_size: int,
        projection: nn.Module | None = None,
        head: nn.Module | None = None,
        text: nn.Module | None = None,
        text_projection: nn.Module | None = None,
        text_tokens: int = 0,
        logit_scale: bool = False,
    ):
        super().__init__()
        self.kind, self.image_size, self.text_tokens = kind, image_size, text_tokens
        self.vision, self.projection, self.head = vision, projection, head
        self.text, self.text_projection = text, text_projection
        self.use_logit_scale = logit_scale
        self.requires_grad_(False)
        self.eval()

    def preprocess(self, images: Tensor) -> Tensor:
        """Resize the shortest side to ``image_size`` (two antialiased bicubic passes,
        each clamped, as PIL's), center crop, normalise (the recipes' ``Preprocess``)."""
        x = images
        height, width = x.shape[-2:]
        side = self.image_size
        short, long = min(height, width), max(height, width)
        other = int(side * long / short)
        new_h, new_w = (other, side) if width <= height else (side, other)
        for size, changed in (((height, new_w), new_w != width), ((new_h, new_w), new_h != height)):
            if changed:
                x = F.interpolate(
                    x, size=size, mode="bicubic", align_corners=False, antialias=True
                ).clamp(0, 1)
        top, left = int(round((new_h - side) / 2.0)), int(round((new_w - side) / 2.0))
        x = x[..., top : top + side, left : left + side]
        mean = torch.tensor(_MEAN, dtype=x.dtype, device=x.device)[:, None, None]
        std = torch.tensor(_STD, dtype=x.dtype, device=x.device)[:, None, None]
        dtype = next(self.vision.parameters()).dtype
        return ((x - mean) / std).to(dtype)

    def _tokens(self, batch: int, device: torch.device) -> Tensor:
        return torch.zeros(batch, self.text_tokens, dtype=torch.long, device=device)

    def forward(self, images: Tensor) -> Tensor:
        pixels = self.preprocess(images)
        batch = images.shape[0]
        if self.kind == "blip-score":
            assert self.text is not None and self.head is not None
            embeds = self.vision(pixel_values=pixels).last_hidden_state
            # No masks: every token attends (a mask's bytes are negligible, and
            # transformers reads a mask's values, which a meta trace has not).
            out = self.text(
                input_ids=self._tokens(batch, images.device), encoder_hidden_states=embeds
            )
            return self.head(out.last_hidden_state[:, 0, :].float()).squeeze(-1)
        assert self.projection is not None
        image = _unit(self.projection(self.vision(pixel_values=pixels).pooler_output))
        if self.kind == "aesthetic":
            assert self.head is not None
            return self.head(image.float()).squeeze(-1)
        assert self.text is not None and self.text_projection is not None
        with torch.no_grad():  # the prompts' embedding needs no gradient
            pooled = self.text(input_ids=self._tokens(batch, images.device)).pooler_output
            text = _unit(self.text_projection(pooled))
        score = (image * text).sum(-1).float()
        return score * 100.0 if self.use_logit_scale else score  # CLIP's exp(log 100)


def _built(cls: Any, fields: Mapping[str, Any], what: str, *, sdpa: bool = True) -> Any:
    # CLIP runs scaled_dot_product_attention (a GPU's fused kernel); BLIP has only its
    # eager attention in transformers, which keeps the attention matrix, as it runs.
    extra = {"attn_implementation": "sdpa"} if sdpa else {}
    try:
        return cls(**dict(fields), **extra)
    except library_config_errors() as err:  # what the sizes' check leaves to transformers
        shown = " ".join(str(err).split())
        raise InvalidValue(f"--reward: the {what} config is invalid: {shown}") from err


def reward_model(
    config: Mapping[str, Any], *, dtype: torch.dtype, device: str | torch.device = "meta"
) -> RewardModel:
    """The frozen reward model of ``config`` (:func:`reward_config`) on ``device``."""
    try:
        import transformers
    except ImportError as err:
        raise MissingDependency(
            "pricing a learned reward needs transformers: pip install transformers "
            "(or --reward latent)"
        ) from err
    # Checked here too, not only in reward_config: Python callers pass their own dicts.
    check_reward_config(config, where="--reward config")
    kind = config["kind"]
    if kind != "aesthetic" and "text" not in config:
        raise InvalidValue(f"--reward: kind {kind!r} needs a 'text' config (its text encoder)")
    vision_fields = dict(config.get("vision", {}))
    image_size = int(config.get("image_size", vision_fields.get("image_size", 224)))
    tokens = int(config.get("text_tokens", 77))
    with torch.device(device):
        if kind == "blip-score":
            vision_config = _built(
                transformers.BlipVisionConfig, vision_fields, "vision", sdpa=False
            )
            text_config = _built(transformers.BlipTextConfig, config["text"], "text", sdpa=False)
            model = RewardModel(
                kind,
                vision=transformers.BlipVisionModel(vision_config),
                text=transformers.BlipTextModel(text_config, add_pooling_layer=False),
                head=_score_mlp(int(text_config.hidden_size)),
                image_size=image_size,
                text_tokens=tokens,
            )
        elif kind == "aesthetic":
            vision_config = _built(transformers.CLIPVisionConfig, vision_fields, "vision")
            clip = transformers.CLIPVisionModelWithProjection(vision_config)
            model = RewardModel(
                kind,
                vision=clip.vision_model,
                projection=clip.visual_projection,
                head=_score_mlp(int(vision_config.projection_dim)),
                image_size=image_size,
            )
        else:
            vision_config = _built(transformers.CLIPVisionConfig, vision_fields, "vision")
            text_config = _built(transformers.CLIPTextConfig, config["text"], "text")
            vision_clip = transformers.CLIPVisionModelWithProjection(vision_config)
            text_clip = transformers.CLIPTextModelWithProjection(text_config)
            model = RewardModel(
                kind,
                vision=vision_clip.vision_model,
                projection=vision_clip.visual_projection,
                text=text_clip.text_model,
                text_projection=text_clip.text_projection,
                image_size=image_size,
                text_tokens=tokens,
                logit_scale=bool(config.get("logit_scale", False)),
            )
    return model.to(dtype)
