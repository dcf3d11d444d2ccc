"""Learned rewards, differentiable from pixels: the LAION aesthetic predictor, PickScore,
HPSv2 and ImageReward, built on the libraries their weights ship for.

Each takes the recipe's decoded images ``[B, 3, H, W]`` in ``[0, 1]`` (and the batch's
prompts) and returns ``[B]``; the gradient reaches the pixels. The preprocessing is the
original's, on tensors (:class:`Preprocess`): resize the shortest side with antialiased
bicubic interpolation (``torch.nn.functional.interpolate(..., antialias=True)``, PIL's
bicubic filter), clamp to ``[0, 1]`` as the uint8 image of the original is, center crop,
normalise with the mean and std. What differs from the originals: they read a uint8 PIL
image (rounded to 1/255 before and after the resize); here no rounding, which is not
differentiable (``apps/recipes/tests/test_learned_rewards.py`` bounds the difference).

=============== =========================================================================
``aesthetic``   LAION's improved aesthetic predictor: OpenAI CLIP ViT-L/14 image embedding
                (transformers ``CLIPModel``'s vision tower and projection), L2-normalised,
                into the MLP 768-1024-128-64-16-1 (dropouts, no nonlinearity, as theirs).
                ``model`` (default ``openai/clip-vit-large-patch14``), ``head`` (the
                predictor's ``sac+logos+ava1-l14-linearMSE.pth``; default: that file in
                the ``model`` folder).
``pickscore``   PickScore (Kirstain et al. 2023): transformers ``CLIPModel`` ViT-H/14,
                ``logit_scale.exp() * cos(text, image)`` as its README computes it.
                ``model`` (default ``yuvalkirstain/PickScore_v1``), ``processor`` (default
                the model folder if it holds ``preprocessor_config.json``, else
                ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, the original's processor).
``hpsv2``       HPSv2 (Wu et al. 2023): open_clip ViT-H-14 with the HPS checkpoint,
                ``cos(text, image)`` (``hpsv2.score`` takes no logit scale). ``model``: the
                checkpoint file, a folder holding it, or a hub repo (default
                ``xswu/HPSv2``); ``version`` ``2.0`` (``HPS_v2_compressed.pt``, the
                package's default) or ``2.1`` (``HPS_v2.1_compressed.pt``); ``arch``
                (default ``ViT-H-14``, or an open_clip model config ``.json``). A folder
                with a ``config.json`` is a transformers ``CLIPModel`` conversion instead
                (no open_clip needed), scored the same way.
``imagereward`` ImageReward (Xu et al. 2023): BLIP ViT-L/16 image encoder (transformers
                ``BlipVisionModel``) and BERT text encoder with cross-attention
                (``BlipTextModel``) on the ``[CLS]`` token, into the same MLP, standardised
                with ImageReward's mean and std. ``model``: ``ImageReward.pt`` with
                ``med_config.json`` beside it, their folder, or a hub repo (default
                ``THUDM/ImageReward``); the original key names are mapped onto
                transformers' Blip classes. ``tokenizer`` (default the model folder if it
                holds ``vocab.txt``, else ``bert-base-uncased``, with BLIP's ``[DEC]``,
                ``[ENC]`` added as the original does).
=============== =========================================================================

Every config a reward builds its model from is checked before the model is built
(:func:`gradest_lab.cost.config_checks.check_config`, the rule ``gradest cost --reward``
applies too): every size and count a whole number >= 1, in the nested configs too, and
the architecture one the loader builds. A mistake is one
:class:`~gradest_recipes.errors.RecipeConfigError` line naming the file, the field's
dotted path (``vision_config.num_hidden_layers``), its value and the fix.

Every reward also takes ``download`` (``0`` by default: a hub name is read from the hub
cache only, ``local_files_only=True``; ``1`` lets transformers / huggingface_hub fetch
it). A missing checkpoint is one :class:`~gradest_recipes.errors.RecipeConfigError` line
naming where it was looked for, what to put there, and the option to pass.

Used by name from a recipe (``--reward "pickscore:model=/models/pickscore"``, see
:mod:`gradest_recipes.rewards`), or from Python (``pickscore(model=...)`` returns the
reward module). The models are frozen, in eval mode, and move to the images' device on
first use; text embeddings need no gradient and are computed without one.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gradest_lab.cost.config_checks import check_config, library_config_errors
from torch import Tensor, nn

from gradest_recipes.errors import RecipeConfigError

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "IMAGEREWARD_MEAN",
    "IMAGEREWARD_STD",
    "LEARNED_OPTIONS",
    "LEARNED_REWARDS",
    "AestheticReward",
    "ClipScoreReward",
    "ImageReward",
    "LearnedReward",
    "OpenClipScoreReward",
    "Preprocess",
    "ScoreMLP",
    "aesthetic",
    "check_transformers_config",
    "convert_imagereward_state_dict",
    "hpsv2",
    "imagereward",
    "pickscore",
]

#: OpenAI CLIP's normalisation; BLIP's (and so ImageReward's) are the same numbers.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: ImageReward's standardisation of the MLP's output (ImageReward.py).
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072

AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "sac+logos+ava1-l14-linearMSE.pth"
PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
HPSV2_REPO = "xswu/HPSv2"
HPSV2_FILES = {"2.0": "HPS_v2_compressed.pt", "2.1": "HPS_v2.1_compressed.pt"}
IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
IMAGEREWARD_MED_CONFIG = "med_config.json"
IMAGEREWARD_TOKENIZER = "bert-base-uncased"
# The architectures (config.json's model_type) each loader builds: CLIPModel, or for the
# aesthetic predictor its vision tower alone; ImageReward's med_config.json is a BERT's.
CLIP_TYPES = ("clip",)
AESTHETIC_TYPES = ("clip", "clip_vision_model")
MED_TYPES = ("bert",)
EXTRA = "pip install './apps/recipes[learned-rewards]'"


# -- preprocessing -------------------------------------------------------------------------


def _field(value: Any, key: str) -> Any:
    """``value[key]`` of a dict (transformers 4) or ``value.key`` of a SizeDict (5)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get(key)
    return getattr(value, key, None)


