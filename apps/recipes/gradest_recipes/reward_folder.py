"""Build the folder a learned reward reads (``--reward "aesthetic:model=FOLDER"``) from
checkpoint files already on this machine, and prove that the recipe loads it.

The learned rewards (:mod:`~gradest_recipes.learned_rewards`) read one folder per model,
laid out as the hub repositories are. Downloaded weights are often laid out otherwise: the
CLIP model in the hub cache and the aesthetic predictor's ``.pth`` in a downloads folder,
PickScore's model without its processor (which ships in another repository), ImageReward's
checkpoint apart from BERT's tokenizer. :func:`build_reward_folder` puts those files into
one folder under the names the loader looks for (copies, or symbolic links with
``link=True``), then loads that folder with the recipe's own code
(:func:`gradest_recipes.rewards.resolve_reward` on the returned ``reward`` text) and scores
one grey image, before anything is left at ``out``. Nothing is downloaded.

Supported, with the arguments each takes (named as the reward's own options):

=============== =========================================================================
``aesthetic``   ``model``: a transformers ``CLIPModel`` (or ``CLIPVisionModelWithProjection``)
                folder, ``config.json`` and its weights (``model.safetensors``,
                ``pytorch_model.bin`` or a sharded index); ``head``: the predictor's MLP
                ``.pth`` (default ``sac+logos+ava1-l14-linearMSE.pth`` in ``model``);
                ``processor``: a folder with ``preprocessor_config.json`` (default
                ``model``).
``pickscore``   ``model``: a transformers ``CLIPModel`` folder; ``processor``: a folder
                with ``preprocessor_config.json`` and the tokenizer files (default
                ``model``; PickScore's own come from
                ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).
``hpsv2``       ``model``: the open_clip checkpoint (``HPS_v2_compressed.pt``, or a folder
                holding the ``version``'s file), with ``version`` (``2.0`` or ``2.1``) and
                ``arch`` (an open_clip model name, or its config ``.json``, which is
                copied too); or a transformers ``CLIPModel`` conversion folder, with
                ``processor`` as for PickScore. The open_clip checkpoint needs open_clip.
``imagereward`` ``model``: ``ImageReward.pt`` (or a folder holding it); ``med_config``: its
                ``med_config.json`` (default beside ``model``); ``tokenizer``: a BERT
                tokenizer folder, ``vocab.txt`` or ``tokenizer.json`` (default ``model``'s
                folder; ImageReward's is ``bert-base-uncased``).
=============== =========================================================================

Every argument is checked before a file is written: its type, that it exists and is a
file or a folder as the reward needs, that a folder holds what the loader reads, and a
transformers ``config.json`` by the loader's own check
(:func:`gradest_lab.cost.config_checks.check_config`). A mistake is one
:class:`~gradest_recipes.errors.RecipeConfigError` line naming the argument, its value and
the fix; a file the loader then refuses is named by the argument it came from. The folder
is assembled beside ``out`` and renamed to it only once it loads: a refusal leaves nothing
at ``out``.

From the command line (``python -m gradest_recipes.reward_folder --help``)::

    python -m gradest_recipes.reward_folder aesthetic /models/aesthetic \\
        --model ~/.cache/huggingface/hub/models--openai--clip-vit-large-patch14/snapshots/REV \\
        --head ~/Downloads/sac+logos+ava1-l14-linearMSE.pth
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch

from gradest_recipes.errors import RecipeConfigError

# The loader's constants and its config check: the folder is refused by exactly the rule
# the recipe's loading applies, before anything is copied.
from gradest_recipes.learned_rewards import (
    AESTHETIC_CLIP,
    AESTHETIC_HEAD,
    AESTHETIC_TYPES,
    CLIP_TYPES,
    HPSV2_FILES,
    IMAGEREWARD_FILE,
    IMAGEREWARD_MED_CONFIG,
    IMAGEREWARD_TOKENIZER,
    PICKSCORE_PROCESSOR,
    check_transformers_config,
)
from gradest_recipes.rewards import resolve_reward

__all__ = ["KINDS", "RewardFolder", "build_reward_folder", "main"]

#: The arguments each kind takes besides ``out`` and ``link``: the reward's own options.
KINDS: Mapping[str, tuple[str, ...]] = {
    "aesthetic": ("model", "head", "processor"),
    "pickscore": ("model", "processor"),
    "hpsv2": ("model", "version", "arch", "processor"),
    "imagereward": ("model", "med_config", "tokenizer"),
}
CONFIG = "config.json"
PREPROCESSOR = "preprocessor_config.json"
# What transformers' tokenizers read (CLIP's BPE, BERT's WordPiece, the fast tokenizer's
# tokenizer.json); one of VOCABULARIES makes a tokenizer, the rest are its settings.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
VOCABULARIES = ("tokenizer.json", "vocab.json", "vocab.txt")
# transformers' weight files, safetensors first as from_pretrained prefers them: the single
# file, or the index naming its shards.
WEIGHTS = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)
SMOKE_PROMPT = "a photo"
# The --reward options besides model=: option -> (value, whether it names a file of the
# folder, its path then written out; "" is the folder itself).
Extra: TypeAlias = Mapping[str, tuple[str, bool]]


@dataclass(frozen=True)
class RewardFolder:
    """A folder :func:`build_reward_folder` built: ``reward`` is the ``--reward`` value
    that reads it; ``sources`` maps each of its file names to the file it came from."""

    kind: str
    folder: Path
    reward: str
    sources: Mapping[str, Path]


@dataclass(frozen=True)
class _File:
    """One file of the folder: its name there, the argument it came from, its source."""

    name: str
    argument: str
    source: Path


def build_reward_folder(
    kind: str,
    out: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str],
    head: str | os.PathLike[str] | None = None,
    processor: str | os.PathLike[str] | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    med_config: str | os.PathLike[str] | None = None,
    version: str | None = None,
    arch: str | None = None,
    link: bool = False,
) -> RewardFolder:
    """The folder ``out`` that ``--reward "KIND:model=OUT"`` reads, assembled from local
    checkpoint files and loaded once by the recipe's loader (module docstring: the kinds
    and the arguments each takes). ``link=True`` links the files (absolute symbolic links
    to their targets) where by default they are copied.

    Returns:
        :class:`RewardFolder`; its ``reward`` is the ``--reward`` value to pass (with
        ``version=`` or ``arch=`` where HPSv2 needs them).

    Raises:
        RecipeConfigError: one line naming the argument, its value and the fix; ``out``
            is left as it was.
    """
    if not isinstance(kind, str) or kind not in KINDS:
        raise RecipeConfigError(
            f"reward folder: kind={kind!r} is not one of {', '.join(KINDS)}; pass one of them"
        )
    prefix = f"reward folder {kind!r}"
    options = {"head": head, "processor": processor, "tokenizer": tokenizer,
               "med_config": med_config, "version": version, "arch": arch}  # fmt: skip
    for argument, value in options.items():
        if value is not None and argument not in KINDS[kind]:
            shown = os.fspath(value) if isinstance(value, os.PathLike) else value
            raise RecipeConfigError(
                f"{prefix}: {argument}={shown!r} is not an input of {kind!r}; it takes "
                f"{', '.join(KINDS[kind])}"
            )
    if not isinstance(link, bool):
        raise RecipeConfigError(f"{prefix}: link={link!r} is not a boolean; pass True or False")
    target = _out_folder(prefix, out)
    model_path = _required(prefix, "model", model)
    paths = {name: _path(prefix, name, value) for name, value in
             (("head", head), ("processor", processor), ("tokenizer", tokenizer),
              ("med_config", med_config))}  # fmt: skip
    if kind == "aesthetic":
        files = _aesthetic(prefix, model_path, paths["head"], paths["processor"])
        extra: Extra = {}
    elif kind == "pickscore":
        files = _clip(prefix, "pickscore", model_path, paths["processor"], PICKSCORE_PROCESSOR)
        extra = {}
    elif kind == "hpsv2":
        files, extra = _hpsv2(prefix, model_path, version, arch, paths["processor"])
    else:
        files, extra = _imagereward(prefix, model_path, paths["med_config"], paths["tokenizer"])
    given = {"model": model_path, **{name: path for name, path in paths.items() if path}}
    return _assemble(kind, prefix, target, files, extra, link, given)


# -- the arguments ---------------------------------------------------------------------------


def _path(prefix: str, argument: str, value: Any) -> Path | None:
    """``value`` as a path (None stays None); anything but a non-empty path is refused."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise RecipeConfigError(
            f"{prefix}: {argument}={value!r} is {type(value).__name__}, not a path; pass the "
            f"path of a local file or folder (nothing is downloaded)"
        )
    return Path(os.fspath(value)).expanduser()


