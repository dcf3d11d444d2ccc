"""Checkpoints of the workload: their format and the shipped ones in ``gradest_digits/assets``.

Checkpoints are plain dicts saved with ``torch.save`` (``kind``, a float32 ``state_dict``,
a config dict and an ``info`` dict of training settings and measured numbers), loaded with
``torch.load(weights_only=True)`` so that loading never runs pickled code.

One reader serves every such file, the 8x8 digits' and MNIST's alike (each dataset has a
DiT and a classifier, :func:`dit_kind` and :func:`classifier_kind`):
:func:`read_model_checkpoint` checks each field
(the kind, the config's options and their types, the state dict's names and float32
tensors, the info dict) and :func:`build_model` builds the model from the config and checks
that every tensor has the model's shape before loading it, so that a damaged or foreign
file is one line naming it and the field, and is never changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import torch
from gradest_lab.errors import MissingFile
from torch import Tensor, nn

from gradest import GradestError, InvalidValue
from gradest.models import DiT, DiTConfig
from gradest_digits.classifier import DigitClassifier, classifier_for
from gradest_digits.datasets import DIGITS, MNIST, Dataset
from gradest_digits.file_schema import (
    Refuse,
    describe,
    first_line,
    is_int,
    is_number,
    load_torch_file,
    require,
    require_fields,
    require_state_dict,
)

DIT_CHECKPOINT = DIGITS.dit_asset
CLASSIFIER_CHECKPOINT = DIGITS.classifier_asset
MNIST_DIT_CHECKPOINT = MNIST.dit_asset
MNIST_CLASSIFIER_CHECKPOINT = MNIST.classifier_asset
MNIST_REGENERATE = "python -m gradest_digits.mnist_pretrain"
# The command that regenerates each shipped file (from the repository root).
REGENERATE = {
    DIT_CHECKPOINT: "python -m gradest_digits.pretrain --what dit "
    "--out apps/digits/gradest_digits/assets/digits_dit.pt",
    CLASSIFIER_CHECKPOINT: "python -m gradest_digits.pretrain --what classifier "
    "--out apps/digits/gradest_digits/assets/digit_classifier.pt",
    MNIST_DIT_CHECKPOINT: MNIST_REGENERATE,
    MNIST_CLASSIFIER_CHECKPOINT: MNIST_REGENERATE,
}


def model_checkpoint(kind: str, model: nn.Module, info: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.load(weights_only=True)``-safe dict: the ``kind``, the model's config
    (a :class:`DiT`'s fields or a :class:`DigitClassifier`'s options), its float32
    state_dict and ``info``."""
    options: Any = model.config
    config = attrs.asdict(options) if isinstance(model, DiT) else dict(options)
    return {
        "kind": kind,
        "config": config,
        "state_dict": {
            k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()
        },
        "info": dict(info),
    }


def classifier_checkpoint(
    model: DigitClassifier, info: Mapping[str, Any], dataset: Dataset = DIGITS
) -> dict[str, Any]:
    """``dataset``'s classifier checkpoint (:func:`model_checkpoint`)."""
    return model_checkpoint(dataset.classifier_kind, model, info)


def dit_checkpoint(
    model: DiT, info: Mapping[str, Any], dataset: Dataset = DIGITS
) -> dict[str, Any]:
    """``dataset``'s DiT checkpoint (:func:`model_checkpoint`)."""
    return model_checkpoint(dataset.dit_kind, model, info)


def classifier_from_checkpoint(
    checkpoint: Mapping[str, Any], dataset: Dataset = DIGITS
) -> DigitClassifier:
    """Rebuild the :class:`DigitClassifier` of :func:`classifier_checkpoint`'s dict (eval
    mode), every field checked (:func:`check_model_checkpoint`)."""
    model = build_model(check_model_checkpoint(checkpoint, classifier_kind(dataset)))
    assert isinstance(model, DigitClassifier)
    return model