_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL.Image.Resampling.BILINEAR / BICUBIC


@dataclass(frozen=True)
class Preprocess:
    """The original models' image preprocessing on tensors, differentiably.

    ``images [B, 3, H, W]`` in ``[0, 1]`` -> resize (``size`` an int: the shortest side
    to ``size``, the other ``int(size * long / short)`` as torchvision and transformers
    compute it; a pair: exactly ``(h, w)``) with antialiased ``interpolation``, the width
    then the height, each pass clamped to ``[0, 1]`` as PIL's passes are; center crop to
    ``crop`` (``(h, w)``; the offset ``round((H - h) / 2)`` with ``round_crop`` as
    torchvision's ``CenterCrop`` (OpenAI CLIP, open_clip, ImageReward), else ``floor`` as
    transformers' image processors (PickScore)); then ``(x - mean) / std``.
    """

    size: int | tuple[int, int] | None
    crop: tuple[int, int] | None
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    interpolation: str = "bicubic"
    round_crop: bool = True

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.size is None:
            return height, width
        if not isinstance(self.size, int):
            return int(self.size[0]), int(self.size[1])
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size, int(self.size * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, images: Tensor) -> Tensor:
        x = images
        height, width = x.shape[-2:]
        new_height, new_width = self.resized_size(height, width)
        # PIL resizes in two passes, the width first, each clamped to the uint8 range
        # (a pass whose size does not change is skipped); so does torch's uint8 path.
        for size, changed in (((height, new_width), new_width != width),
                              ((new_height, new_width), new_height != height)):  # fmt: skip
            if changed:
                x = F.interpolate(
                    x, size=size, mode=self.interpolation, align_corners=False, antialias=True
                ).clamp(0, 1)
        if self.crop is not None:
            x = self._center_crop(x)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device)[:, None, None]
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device)[:, None, None]
        return (x - mean) / std

    def _center_crop(self, x: Tensor) -> Tensor:
        crop_h, crop_w = self.crop or x.shape[-2:]
        height, width = x.shape[-2:]
        if crop_h > height or crop_w > width:  # torchvision pads with zeros first
            pad_w, pad_h = max(crop_w - width, 0), max(crop_h - height, 0)
            x = F.pad(x, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
            height, width = x.shape[-2:]
        offset = (lambda d: int(round(d / 2.0))) if self.round_crop else (lambda d: d // 2)
        top, left = offset(height - crop_h), offset(width - crop_w)
        return x[..., top : top + crop_h, left : left + crop_w]

    @classmethod
    def from_image_processor(cls, processor: Any, *, round_crop: bool) -> Preprocess:
        """The settings of a transformers image processor (``CLIPImageProcessor``,
        ``BlipImageProcessor``): size, crop, mean, std, resample."""
        size: int | tuple[int, int] | None = None
        if getattr(processor, "do_resize", True):
            edge = _field(processor.size, "shortest_edge")
            if edge:
                size = int(edge)
            else:
                size = (int(_field(processor.size, "height")), int(_field(processor.size, "width")))
        crop = None
        if getattr(processor, "do_center_crop", False):
            crop_size = processor.crop_size
            crop = (int(_field(crop_size, "height")), int(_field(crop_size, "width")))
        resample = int(getattr(processor, "resample", 3))
        if resample not in _RESAMPLE:
            raise RecipeConfigError(
                f"the image processor resamples with PIL filter {resample}; the learned "
                f"rewards reproduce bicubic (3) and bilinear (2) only"
            )
        normalize = getattr(processor, "do_normalize", True)
        return cls(
            size=size,
            crop=crop,
            mean=tuple(float(m) for m in processor.image_mean) if normalize else (0.0,) * 3,
            std=tuple(float(s) for s in processor.image_std) if normalize else (1.0,) * 3,
            interpolation=_RESAMPLE[resample],
            round_crop=round_crop,
        )

    @classmethod
    def from_open_clip(cls, model: nn.Module) -> Preprocess:
        """open_clip's inference transform of ``model`` (``image_transform(is_train=False)``
        with the model's preprocess config)."""
        import open_clip

        getter = getattr(open_clip, "get_model_preprocess_cfg", None)
        config: dict[str, Any] = dict(getter(model)) if getter is not None else {}
        visual: Any = getattr(model, "visual", None)
        image_size = config.get("size", getattr(visual, "image_size", 224))
        mean = config.get("mean") or getattr(visual, "image_mean", None) or CLIP_MEAN
        std = config.get("std") or getattr(visual, "image_std", None) or CLIP_STD
        mode = config.get("resize_mode", "shortest")
        interpolation = "bilinear" if config.get("interpolation") == "bilinear" else "bicubic"
        pair = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if mode == "squash":
            return cls((int(pair[0]), int(pair[1])), None, tuple(mean), tuple(std), interpolation)
        if mode != "shortest" or pair[0] != pair[1]:
            raise RecipeConfigError(
                f"open_clip resize_mode {mode!r} at size {image_size}: the learned rewards "
                f"reproduce 'shortest' (square) and 'squash' only"
            )
        side = int(pair[0])
        return cls(side, (side, side), tuple(mean), tuple(std), interpolation)


# -- the heads and the reward modules ------------------------------------------------------


class ScoreMLP(nn.Module):
    """The MLP of the LAION aesthetic predictor and of ImageReward: ``input -> 1024 -> 128
    -> 64 -> 16 -> 1`` with dropouts 0.2, 0.2, 0.1 and no nonlinearity (both originals
    leave the ReLUs commented out); keys ``layers.{0,2,4,6,7}`` as theirs."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.input_size = input_size
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class LearnedReward(nn.Module):
    """A frozen reward model in eval mode: ``reward(images, prompts) -> [B]``; it moves
    itself to the images' device on first use."""

    name = "learned"

    def freeze(self) -> LearnedReward:
        self.eval()
        self.requires_grad_(False)
        return self

    def train(self, mode: bool = True) -> LearnedReward:
        return super().train(False)  # always eval: dropout off, as at scoring time

    def _follow(self, images: Tensor) -> None:
        parameter = next(self.parameters(), None)
        if parameter is not None and parameter.device != images.device:
            self.to(images.device)

    def _prompts(self, images: Tensor, prompts: Sequence[str] | None) -> list[str]:
        if prompts is None or len(prompts) != images.shape[0]:
            got = "none" if prompts is None else f"{len(prompts)}"
            raise RecipeConfigError(
                f"reward {self.name!r} scores an image against its prompt: it needs one "
                f"prompt per image ({images.shape[0]}), got {got}"
            )
        return [str(p) for p in prompts]


def _embedding(output: Any) -> Tensor:
    """A ``get_*_features`` result: a tensor (transformers 4) or an output whose
    ``pooler_output`` is the projected embedding (transformers 5)."""
    return output if isinstance(output, Tensor) else output.pooler_output


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True)


class AestheticReward(LearnedReward):
    """``head(normalize(projection(vision(preprocess(images)).pooler_output)))``: the CLIP
    image embedding (OpenAI CLIP's ``encode_image``), L2-normalised, into the MLP."""

    name = "aesthetic"

    def __init__(
        self, vision: nn.Module, projection: nn.Module, head: ScoreMLP, preprocess: Preprocess
    ):
        super().__init__()
        self.vision, self.projection, self.head = vision, projection, head
        self.preprocess = preprocess
        self.freeze()

    def forward(self, images: Tensor, prompts: Sequence[str] | None = None) -> Tensor:
        self._follow(images)
        pooled = self.vision(pixel_values=self.preprocess(images)).pooler_output
        return self.head(_unit(self.projection(pooled))).squeeze(-1)


class ClipScoreReward(LearnedReward):
    """A transformers ``CLIPModel``'s ``[logit_scale.exp() *] cos(text, image)``."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        preprocess: Preprocess,
        *,
        name: str,
        logit_scale: bool,
        max_length: int = 77,
    ):
        super().__init__()
        self.model, self.tokenizer, self.preprocess = model, tokenizer, preprocess
        self.name, self.logit_scale, self.max_length = name, logit_scale, max_length
        self.freeze()

    def forward(self, images: Tensor, prompts: Sequence[str] | None = None) -> Tensor:
        texts = self._prompts(images, prompts)
        self._follow(images)
        model: Any = self.model
        image = _unit(_embedding(model.get_image_features(pixel_values=self.preprocess(images))))
        with torch.no_grad():
            tokens = self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_length,
                return_tensors="pt",
            ).to(images.device)  # fmt: skip
            text = _unit(_embedding(model.get_text_features(**tokens)))
        score = (image * text.to(image.dtype)).sum(-1)
        return model.logit_scale.exp() * score if self.logit_scale else score


class OpenClipScoreReward(LearnedReward):
    """An open_clip model's ``cos(text, image)`` (HPSv2's score)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Callable[..., Tensor],
        preprocess: Preprocess,
        *,
        name: str,
    ):
        super().__init__()
        self.model, self.tokenizer, self.preprocess, self.name = model, tokenizer, preprocess, name
        self.freeze()

    def forward(self, images: Tensor, prompts: Sequence[str] | None = None) -> Tensor:
        texts = self._prompts(images, prompts)
        self._follow(images)
        model: Any = self.model
        image = model.encode_image(self.preprocess(images), normalize=True)
        with torch.no_grad():
            text = model.encode_text(self.tokenizer(texts).to(images.device), normalize=True)
        return (image * text.to(image.dtype)).sum(-1)