def _required(prefix: str, argument: str, value: Any) -> Path:
    path = _path(prefix, argument, value)
    if path is None:
        raise RecipeConfigError(f"{prefix}: {argument} is required; pass a local path")
    return path


def _out_folder(prefix: str, out: Any) -> Path:
    # Absolute: the --reward text names it from any working folder.
    path = Path(os.path.abspath(_required(prefix, "out", out)))
    if "," in str(path):  # the reward text's options end at a comma
        raise RecipeConfigError(
            f"{prefix}: out={str(path)!r} holds a comma, which a --reward option value "
            f"cannot; choose a folder without one"
        )
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise RecipeConfigError(
            f"{prefix}: out={str(path)!r} exists and is not an empty folder; pass a new folder "
            f"(nothing is overwritten)"
        )
    return path


def _file(prefix: str, argument: str, path: Path, what: str) -> Path:
    if not path.is_file():
        found = "is a folder" if path.is_dir() else "does not exist (a local path is read)"
        raise RecipeConfigError(f"{prefix}: {argument}={str(path)!r} {found}; pass {what}")
    return path


def _folder(prefix: str, argument: str, path: Path, holds: Sequence[str], what: str) -> Path:
    """``path``, a folder holding at least one of ``holds``."""
    if not path.is_dir():
        found = (
            "is a file, not a folder" if path.is_file() else "does not exist (a local path is read)"
        )
        raise RecipeConfigError(f"{prefix}: {argument}={str(path)!r} {found}; pass {what}")
    if not any((path / name).is_file() for name in holds):
        raise RecipeConfigError(
            f"{prefix}: {argument}={str(path)!r} holds no {' or '.join(holds)}; pass {what}"
        )
    return path


