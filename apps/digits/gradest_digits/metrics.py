"""FID and KID of digit samples through torch-fidelity, on the digit classifier's features.

Inception features mean nothing on 8x8 digits (and would need a download), so the
metrics use the penultimate layer of the digit classifier instead, the same
construction as the "classifier FID" common for MNIST. The features come from a custom
torch-fidelity feature extractor, :class:`DigitFeatureExtractor`, registered under
:data:`EXTRACTOR_NAME`; the statistics (Frechet distance of Gaussian fits, polynomial
kernel MMD over random subsets) are torch-fidelity's own. Everything runs on the CPU
and offline: the extractor is always named explicitly, so torch-fidelity never falls
back to its default Inception network and never reaches for its weights, and caching
(which writes under ``$TORCH_HOME``) is off.

torch-fidelity's input API takes a ``Dataset`` of uint8 images, like decoded image
files: :func:`to_uint8` quantises ``[-1, 1]`` to ``0..255`` (clipping samples that
overshoot the range, as saving them as images would) and the extractor maps back to
``[-1, 1]`` before the classifier sees them.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch_fidelity
from torch import Tensor, nn
from torch.utils.data import Dataset
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

from gradest import InvalidType, InvalidValue
from gradest_digits.assets import (
    DIGIT_CLASSIFIER,
    build_model,
    load_digit_classifier,
    read_model_checkpoint,
)
from gradest_digits.datasets import DIGITS

EXTRACTOR_NAME = "gradest-digit-classifier"
FEATURE_LAYER = "penultimate"
# KID's torch-fidelity default subset size; smaller sample sets use half their size, so
# that the subsets differ and the reported standard deviation means something (subsets of
# the whole set would all be the same set: std 0). The unbiased MMD^2 estimator is
# unbiased at any subset size; smaller subsets only make each draw noisier.
DEFAULT_KID_SUBSET_SIZE = 1000


def to_uint8(images: Tensor) -> Tensor:
    """``[-1, 1]`` floats -> ``0..255`` uint8 on the CPU (clipped, rounded)."""
    return ((images.detach().cpu().double().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)


def from_uint8(images: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """Inverse of :func:`to_uint8` up to quantisation: ``0..255`` -> ``[-1, 1]``."""
    return images.to(dtype) / 127.5 - 1.0


class DigitImages(Dataset):
    """torch-fidelity input: uint8 ``[1, 8, 8]`` images from ``[n, 1, 8, 8]`` floats in [-1, 1]."""

    def __init__(self, images: Tensor):
        if images.ndim != 4 or tuple(images.shape[1:]) != DIGITS.image_shape:
            raise InvalidValue(
                f"digit images must have shape [n, 1, 8, 8] (values in [-1, 1]), got "
                f"{tuple(images.shape)}"
            )
        if not images.is_floating_point():
            raise InvalidType(f"digit images must be floating point in [-1, 1], got {images.dtype}")
        if not bool(torch.isfinite(images).all()):
            raise InvalidValue("digit images contain NaN or infinite values")
        self.images = to_uint8(images)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> Tensor:
        return self.images[index]


class DigitFeatureExtractor(FeatureExtractorBase):
    """torch-fidelity feature extractor: the digit classifier's penultimate activations.

    torch-fidelity builds it as ``cls(name, features_list, **calculate_metrics_kwargs)``;
    it uses the classifier passed as ``digit_classifier=`` (copied, so torch-fidelity's
    ``eval()`` / ``requires_grad_(False)`` never touch the caller's module), else the
    checkpoint at ``feature_extractor_weights_path``, else the shipped classifier.
    Features are computed in float64 so that statistics of nearly equal sets stay exact.
    """

    def __init__(
        self,
        name: str,
        features_list: list[str],
        feature_extractor_weights_path: str | None = None,
        digit_classifier: nn.Module | None = None,
        **kwargs: Any,
    ):
        del kwargs  # the rest of calculate_metrics' options
        super().__init__(name, features_list)
        classifier: Any  # any module with features(x); usually a DigitClassifier
        if digit_classifier is not None:
            classifier = copy.deepcopy(digit_classifier)
        elif feature_extractor_weights_path is not None:
            # The format's one reader: a damaged file is one line naming it and the field.
            checkpoint = read_model_checkpoint(feature_extractor_weights_path, DIGIT_CLASSIFIER)
            classifier = build_model(checkpoint)
        else:
            classifier = load_digit_classifier()
        if not callable(getattr(classifier, "features", None)):
            raise InvalidType(
                f"digit_classifier must have a features(x) method (a DigitClassifier), got "
                f"{type(classifier).__name__}"
            )
        self.classifier: Any = classifier.to(device="cpu", dtype=torch.float64).eval()

    @staticmethod
    def get_provided_features_list() -> tuple[str, ...]:
        return (FEATURE_LAYER,)

    @staticmethod
    def get_default_feature_layer_for_metric(metric: str) -> str:
        del metric
        return FEATURE_LAYER

    @staticmethod
    def can_be_compiled() -> bool:
        return False

    @staticmethod
    def get_dummy_input_for_compile() -> Tensor:
        return torch.zeros((1, *DIGITS.image_shape), dtype=torch.uint8)

    def forward(self, input: Tensor) -> tuple[Tensor]:  # noqa: A002 (torch-fidelity's name)
        if input.dtype != torch.uint8:
            raise InvalidType(
                f"{EXTRACTOR_NAME} expects uint8 images (torch-fidelity's convention), got "
                f"{input.dtype}; wrap float images in gradest_digits.metrics.DigitImages"
            )
        images = from_uint8(input.cpu(), torch.float64)
        return (self.classifier.features(images),)


def register() -> None:
    """Register :class:`DigitFeatureExtractor` with torch-fidelity (idempotent)."""
    if EXTRACTOR_NAME not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(EXTRACTOR_NAME, DigitFeatureExtractor)


register()


def _single_threaded_blas() -> contextlib.AbstractContextManager[Any]:
    # KID multiplies a hundred small (subset x subset) kernel matrices in NumPy; a
    # multi-threaded BLAS spends more time waking threads than multiplying (8x slower
    # on a busy 2-core machine), so pin it to one thread for the call.
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def fid_kid(
    generated: Tensor,
    reference: Tensor,
    *,
    classifier: nn.Module | None = None,
    kid_subsets: int = 100,
    kid_subset_size: int | None = None,
    seed: int = 0,
    batch_size: int = 256,
) -> dict[str, float]:
    """FID and KID between two sets of digits, on the digit classifier's features.

    Args:
        generated: ``[n, 1, 8, 8]`` images in ``[-1, 1]`` (values outside are clipped).
        reference: ``[m, 1, 8, 8]`` images in ``[-1, 1]``, e.g. the held-out digits.
        classifier: the feature network (a :class:`DigitClassifier`); default the shipped one.
        kid_subsets: number of random subsets KID averages over.
        kid_subset_size: samples per KID subset; default ``min(1000, max(2, min(n, m) // 2))``.
            It may not exceed either set's size.
        seed: seeds torch-fidelity's KID subset draws.
        batch_size: images per feature-extraction batch.

    Returns:
        ``{"fid": ..., "kid_mean": ..., "kid_std": ...}`` (KID: mean and standard
        deviation over the subsets).
    """
    smallest = min(generated.shape[0], reference.shape[0])
    if smallest < 2:
        raise InvalidValue(
            f"FID/KID need at least 2 images per set, got generated={generated.shape[0]}, "
            f"reference={reference.shape[0]}"
        )
    if kid_subset_size is None:
        kid_subset_size = min(DEFAULT_KID_SUBSET_SIZE, max(2, smallest // 2))
    elif not 2 <= kid_subset_size <= smallest:
        raise InvalidValue(
            f"kid_subset_size={kid_subset_size} must be between 2 and the smaller set's size "
            f"({smallest}); pass kid_subset_size=None for the default"
        )
    if kid_subsets < 1:
        raise InvalidValue(f"kid_subsets must be >= 1, got {kid_subsets}")
    with _single_threaded_blas():
        metrics = torch_fidelity.calculate_metrics(
            input1=DigitImages(generated),
            input2=DigitImages(reference),
            fid=True,
            kid=True,
            feature_extractor=EXTRACTOR_NAME,
            digit_classifier=classifier,
            kid_subsets=kid_subsets,
            kid_subset_size=kid_subset_size,
            rng_seed=seed,
            batch_size=batch_size,
            cuda=False,
            cache=False,
            save_cpu_ram=True,  # no DataLoader worker processes
            datasets_download=False,
            verbose=False,
        )
    return {
        "fid": float(metrics[torch_fidelity.KEY_METRIC_FID]),
        "kid_mean": float(metrics[torch_fidelity.KEY_METRIC_KID_MEAN]),
        "kid_std": float(metrics[torch_fidelity.KEY_METRIC_KID_STD]),
    }