class ImageReward(LearnedReward):
    """ImageReward's score on transformers' Blip classes: the BLIP image encoder's tokens
    are the cross-attention input of the text encoder; its ``[CLS]`` state goes into the
    MLP, standardised with ImageReward's mean and std."""

    name = "imagereward"

    def __init__(
        self,
        vision: nn.Module,
        text: nn.Module,
        head: ScoreMLP,
        tokenizer: Any,
        preprocess: Preprocess,
        *,
        max_length: int = 35,
    ):
        super().__init__()
        self.vision, self.text, self.head = vision, text, head
        self.tokenizer, self.preprocess, self.max_length = tokenizer, preprocess, max_length
        self.freeze()

    def forward(self, images: Tensor, prompts: Sequence[str] | None = None) -> Tensor:
        texts = self._prompts(images, prompts)
        self._follow(images)
        image_embeds = self.vision(pixel_values=self.preprocess(images)).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=images.device)
        tokens = self.tokenizer(
            texts, padding="max_length", truncation=True, max_length=self.max_length,
            return_tensors="pt",
        ).to(images.device)  # fmt: skip
        output = self.text(
            input_ids=tokens.input_ids,
            attention_mask=tokens.attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
        )
        features = output.last_hidden_state[:, 0, :].float()
        return ((self.head(features) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD).squeeze(-1)


# -- finding and loading the weights -------------------------------------------------------


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 160 else text[:157] + "..."


def _is_local(where: str) -> bool:
    """A path, not a hub name (``name``, ``org/name``): it exists, or it is spelt as one."""
    if Path(where).expanduser().exists():
        return True
    return where.startswith(("/", ".", "~")) or "\\" in where or where.count("/") > 1


def _missing(
    reward: str, what: str, where: str, put: str, option: str, err: BaseException | None = None
) -> RecipeConfigError:
    if _is_local(where):
        found = f"no {what} at {where!r}"
        fetch = ""
        why = f" ({_one_line(err)})" if err is not None else ""
    else:  # the hub library's own text adds nothing to this
        found = (
            f"no {what} at {where!r} (not a local path; as a hub name, not in the hub "
            f"cache: local_files_only)"
        )
        fetch = ", or add download=1 to fetch it from the hub"
        why = ""
    return RecipeConfigError(
        f"reward {reward!r}: {found}{why}; put {put} in a folder and pass --reward "
        f"'{reward}:{option}=/path/to/folder'{fetch}"
    )


def _needs(reward: str, module: str) -> RecipeConfigError:
    return RecipeConfigError(
        f"reward {reward!r} needs {module}, which is not installed: {EXTRA} (or pip install "
        f"{'open_clip_torch' if module == 'open_clip' else module})"
    )


def _import(reward: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _needs(reward, module) from None


def _from_pretrained(
    loader: Any, where: str, *, download: bool, reward: str, what: str, put: str, option: str
) -> Any:
    path = Path(where).expanduser()
    if _is_local(where) and not path.exists():
        raise _missing(reward, what, where, put, option, FileNotFoundError("no such folder"))
    try:
        return loader.from_pretrained(
            str(path) if path.exists() else where, local_files_only=not download
        )
    except (OSError, ValueError) as err:
        raise _missing(reward, what, where, put, option, err) from None
    except library_config_errors() as err:  # a config value its library refuses
        raise RecipeConfigError(
            f"reward {reward!r}: the {what} at {where!r} has a config its library refuses "
            f"({_one_line(err)}); fix its config.json or pass --reward "
            f"'{reward}:{option}=/path/to/folder'"
        ) from None


def _transformers_config_file(where: str, download: bool) -> Path | None:
    """The ``config.json`` transformers reads for ``where``: a folder's, or a hub repo's
    (from the cache; fetched first with ``download``, as ``from_pretrained`` would).
    None when there is none to read: ``from_pretrained`` then says what is missing."""
    path = Path(where).expanduser()
    if path.is_dir():
        file = path / "config.json"
        return file if file.is_file() else None
    if _is_local(where):
        return None
    try:
        hub = importlib.import_module("huggingface_hub")
        return Path(hub.hf_hub_download(where, "config.json", local_files_only=not download))
    except (ImportError, OSError, ValueError):  # not in the cache, no such repo, offline
        return None


def check_transformers_config(
    where: str, *, download: bool, reward: str, model_types: Sequence[str]
) -> None:
    """Refuse the transformers ``config.json`` of ``where`` before a model is built from it
    (module docstring). ``null`` sizes pass: transformers writes an unset optional size so
    (``cross_attention_hidden_size``), and refuses one it needs (``_from_pretrained``)."""
    file = _transformers_config_file(where, download)
    if file is None:
        return
    try:
        config = json.loads(file.read_text("utf-8"))
    except (OSError, ValueError):
        return  # unreadable: from_pretrained's own refusal names the file (_missing)
    check_config(
        config, where=f"reward {reward!r}: {str(file)!r}", choices={"model_type": model_types},
        types={"text_config": dict, "vision_config": dict}, nulls=True, error=RecipeConfigError,
    )  # fmt: skip


def _hub_file(
    where: str, filename: str, *, download: bool, reward: str, what: str, put: str, option: str
) -> Path:
    """``where`` a file, a folder holding ``filename``, or a hub repo holding it."""
    path = Path(where).expanduser()
    if path.is_file():
        return path
    if path.is_dir() or _is_local(where):
        if (path / filename).is_file():
            return path / filename
        raise _missing(reward, what, str(path / filename), put, option)
    hub = _import(reward, "huggingface_hub")
    try:
        return Path(hub.hf_hub_download(where, filename, local_files_only=not download))
    except (OSError, ValueError) as err:
        raise _missing(reward, what, where, put, option, err) from None


def _load_weights(path: Path, reward: str, what: str) -> dict[str, Tensor]:
    """A state dict from ``.safetensors`` or a torch pickle of tensors (read with
    ``weights_only=True``: no code in the file runs)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is one line naming it
        raise RecipeConfigError(
            f"reward {reward!r}: {str(path)!r} is not a readable {what} ({_one_line(err)})"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # HPSv2's {"state_dict": ...}
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise RecipeConfigError(
            f"reward {reward!r}: {str(path)!r} holds no state dict of tensors (a {what})"
        )
    return {k.removeprefix("module."): v for k, v in state.items()}


def _load_state(module: nn.Module, state: dict[str, Tensor], path: Path, reward: str) -> None:
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise RecipeConfigError(
            f"reward {reward!r}: the weights in {str(path)!r} do not fit the model "
            f"({_one_line(err)})"
        ) from None


def _head(path: Path, width: int, reward: str) -> ScoreMLP:
    state = _load_weights(path, reward, "MLP head")
    first = state.get("layers.0.weight")
    if first is None or first.shape[1] != width:
        shape = None if first is None else tuple(first.shape)
        raise RecipeConfigError(
            f"reward {reward!r}: {str(path)!r} is not an MLP head for {width}-wide "
            f"embeddings (layers.0.weight {shape})"
        )
    head = ScoreMLP(width)
    _load_state(head, state, path, reward)
    return head


def _local_dir_with(where: str, filename: str) -> bool:
    path = Path(where).expanduser()
    return path.is_dir() and (path / filename).is_file()


# -- the factories -------------------------------------------------------------------------


def aesthetic(
    model: str = AESTHETIC_CLIP,
    head: str | None = None,
    processor: str | None = None,
    download: bool = False,
) -> AestheticReward:
    """LAION's aesthetic predictor on the CLIP image embedding of ``model``."""
    put = (
        f"a transformers CLIP model ({AESTHETIC_CLIP}: config.json, model.safetensors, "
        f"preprocessor_config.json)"
    )
    if head is None:  # the head first: it fails before the CLIP model loads
        folder = Path(model).expanduser()
        if _is_local(model) and not folder.is_dir():
            raise _missing("aesthetic", "CLIP model", model, put, "model")
        if not folder.is_dir():
            raise RecipeConfigError(
                f"reward 'aesthetic' needs the predictor's MLP: pass head=/path/to/"
                f"{AESTHETIC_HEAD} (github.com/christophschuhmann/improved-aesthetic-"
                f"predictor), or put that file in the model folder"
            )
        head = str(folder / AESTHETIC_HEAD)
    head_path = Path(head).expanduser()
    if not head_path.is_file():
        raise _missing(
            "aesthetic", "MLP head", str(head_path),
            f"{AESTHETIC_HEAD} (github.com/christophschuhmann/improved-aesthetic-predictor)",
            "head",
        )  # fmt: skip
    transformers = _import("aesthetic", "transformers")
    found: dict[str, Any] = dict(
        download=download, reward="aesthetic", what="CLIP model", option="model", put=put
    )
    check_transformers_config(
        model, download=download, reward="aesthetic", model_types=AESTHETIC_TYPES
    )
    config = _from_pretrained(transformers.AutoConfig, model, **found)
    vision_only = getattr(config, "model_type", "") == "clip_vision_model"
    clip = _from_pretrained(
        transformers.CLIPVisionModelWithProjection if vision_only else transformers.CLIPModel,
        model, **found,
    )  # fmt: skip
    image_processor = _from_pretrained(
        transformers.CLIPImageProcessor, processor or model, download=download,
        reward="aesthetic", what="CLIP image processor", option="processor",
        put=f"{AESTHETIC_CLIP}'s preprocessor_config.json",
    )  # fmt: skip
    width = int(clip.visual_projection.out_features)
    return AestheticReward(
        clip.vision_model,
        clip.visual_projection,
        _head(head_path, width, "aesthetic"),
        Preprocess.from_image_processor(image_processor, round_crop=True),  # clip.load's
    )


def _clip_score(
    reward: str, model: str, processor: str | None, default_processor: str, download: bool,
    *, logit_scale: bool, put: str, round_crop: bool,
) -> ClipScoreReward:  # fmt: skip
    transformers = _import(reward, "transformers")
    check_transformers_config(model, download=download, reward=reward, model_types=CLIP_TYPES)
    clip = _from_pretrained(
        transformers.CLIPModel, model, download=download, reward=reward,
        what="CLIP model", option="model", put=put,
    )  # fmt: skip
    if processor is None:
        processor = (
            model if _local_dir_with(model, "preprocessor_config.json") else default_processor
        )
    put_processor = f"{default_processor}'s preprocessor_config.json and tokenizer files"
    image_processor = _from_pretrained(
        transformers.CLIPImageProcessor, processor, download=download, reward=reward,
        what="CLIP image processor", option="processor", put=put_processor,
    )  # fmt: skip
    tokenizer = _from_pretrained(
        transformers.AutoTokenizer, processor, download=download, reward=reward,
        what="CLIP tokenizer", option="processor", put=put_processor,
    )  # fmt: skip
    preprocess = Preprocess.from_image_processor(image_processor, round_crop=round_crop)
    return ClipScoreReward(clip, tokenizer, preprocess, name=reward, logit_scale=logit_scale)


def pickscore(
    model: str = PICKSCORE_MODEL, processor: str | None = None, download: bool = False
) -> ClipScoreReward:
    """PickScore: ``logit_scale.exp() * cos(text, image)`` of its CLIP model."""
    return _clip_score(
        "pickscore", model, processor, PICKSCORE_PROCESSOR, download, logit_scale=True,
        put=f"{PICKSCORE_MODEL}'s files (config.json, model.safetensors)",
        round_crop=False,  # PickScore preprocesses with transformers' CLIPProcessor
    )  # fmt: skip


def hpsv2(
    model: str = HPSV2_REPO,
    version: str = "2.0",
    arch: str = "ViT-H-14",
    processor: str | None = None,
    download: bool = False,
) -> LearnedReward:
    """HPSv2: ``cos(text, image)`` of open_clip ViT-H-14 with the HPS checkpoint (or of a
    transformers ``CLIPModel`` conversion, a folder with ``config.json``)."""
    if version not in HPSV2_FILES:
        raise RecipeConfigError(
            f"reward 'hpsv2': version={version!r} is not one of {sorted(HPSV2_FILES)}"
        )
    filename = HPSV2_FILES[version]
    if _local_dir_with(model, "config.json"):  # a transformers conversion
        return _clip_score(
            "hpsv2", model, processor, model, download, logit_scale=False,
            put="a transformers CLIPModel of HPSv2", round_crop=True,  # open_clip's crop
        )  # fmt: skip
    checkpoint = _hub_file(
        model, filename, download=download, reward="hpsv2", what="HPSv2 checkpoint",
        put=f"{filename} ({HPSV2_REPO} on the hub)", option="model",
    )  # fmt: skip
    open_clip = _import("hpsv2", "open_clip")
    name = arch
    if arch.endswith(".json"):  # an open_clip model config of your own
        config = Path(arch).expanduser()
        if not config.is_file():
            raise RecipeConfigError(f"reward 'hpsv2': no open_clip model config {arch!r}")
        where = f"reward 'hpsv2': {str(config)!r}"
        try:
            fields = json.loads(config.read_text("utf-8"))
        except (OSError, ValueError) as err:
            raise RecipeConfigError(
                f"{where} is not a JSON model config ({_one_line(err)})"
            ) from None
        # open_clip writes an unset size as null (its ResNets' vision_cfg.patch_size).
        check_config(
            fields, where=where, types={"vision_cfg": dict, "text_cfg": dict}, nulls=True,
            error=RecipeConfigError,
        )  # fmt: skip
        open_clip.add_model_config(config)
        name = config.stem
    if name not in open_clip.list_models():
        raise RecipeConfigError(
            f"reward 'hpsv2': arch={arch!r} is no open_clip model (HPSv2 is ViT-H-14)"
        )
    clip = open_clip.create_model(name, pretrained=None, device="cpu", output_dict=True)
    _load_state(clip, _load_weights(checkpoint, "hpsv2", "HPSv2 checkpoint"), checkpoint, "hpsv2")
    return OpenClipScoreReward(
        clip, open_clip.get_tokenizer(name), Preprocess.from_open_clip(clip), name="hpsv2"
    )


# ImageReward's BLIP (salesforce/BLIP's VisionTransformer) -> transformers' BlipVisionModel.
_VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.fc([12])\.", r"encoder.layers.\1.mlp.fc\2."),
    (r"^norm\.", "post_layernorm."),
]


def convert_imagereward_state_dict(
    state: dict[str, Tensor],
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """ImageReward.pt's keys -> ``(vision, text, head)`` state dicts for transformers'
    ``BlipVisionModel``, ``BlipTextModel`` and :class:`ScoreMLP`.

    ``blip.visual_encoder.*`` is BLIP's ViT, renamed as transformers'
    ``convert_blip_original_pytorch_to_hf.py`` does; ``blip.text_encoder.*`` is BLIP's
    ``med.py`` BERT, whose names transformers' ``BlipTextModel`` kept; ``mlp.*`` the head.
    Other keys (projections ImageReward does not use, buffers) are left out, as the
    original's ``load_state_dict(strict=False)`` ignores them."""
    vision: dict[str, Tensor] = {}
    text: dict[str, Tensor] = {}
    head: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key.removeprefix("blip.visual_encoder.")
            for pattern, replacement in _VISION_RENAMES:
                name, count = re.subn(pattern, replacement, name)
                if count:
                    vision[name] = value
                    break
        elif key.startswith("blip.text_encoder."):
            name = key.removeprefix("blip.text_encoder.")
            if not name.endswith("position_ids"):
                text[name] = value
        elif key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
    return vision, text, head


def _blip_configs(
    vision_state: dict[str, Tensor], med: dict[str, Any], path: Path
) -> tuple[Any, Any]:
    """transformers Blip configs for ImageReward: the ViT's sizes read off its weights
    (BLIP's ViTs have 64-wide heads: base 768/12, large 1024/16; LayerNorm eps 1e-6), the
    text encoder's from ``med_config.json`` (BERT-base with cross-attention to the ViT)."""
    from transformers import BlipTextConfig, BlipVisionConfig

    try:
        width = int(vision_state["embeddings.class_embedding"].shape[-1])
        patch = int(vision_state["embeddings.patch_embedding.weight"].shape[-1])
        positions = int(vision_state["embeddings.position_embedding"].shape[1])
        mlp = int(vision_state["encoder.layers.0.mlp.fc1.weight"].shape[0])
    except KeyError as err:
        raise RecipeConfigError(
            f"reward 'imagereward': {str(path)!r} has no BLIP image encoder weight {err} "
            f"(blip.visual_encoder.*)"
        ) from None
    layers = 1 + max(int(k.split(".")[2]) for k in vision_state if k.startswith("encoder.layers."))
    grid = round((positions - 1) ** 0.5)
    vision = BlipVisionConfig(
        hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64), image_size=grid * patch, patch_size=patch,
        hidden_act="gelu", layer_norm_eps=1e-6,
    )  # fmt: skip
    text = BlipTextConfig(
        vocab_size=int(med.get("vocab_size", 30524)),
        hidden_size=int(med.get("hidden_size", 768)),
        encoder_hidden_size=width,  # BLIP sets encoder_width = vision_width
        intermediate_size=int(med.get("intermediate_size", 3072)),
        num_hidden_layers=int(med.get("num_hidden_layers", 12)),
        num_attention_heads=int(med.get("num_attention_heads", 12)),
        max_position_embeddings=int(med.get("max_position_embeddings", 512)),
        hidden_act=str(med.get("hidden_act", "gelu")),
        layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)),
        pad_token_id=int(med.get("pad_token_id", 0)),
        bos_token_id=None,
        eos_token_id=None,
        sep_token_id=None,
        is_decoder=True,  # transformers builds the cross-attention layers only then
    )
    return vision, text