def _present(folder: Path, names: Sequence[str], argument: str) -> list[_File]:
    return [_File(n, argument, folder / n) for n in names if (folder / n).is_file()]


# -- what each kind's folder holds -------------------------------------------------------------


def _transformers_model(prefix: str, reward: str, model: Path, types: Sequence[str]) -> list[_File]:
    """``config.json`` and the weights of a ``save_pretrained`` folder, the config refused
    as the loader refuses it."""
    what = "the folder CLIPModel.save_pretrained wrote (config.json and its weights)"
    _folder(prefix, "model", model, (CONFIG,), what)
    try:
        check_transformers_config(str(model), download=False, reward=reward, model_types=types)
    except RecipeConfigError as err:
        raise RecipeConfigError(f"{prefix}: model={str(model)!r} is refused: {err}") from None
    for single, index in WEIGHTS:
        if (model / single).is_file():
            return [_File(CONFIG, "model", model / CONFIG), _File(single, "model", model / single)]
        if (model / index).is_file():
            return [_File(CONFIG, "model", model / CONFIG), *_shards(prefix, model, index)]
    raise RecipeConfigError(
        f"{prefix}: model={str(model)!r} holds config.json but no weights "
        f"({', '.join(name for pair in WEIGHTS for name in pair)}); pass {what}"
    )