def dit_from_checkpoint(checkpoint: Mapping[str, Any], dataset: Dataset = DIGITS) -> DiT:
    """Rebuild the :class:`DiT` saved by :func:`dit_checkpoint` (eval mode), every field
    checked (:func:`check_model_checkpoint`)."""
    model = build_model(check_model_checkpoint(checkpoint, dit_kind(dataset)))
    assert isinstance(model, DiT)
    return model


# -- the format's one reader ------------------------------------------------------------

MODEL_FIELDS = ("kind", "config", "state_dict", "info")


@attrs.frozen
class ModelKind:
    """One kind of model checkpoint: how its config is checked and its model built.

    Attributes:
        kind: the file's ``kind``.
        title: how messages name it (``"a digit-classifier"``).
        check_config: ``check_config(config, refuse)``: each option of its type.
        build: the model from a checked config (in its default dtype, untrained).
        fix: how to make one (for the messages).
    """

    kind: str
    title: str
    check_config: Callable[[dict[str, Any], Refuse], None]
    build: Callable[[dict[str, Any]], nn.Module]
    fix: str


@attrs.frozen
class ModelCheckpoint:
    """A model checkpoint read back, every field checked (:func:`read_model_checkpoint`).

    Attributes:
        kind: what it holds; ``config`` the model's options, ``state_dict`` its float32
            tensors, ``info`` the training settings and measured numbers.
        source: how messages name it (``"checkpoint 'path'"``); ``fix`` what to do.
    """

    kind: ModelKind
    config: dict[str, Any]
    state_dict: dict[str, Tensor]
    info: dict[str, Any]
    source: str
    fix: str

    def refuse(self, field: str, why: str) -> InvalidValue:
        return _refusal(self.source, self.fix)(field, why)

    def as_dict(self) -> dict[str, Any]:
        """The checkpoint as the dict ``torch.load`` returns."""
        return {
            "kind": self.kind.kind,
            "config": self.config,
            "state_dict": self.state_dict,
            "info": self.info,
        }


def _refusal(source: str, fix: str) -> Refuse:
    def refuse(field: str, why: str) -> InvalidValue:
        where = "" if field == "the file" else f": {field}"
        return InvalidValue(f"{source}{where} {why}; it is kept as it is: {fix}")

    return refuse


def read_model_checkpoint(
    path: str | Path, kind: ModelKind, *, fix: str | None = None
) -> ModelCheckpoint:
    """The model checkpoint of ``kind`` in the file ``path``, every field checked.

    Args:
        fix: what the messages tell to do (default: how ``kind`` is made).

    Raises:
        MissingFile: nothing is at ``path``.
        InvalidValue: the file is a link, does not load (``weights_only``: a file that
            would run code is refused, its code not run), is of another kind, or a field
            is missing or of another type: one line naming the file and the field.
    """
    path = Path(path)
    fix = fix or kind.fix
    if not (path.is_symlink() or path.exists()):
        raise MissingFile(f"checkpoint {str(path)!r} is missing; {fix}")
    source = f"checkpoint {str(path)!r}"
    # A model file is only read (never written): it may be a link (a shared store of them).
    data = load_torch_file(path, _refusal(source, fix), links=True)
    return check_model_checkpoint(data, kind, source=source, fix=fix)


def check_model_checkpoint(
    data: Any, kind: ModelKind, *, source: str = "the checkpoint", fix: str | None = None
) -> ModelCheckpoint:
    """``data`` (a checkpoint's dict) as a :class:`ModelCheckpoint` of ``kind``, checked."""
    fix = fix or kind.fix
    refuse = _refusal(source, fix)
    found = data.get("kind") if isinstance(data, Mapping) else type(data).__name__
    if not isinstance(data, Mapping) or found != kind.kind:
        raise InvalidValue(f"{source} is not {kind.title} checkpoint (kind={found!r}); {fix}")
    require_fields(data, MODEL_FIELDS, refuse)
    config, state, info = data["config"], data["state_dict"], data["info"]
    require(isinstance(config, dict), refuse, "config", config, "a dict of the model's options")
    kind.check_config(config, refuse)
    require(isinstance(state, dict) and bool(state), refuse, "state_dict", state, "a state dict")
    for name, tensor in state.items():
        fits = isinstance(name, str) and isinstance(tensor, Tensor)
        fits = fits and tensor.dtype == torch.float32
        require(fits, refuse, f"state_dict[{name!r}]", tensor, "a float32 tensor")
    require(isinstance(info, dict), refuse, "info", info, "a dict")
    return ModelCheckpoint(
        kind=kind, config=config, state_dict=state, info=info, source=source, fix=fix
    )