def _blip_tokenizer(where: str, download: bool) -> Any:
    """BLIP's ``init_tokenizer``: BERT's uncased tokenizer plus ``[DEC]`` and ``[ENC]``."""
    transformers = _import("imagereward", "transformers")
    tokenizer = _from_pretrained(
        transformers.BertTokenizer, where, download=download, reward="imagereward",
        what="BERT tokenizer", option="tokenizer",
        put=f"{IMAGEREWARD_TOKENIZER}'s vocab.txt and tokenizer_config.json",
    )  # fmt: skip
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


def imagereward(
    model: str = IMAGEREWARD_REPO, tokenizer: str | None = None, download: bool = False
) -> ImageReward:
    """ImageReward from its original checkpoint (``ImageReward.pt``, ``med_config.json``)
    on transformers' Blip classes."""
    transformers = _import("imagereward", "transformers")
    put = f"{IMAGEREWARD_FILE} and {IMAGEREWARD_MED_CONFIG} ({IMAGEREWARD_REPO} on the hub)"
    found: dict[str, Any] = dict(download=download, reward="imagereward", put=put, option="model")
    checkpoint = _hub_file(model, IMAGEREWARD_FILE, what="ImageReward checkpoint", **found)
    path = Path(model).expanduser()
    if path.is_file() or path.is_dir():
        folder = path.parent if path.is_file() else path
        med_path = _hub_file(str(folder), IMAGEREWARD_MED_CONFIG, what="med_config.json", **found)
    else:
        med_path = _hub_file(model, IMAGEREWARD_MED_CONFIG, what="med_config.json", **found)
    try:
        med = json.loads(med_path.read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise RecipeConfigError(
            f"reward 'imagereward': {str(med_path)!r} is not a JSON config ({_one_line(err)})"
        ) from None
    # _blip_configs reads these fields with int() / float() / str(), which would round 2.5
    # to 2 and take true for 1: each is checked first, and no null (no default here).
    check_config(
        med, where=f"reward 'imagereward': {str(med_path)!r}",
        choices={"model_type": MED_TYPES},
        types={"hidden_act": str, "layer_norm_eps": float, "pad_token_id": int},
        error=RecipeConfigError,
    )  # fmt: skip
    state = _load_weights(checkpoint, "imagereward", "ImageReward checkpoint")
    vision_state, text_state, head_state = convert_imagereward_state_dict(state)
    vision_config, text_config = _blip_configs(vision_state, med, checkpoint)
    vision = transformers.BlipVisionModel(vision_config)
    text = transformers.BlipTextModel(text_config, add_pooling_layer=False)
    head = ScoreMLP(int(text_config.hidden_size))
    for module, part in ((vision, vision_state), (text, text_state), (head, head_state)):
        _load_state(module, part, checkpoint, "imagereward")
    if tokenizer is None:
        folder = path.parent if path.is_file() else path
        local = folder.is_dir() and (folder / "vocab.txt").is_file()
        tokenizer = str(folder) if local else IMAGEREWARD_TOKENIZER
    side = int(vision_config.image_size)
    return ImageReward(
        vision, text, head, _blip_tokenizer(tokenizer, download),
        Preprocess(side, (side, side), CLIP_MEAN, CLIP_STD, "bicubic", round_crop=True),
    )  # fmt: skip


# -- registry (gradest_recipes.rewards reads it) ----------------------------------------------


def _text(value: str) -> str:
    if not value:
        raise ValueError("empty")
    return os.path.expanduser(value)


def _flag(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean (0 or 1)")


def _version(value: str) -> str:
    return value.strip().removeprefix("v")


#: The learned rewards by name, as ``reward = "name:option=value,..."`` spells them.
LEARNED_REWARDS: dict[str, Callable[..., LearnedReward]] = {
    "aesthetic": aesthetic,
    "pickscore": pickscore,
    "hpsv2": hpsv2,
    "imagereward": imagereward,
}
#: Each learned reward's options and how their text is read.
LEARNED_OPTIONS: dict[str, dict[str, Callable[[str], Any]]] = {
    "aesthetic": {"model": _text, "head": _text, "processor": _text, "download": _flag},
    "pickscore": {"model": _text, "processor": _text, "download": _flag},
    "hpsv2": {
        "model": _text,
        "version": _version,
        "arch": _text,
        "processor": _text,
        "download": _flag,
    },  # fmt: skip
    "imagereward": {"model": _text, "tokenizer": _text, "download": _flag},
}