def _shards(prefix: str, model: Path, index: str) -> list[_File]:
    """A sharded checkpoint: its index and every shard its ``weight_map`` names."""
    try:
        weight_map = json.loads((model / index).read_text("utf-8"))["weight_map"]
        shards = sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise RecipeConfigError(
            f"{prefix}: model={str(model)!r}: {index} is not a weight index ({err!r}); pass a "
            f"folder whose index names its shards in weight_map"
        ) from None
    files = [_File(index, "model", model / index)]
    for shard in shards:
        if Path(shard).name != shard or not (model / shard).is_file():
            raise RecipeConfigError(
                f"{prefix}: model={str(model)!r}: the shard {shard!r} its {index} names is "
                f"not in the folder; pass the folder with every shard"
            )
        files.append(_File(shard, "model", model / shard))
    return files


def _processor(
    prefix: str, model: Path, processor: Path | None, default: str, *, tokenizer: bool
) -> list[_File]:
    """The image processor (and the tokenizer, for a reward that reads prompts): from
    ``processor`` if given, else from the model folder."""
    argument, where = ("processor", processor) if processor is not None else ("model", model)
    what = f"a folder with {default}'s {PREPROCESSOR}" + (" and tokenizer files" * tokenizer)
    fix = f"processor=<{what}>" if processor is None else what
    _folder(prefix, argument, where, (PREPROCESSOR,), fix)
    if tokenizer:
        _folder(prefix, argument, where, VOCABULARIES, fix)
    names = (PREPROCESSOR, *(TOKENIZER_FILES if tokenizer else ()))
    return _present(where, names, argument)


def _clip(
    prefix: str, reward: str, model: Path, processor: Path | None, default: str
) -> list[_File]:
    """A CLIPModel scored against prompts (PickScore, HPSv2's conversion)."""
    files = _transformers_model(prefix, reward, model, CLIP_TYPES)
    return files + _processor(prefix, model, processor, default, tokenizer=True)


def _aesthetic(prefix: str, model: Path, head: Path | None, processor: Path | None) -> list[_File]:
    files = _transformers_model(prefix, "aesthetic", model, AESTHETIC_TYPES)
    what = (
        f"the predictor's MLP {AESTHETIC_HEAD} "
        f"(github.com/christophschuhmann/improved-aesthetic-predictor)"
    )
    if head is None:
        if not (model / AESTHETIC_HEAD).is_file():
            raise RecipeConfigError(
                f"{prefix}: head is not given and model={str(model)!r} holds no "
                f"{AESTHETIC_HEAD}; pass head=<{what}>"
            )
        head = model / AESTHETIC_HEAD
    files.append(_File(AESTHETIC_HEAD, "head", _file(prefix, "head", head, what)))
    return files + _processor(prefix, model, processor, AESTHETIC_CLIP, tokenizer=False)