def build_model(checkpoint: ModelCheckpoint) -> nn.Module:
    """The checkpoint's model in eval mode: built from its config, each tensor checked to
    have the model's shape, then loaded.

    Raises:
        InvalidValue: the config does not build a model, or a tensor is missing, extra or
            of another shape (one line naming the checkpoint and the tensor).
    """
    try:
        model = checkpoint.kind.build(dict(checkpoint.config))
    except (GradestError, TypeError, ValueError) as err:
        raise checkpoint.refuse("config", f"does not build a model ({first_line(err)})") from None
    reference = model.state_dict()
    require_state_dict(
        checkpoint.state_dict, reference, checkpoint.refuse, "state_dict", dtype=torch.float32
    )
    try:
        model.load_state_dict(checkpoint.state_dict)
    except (RuntimeError, KeyError, ValueError) as err:
        raise checkpoint.refuse("state_dict", f"does not load ({first_line(err)})") from None
    return model.eval()


def check_classifier_config(channels: int) -> Callable[[dict[str, Any], Refuse], None]:
    """A classifier's config: ``channels`` (``channels`` positive ints), ``feature_dim``
    and ``num_classes`` (positive ints)."""

    def check(config: dict[str, Any], refuse: Refuse) -> None:
        require_fields(config, ("channels", "feature_dim", "num_classes"), refuse, "config.")
        value = config["channels"]
        ok = isinstance(value, list | tuple) and len(value) == channels
        ok = ok and all(is_int(c) and c >= 1 for c in value)
        require(ok, refuse, "config.channels", value, f"a list of {channels} channel counts")
        for name in ("feature_dim", "num_classes"):
            value = config[name]
            require(is_int(value) and value >= 1, refuse, f"config.{name}", value, "a size >= 1")
        extra = sorted(set(config) - {"channels", "feature_dim", "num_classes"})
        if extra:
            raise refuse(f"config.{extra[0]}", "is not an option of the classifier")

    return check


# An option's annotation (DiTConfig's, as text) -> whether a value is of it.
_OPTION_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (is_int, "an integer"),
    "float": (is_number, "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "int | None": (lambda v: v is None or is_int(v), "an integer or None"),
}


def check_dit_config(config: dict[str, Any], refuse: Refuse) -> None:
    """A DiT's config: the fields of :class:`gradest.models.dit.DiTConfig`, each of its
    type (their ranges are the DiT's own checks, in :func:`build_model`)."""
    fields = {field.name: field for field in attrs.fields(DiTConfig)}
    for name, field in fields.items():
        if name not in config:
            if field.default is attrs.NOTHING:
                raise refuse(f"config.{name}", "is missing")
            continue
        check, wanted = _OPTION_TYPES.get(str(field.type), (lambda v: True, ""))
        require(check(config[name]), refuse, f"config.{name}", config[name], wanted)
    extra = sorted(set(config) - set(fields))
    if extra:
        raise refuse(f"config.{extra[0]}", f"is {describe(config[extra[0]])}: not a DiT option")


def _classifier_builder(dataset: Dataset) -> Callable[[dict[str, Any]], nn.Module]:
    def build(config: dict[str, Any]) -> nn.Module:
        return classifier_for(
            dataset,
            channels=tuple(config["channels"]),
            feature_dim=config["feature_dim"],
            num_classes=config["num_classes"],
        )

    return build


DIGIT_CLASSIFIER = ModelKind(
    kind=DIGITS.classifier_kind,
    title="a digit-classifier",
    check_config=check_classifier_config(len(DIGITS.classifier_channels)),
    build=_classifier_builder(DIGITS),
    fix="make one with gradest_digits.assets.classifier_checkpoint",
)
DIGITS_DIT = ModelKind(
    kind=DIGITS.dit_kind,
    title="a digits-DiT",
    check_config=check_dit_config,
    build=lambda config: DiT(**config),
    fix="make one with gradest_digits.assets.dit_checkpoint",
)
MNIST_CLASSIFIER = ModelKind(
    kind=MNIST.classifier_kind,
    title=f"an {MNIST.classifier_kind}",
    check_config=check_classifier_config(len(MNIST.classifier_channels)),
    build=_classifier_builder(MNIST),
    fix=f"make one with {MNIST_REGENERATE}",
)
MNIST_DIT = ModelKind(
    kind=MNIST.dit_kind,
    title=f"an {MNIST.dit_kind}",
    check_config=check_dit_config,
    build=lambda config: DiT(**config),
    fix=f"make one with {MNIST_REGENERATE}",
)
# The kind of each shipped file.
KINDS = {
    DIT_CHECKPOINT: DIGITS_DIT,
    CLASSIFIER_CHECKPOINT: DIGIT_CLASSIFIER,
    MNIST_DIT_CHECKPOINT: MNIST_DIT,
    MNIST_CLASSIFIER_CHECKPOINT: MNIST_CLASSIFIER,
}


def classifier_kind(dataset: Dataset) -> ModelKind:
    """The checkpoint kind of ``dataset``'s classifier."""
    return KINDS[dataset.classifier_asset]


def dit_kind(dataset: Dataset) -> ModelKind:
    """The checkpoint kind of ``dataset``'s DiT."""
    return KINDS[dataset.dit_asset]


def asset_path(name: str) -> Path:
    """Path of a file in ``apps/digits/gradest_digits/assets/`` (it may not exist)."""
    return Path(str(resources.files("gradest_digits").joinpath("assets", name)))


def read_asset(name: str, folder: Path | None = None) -> ModelCheckpoint:
    """The shipped checkpoint ``name`` in ``folder`` (default: the package's
    ``apps/digits/gradest_digits/assets/``), checked.

    Raises:
        MissingFile / InvalidValue: the file is missing or damaged; the message names it,
            the field, and the command that regenerates it.
    """
    if name not in KINDS:
        raise InvalidValue(f"no shipped checkpoint {name!r}; the digits assets are {sorted(KINDS)}")
    path = asset_path(name) if folder is None else Path(folder) / name
    fix = f"regenerate it from the repository root with: {REGENERATE[name]}"
    return read_model_checkpoint(path, KINDS[name], fix=fix)


def load_checkpoint(name: str) -> dict[str, Any]:
    """The dict stored in ``apps/digits/gradest_digits/assets/<name>`` (CPU tensors),
    every field checked (:func:`read_asset`).

    Raises:
        FileNotFoundError: the file is missing; the message names the command that
            regenerates it.
        ValueError: the file is damaged (one line naming it, the field and that command).
    """
    return read_asset(name).as_dict()


def load_pretrained_dit(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    dataset: Dataset = DIGITS,
) -> DiT:
    """The shipped class-conditional rectified-flow DiT of ``dataset``, in eval mode.

    Its parameters are trainable (``requires_grad=True``): it is the starting point of
    fine-tuning. Label ``10`` (or ``y=None``) samples unconditionally.
    """
    model = build_model(read_asset(dataset.dit_asset))
    assert isinstance(model, DiT)
    return model.to(device=device, dtype=dtype)


def load_digit_classifier(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    dataset: Dataset = DIGITS,
) -> DigitClassifier:
    """The shipped classifier of ``dataset``, in eval mode and frozen (``requires_grad=False``)."""
    classifier = build_model(read_asset(dataset.classifier_asset))
    assert isinstance(classifier, DigitClassifier)
    return classifier.to(device=device, dtype=dtype).requires_grad_(False)