def _hpsv2(
    prefix: str, model: Path, version: str | None, arch: str | None, processor: Path | None
) -> tuple[list[_File], Extra]:
    if model.is_dir() and (model / CONFIG).is_file():  # a transformers conversion
        if arch is not None or version is not None:
            raise RecipeConfigError(
                f"{prefix}: model={str(model)!r} is a transformers CLIPModel conversion (it "
                f"holds config.json); version= and arch= are for the open_clip checkpoint"
            )
        return _clip(prefix, "hpsv2", model, processor, PICKSCORE_PROCESSOR), {}
    if processor is not None:
        raise RecipeConfigError(
            f"{prefix}: processor={str(processor)!r} is for a transformers conversion of HPSv2 "
            f"(a model folder with config.json); the open_clip checkpoint's preprocessing "
            f"is its arch's"
        )
    if version is not None and (not isinstance(version, str) or version not in HPSV2_FILES):
        what = "" if isinstance(version, str) else f" ({type(version).__name__}, not text)"
        raise RecipeConfigError(
            f"{prefix}: version={version!r}{what} is not one of "
            f"{', '.join(map(repr, HPSV2_FILES))}; pass one"
        )
    name = HPSV2_FILES[version or "2.0"]
    what = f"{name} (xswu/HPSv2 on the hub) or a folder holding it"
    checkpoint = model / name if model.is_dir() else _file(prefix, "model", model, what)
    files = [_File(name, "model", _file(prefix, "model", checkpoint, what))]
    extra = {} if version in (None, "2.0") else {"version": (str(version), False)}
    if arch is not None:
        if not isinstance(arch, str) or not arch.strip():
            raise RecipeConfigError(
                f"{prefix}: arch={arch!r} is not an open_clip model name or config .json; "
                f"pass one (HPSv2 is ViT-H-14)"
            )
        if arch.endswith(".json"):  # open_clip names the model after the file: keep it
            config = _file(prefix, "arch", Path(arch).expanduser(), "an open_clip model .json")
            files.append(_File(config.name, "arch", config))
            extra["arch"] = (config.name, True)
        else:
            extra["arch"] = (arch, False)
    return files, extra


def _imagereward(
    prefix: str, model: Path, med_config: Path | None, tokenizer: Path | None
) -> tuple[list[_File], Extra]:
    what = f"{IMAGEREWARD_FILE} (THUDM/ImageReward on the hub) or a folder holding it"
    checkpoint = _file(prefix, "model", model / IMAGEREWARD_FILE if model.is_dir() else model, what)
    folder = checkpoint.parent
    if med_config is None:
        med_config = folder / IMAGEREWARD_MED_CONFIG
        if not med_config.is_file():
            raise RecipeConfigError(
                f"{prefix}: med_config is not given and no {IMAGEREWARD_MED_CONFIG} is beside "
                f"model={str(checkpoint)!r}; pass med_config=<ImageReward's "
                f"{IMAGEREWARD_MED_CONFIG}>"
            )
    med = _file(prefix, "med_config", med_config, f"ImageReward's {IMAGEREWARD_MED_CONFIG}")
    argument, where = ("tokenizer", tokenizer) if tokenizer is not None else ("model", folder)
    tokenizer_what = f"a folder with {IMAGEREWARD_TOKENIZER}'s vocab.txt or tokenizer.json"
    fix = f"tokenizer=<{tokenizer_what}>" if tokenizer is None else tokenizer_what
    _folder(prefix, argument, where, ("vocab.txt", "tokenizer.json"), fix)
    files = [
        _File(IMAGEREWARD_FILE, "model", checkpoint),
        _File(IMAGEREWARD_MED_CONFIG, "med_config", med),
        *_present(where, TOKENIZER_FILES, argument),
    ]
    # The loader takes the model folder as the tokenizer only when it holds vocab.txt.
    has_vocab = any(f.name == "vocab.txt" for f in files)
    return files, ({} if has_vocab else {"tokenizer": ("", True)})


# -- assembling and proving ----------------------------------------------------------------------


def _reward_text(kind: str, folder: Path, extra: Extra) -> str:
    """The ``--reward`` value reading ``folder``: ``model=FOLDER`` and ``extra``."""
    options = {"model": str(folder)}
    for key, (value, in_folder) in extra.items():
        options[key] = str(folder / value) if in_folder else value
    return f"{kind}:{','.join(f'{key}={value}' for key, value in options.items())}"


def _assemble(
    kind: str,
    prefix: str,
    out: Path,
    files: list[_File],
    extra: Extra,
    link: bool,
    given: Mapping[str, Path],
) -> RewardFolder:
    """Link every file into a folder beside ``out``, load it as the recipe does, then copy
    (unless ``link``) and rename it to ``out``: a refusal costs no copy and leaves nothing."""
    names = [f.name for f in files]
    assert len(set(names)) == len(names), names  # each kind's files have distinct names
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        for file in files:
            (staging / file.name).symlink_to(file.source.resolve())
        _prove(kind, prefix, staging, out, files, extra, given)
        if not link:
            for file in files:
                (staging / file.name).unlink()
                shutil.copyfile(file.source, staging / file.name)
        if out.is_dir():  # an empty folder, checked by _out_folder: rename replaces it
            out.rmdir()
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return RewardFolder(
        kind=kind,
        folder=out,
        reward=_reward_text(kind, out, extra),
        sources={f.name: f.source for f in files},
    )


def _prove(
    kind: str,
    prefix: str,
    staging: Path,
    out: Path,
    files: list[_File],
    extra: Extra,
    given: Mapping[str, Path],
) -> None:
    """Load ``staging`` by its ``--reward`` text, as a recipe does, and score one grey image
    with one prompt; a failure is one line naming the arguments whose files it names (all
    the ``given`` path arguments when it names none)."""
    text = _reward_text(kind, staging, extra)
    try:
        reward: Any = resolve_reward(text)
        with torch.no_grad():
            value = reward(torch.full((1, 3, 64, 64), 0.5), prompts=[SMOKE_PROMPT])
        if not (isinstance(value, torch.Tensor) and value.shape == (1,)) or not bool(
            torch.isfinite(value).all()
        ):
            raise RecipeConfigError(f"it scored a grey image {value!r}, not one finite number")
    except Exception as err:  # noqa: BLE001 - any failure of foreign files is one line
        message = " ".join(str(err).split()).removeprefix(f"setting reward={text!r}: ")
        if not isinstance(err, RecipeConfigError):
            message = f"{type(err).__name__}: {message}"
        # Name the sources, not the staging folder that is about to go.
        blamed = []
        for file in sorted(files, key=lambda f: -len(f.name)):
            staged = str(staging / file.name)
            if staged in message:
                message = message.replace(staged, str(file.source))
                blamed.append(f"{file.argument}={str(file.source)!r}")
        message = message.replace(str(staging), str(out))
        if not blamed:
            blamed = [f"{argument}={str(path)!r}" for argument, path in given.items()]
        raise RecipeConfigError(
            f"{prefix}: the folder from {', '.join(dict.fromkeys(blamed))} does not load as "
            f"the recipe loads it ({message}); pass files of one checkpoint"
        ) from None


# -- the command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradest_recipes.reward_folder KIND OUT --model PATH ...``: build the
    folder, print the ``--reward`` value that reads it; a refusal is one line, exit 2."""
    parser = argparse.ArgumentParser(
        prog="python -m gradest_recipes.reward_folder",
        description="Build the folder a learned reward reads from local checkpoint files, "
        "and load it once as the recipe does. Nothing is downloaded.",
    )
    parser.add_argument("kind", help=f"one of {', '.join(KINDS)}")
    parser.add_argument("out", help="the folder to create (new, or empty)")
    parser.add_argument("--model", required=True, help="the checkpoint folder or file")
    parser.add_argument("--head", help="aesthetic: the predictor's MLP .pth")
    parser.add_argument("--processor", help="aesthetic, pickscore, hpsv2: processor folder")
    parser.add_argument("--tokenizer", help="imagereward: a BERT tokenizer folder")
    parser.add_argument("--med-config", dest="med_config", help="imagereward: med_config.json")
    parser.add_argument("--version", help="hpsv2: 2.0 or 2.1")
    parser.add_argument("--arch", help="hpsv2: an open_clip model name or config .json")
    parser.add_argument("--link", action="store_true", help="link the files, do not copy")
    args = vars(parser.parse_args(argv))
    try:
        built = build_reward_folder(args.pop("kind"), args.pop("out"), **args)
    except RecipeConfigError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"{built.folder}: {len(built.sources)} files; use --reward {built.reward!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
