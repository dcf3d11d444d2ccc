"""The recipe loop: LoRA reward fine-tuning of a diffusers model with any gradest estimator.

Each optimizer step, on every process: draw ``batch_size`` prompts and initial noise
(from a generator seeded by ``(seed, step, micro-step, process)``, so a resumed run draws
what the uninterrupted run drew), build the terminal objective ``-reward(decode(z_N))``
and call ``est.surrogate(model, sampler, objective, noise=..., cond=...)``; then
``accelerator.backward(sur.loss)``, gradient clipping and ``optimizer.step()``.

Outputs in ``out``: ``config.toml`` (every setting), ``log.jsonl`` (one record per
``log_every`` steps and per evaluation), ``tensorboard/`` (the same scalars and the sample grids),
``samples/step_XXXXXX.png`` (a grid every ``sample_every`` steps and at the end),
``checkpoints/step_XXXXXX/`` (every ``save_every`` steps and at the end; see
:mod:`gradest_recipes.checkpoints`) and ``lora/pytorch_lora_weights.safetensors`` (the
final adapters in diffusers' format), plus the run folder's own ``run.json`` (the run's
identity: :func:`run_record`) and, while the run writes, its lock ``.gradest-run.lock``
(:mod:`gradest_lab.storage.run_folder`: a folder holds one run, written by one process at a time).

With ``eval_prompts = n`` the embeddings' last ``n`` prompts are held out of training, and
with ``eval_every`` the run evaluates on them at step 0, every ``eval_every`` steps and at
the end (:mod:`gradest_recipes.evaluation`: fixed noise, a deterministic sampler, the EMA
weights with ``use_ema``), logging ``eval_reward`` in that step's record.

With ``objective = "grpo"`` or ``"adjoint_matching"`` (the scripts
``examples/recipes/{sd3,flux}_{grpo,adjoint_matching}.py``) each micro-step instead rolls
out the current model with a stochastic sampler and trains with a stepwise RL objective on
the recorded path (:mod:`gradest_recipes.rl_objectives`); everything else is the same loop.

Entry point: :func:`main` ``(argv, family=..., objective=...)``; ``examples/recipes/*.py``
are thin scripts around it.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from gradest_lab.storage.files import JsonLog, atomic_write, atomic_write_text
from gradest_lab.storage.run_folder import (
    RUN_RECORD,
    RunFolder,
    RunRecord,
    claim_run_folder,
    lineage_of,
)
from torch import Tensor
from tqdm.auto import tqdm

from gradest import GradestError, InvalidValue, MissingDependency
from gradest.plugin import check_surrogate, is_stateful
from gradest_recipes.checkpoints import (
    FullStateAdamW,
    abandon_newer,
    check_checkpoint_files,
    checkpoint_dirs,
    export_lora,
    holds_checkpoint,
    load_checkpoint,
    lora_tensors,
    register_lora_hooks,
    save_checkpoint,
)
from gradest_recipes.config import (
    MAY_CHANGE_ON_RESUME,
    NOT_SAVED,
    RecipeConfig,
    RecipeConfigError,
    config_from_argv,
    run_settings,
    to_toml,
)
from gradest_recipes.embeddings import PromptEmbeddings, load_embeddings, tiny_embeddings
from gradest_recipes.evaluation import (
    EVAL,
    EVAL_SEED,
    ema_weights,
    eval_batches,
    eval_mode,
    eval_sampler,
    evaluates_at,
    hold_out,
    random_state_kept,
)
from gradest_recipes.families import (
    Family,
    build_family,
    check_pretrained_folder,
    guided,
    shard_denoiser,
)
from gradest_recipes.grpo_epoch import grpo_step, updates_per_step
from gradest_recipes.records import (
    DONE_FILE,
    LOG_FILE,
    DoneRecord,
    RecipeState,
    find_checkpoint,
    log_step,
    read_done,
    read_log,
)
from gradest_recipes.reward_sums import WeightedReward
from gradest_recipes.rewards import (
    Reward,
    decode_images,
    decoded_reward,
    resolve_reward,
    reward_objective,
)
from gradest_recipes.rl_objectives import RLObjective, per_sample_reward, supports_stepwise

__all__ = ["main", "run_record", "script_main", "train"]

# diffusers' file name for LoRA weights (``load_lora_weights`` finds it in a folder).
LORA_FILE = "pytorch_lora_weights.safetensors"

WEIGHT_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NOISE, ESTIMATOR, SAMPLES, ROLLOUT = 0, 1, 2, 3  # generator streams


def generator_for(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, *keys)`` (independent streams per key tuple)."""
    words = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))


def saved_settings(resume: str) -> dict[str, Any]:
    """The settings a run saved in its newest checkpoint (for ``--resume``); ``out`` is
    the run folder that holds the checkpoint (where the run continues unless told)."""
    state = find_checkpoint(resume)
    settings = dict(state.config)
    if state.folder.parent.name == "checkpoints":
        settings["out"] = str(state.folder.parent.parent)
    return settings


#: What the recipes import beyond gradest; a missing one is named in one line.
NEEDS = ("accelerate", "peft", "diffusers", "safetensors")


def missing_dependencies() -> list[str]:
    """The packages of :data:`NEEDS` that are not installed."""
    import importlib.util

    missing = []
    for name in NEEDS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def main(argv: Sequence[str] | None = None, *, family: str, objective: str = "reward") -> int:
    """Run the ``family`` recipe with command-line ``argv`` and the script's ``objective``
    (``reward``, ``grpo``, ``adjoint_matching``); returns the exit status: 0, or
    :data:`INTERRUPTED` after Ctrl-C, which ends with one line on stderr naming the newest
    complete checkpoint and the command that continues from it."""
    missing = missing_dependencies()
    if missing:
        raise MissingDependency(
            f"the recipes need {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed: pip install . ./apps/recipes (from the gradest repository root)"
        )
    script = f"{family}_{objective}.py"
    config, _ = config_from_argv(
        family, argv, saved_from=saved_settings, objective=objective, script=script
    )
    try:
        with _auto_progress_logged(config):
            train(family, config)
    except KeyboardInterrupt:
        # Ctrl-C: checkpoints are complete or absent (written under a temporary name and
        # renamed), so the run continues from the newest one; say how, in one line.
        if int(os.environ.get("RANK", "0")) == 0:  # once, not from every process
            print(interrupted_line(script, config), file=sys.stderr)
        return INTERRUPTED
    return 0


#: The exit status after Ctrl-C (128 + SIGINT), as shells report an interrupted command.
INTERRUPTED = 130


def interrupted_line(script: str, config: RecipeConfig) -> str:
    """The one line a recipe stopped by Ctrl-C ends with: the newest complete checkpoint
    and the command that continues from it (or, before the first one, that nothing can)."""
    # The script as it was started when it is the one running, else the shipped one.
    command = sys.argv[0] if Path(sys.argv[0]).name == script else f"examples/recipes/{script}"
    out = Path(config.out)
    found = checkpoint_dirs(out / "checkpoints")
    if not found:
        return (
            f"{script}: interrupted before its first checkpoint (save_every="
            f"{config.save_every}); nothing to resume: start again with another "
            f"--output_dir (or remove {out})"
        )
    step, folder = found[0]
    # Several processes are continued by the launcher that started them (its own flags).
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    how = "continue with: python" if single else "continue under the same launcher with:"
    return (
        f"{script}: interrupted; the last complete checkpoint is step {step} ({folder}); "
        f"{how} {shlex.quote(command)} --resume_from_checkpoint latest "
        f"--output_dir {shlex.quote(str(out))}"
    )


class _ProgressBarHandler(logging.Handler):
    """Log records as lines above the progress bar (``tqdm.write``), on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's own rule: a handler never raises into the caller
            self.handleError(record)


@contextlib.contextmanager
def _auto_progress_logged(config: RecipeConfig) -> Iterator[None]:
    """Show ``auto``'s INFO lines (the ``"gradest.auto"`` logger: what a probe will cost,
    in model units and exact calls, before it runs; what it spent and picked) on the main
    process's stderr while the run trains, unless the program configured logging itself
    (a handler on that logger or above it: its settings are kept). Python shows only
    warnings by default, so without this a probe of ~40 exact calls' work would be silent.
    The handler and the level are removed again at the end (in-process runs, tests)."""
    logger = logging.getLogger("gradest.auto")
    configured = logger.hasHandlers()
    main_process = int(os.environ.get("RANK", "0")) == 0
    if configured or not main_process or config.estimator.partition(":")[0].strip() != "auto":
        yield
        return
    handler, level = _ProgressBarHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def script_main(
    family: str, argv: Sequence[str] | None = None, *, objective: str = "reward"
) -> int:
    """:func:`main` for a script's ``__main__``: a documented error (a bad setting, a
    missing file) is printed as one line and exits 2; anything else keeps its traceback."""
    try:
        return main(argv, family=family, objective=objective)
    except GradestError as err:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr)
        return 2


def _check_fsdp(config: RecipeConfig, accelerator: Any, world: int) -> None:
    """Refuse FSDP settings that cannot work, naming the setting and the fix."""
    from accelerate.utils import DistributedType

    accelerate_fsdp = accelerator.distributed_type == DistributedType.FSDP
    if config.fsdp and world < 2:
        raise RecipeConfigError(
            "setting fsdp=True is invalid in 1 process: FSDP shards the model across "
            "processes; launch 2 or more (accelerate launch --multi_gpu --num_processes 2, "
            "or torchrun --nproc_per_node 2), or set fsdp = false"
        )
    if config.fsdp and accelerate_fsdp:
        raise RecipeConfigError(
            "setting fsdp=True is invalid under accelerate's own FSDP (accelerate launch "
            "--use_fsdp or an FSDP accelerate config): the model would be sharded twice; "
            "drop --fsdp, or launch with --multi_gpu instead of --use_fsdp"
        )
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if asked and not accelerate_fsdp and not config.fsdp:
        raise RecipeConfigError(
            f"accelerate was asked for FSDP (--use_fsdp or an FSDP config) but set up "
            f"{accelerator.distributed_type.value} (accelerate enables FSDP on GPUs only), so "
            f"this run would not shard; on CPUs pass --fsdp to the recipe (setting fsdp = "
            f"true: torch's fully_shard) and launch with --multi_gpu"
        )


def _autocast_forward(accelerator: Any, module: torch.nn.Module) -> None:
    """Run ``module``'s forward under the run's mixed precision, outputs in float32: what
    ``accelerator.prepare`` does to a model it prepares (the FSDP model is not prepared)."""
    if not getattr(accelerator, "native_amp", False):
        return
    from accelerate.utils import convert_outputs_to_fp32

    forward = module.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    module.forward = convert_outputs_to_fp32(autocast_forward)  # type: ignore[method-assign]


def _parallel(model: torch.nn.Module) -> str:
    """How ``model`` is data parallel: ``"fsdp2"`` (``fully_shard`` modules), ``"ddp"``,
    ``"fsdp1"`` or ``"none"`` (written to ``done.json``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fsdp2"
    if isinstance(model, FSDP1):
        return "fsdp1"
    return "ddp" if isinstance(model, DistributedDataParallel) else "none"


def _check_resume(family: str, config: RecipeConfig, state: RecipeState) -> None:
    if state.family != family:
        raise RecipeConfigError(
            f"setting resume={config.resume!r}: that run is the {state.family!r} "
            f"recipe, this is {family!r}"
        )
    now = config.to_dict()
    for key, value in state.config.items():
        if key in MAY_CHANGE_ON_RESUME:
            continue
        if now.get(key) != value:
            raise RecipeConfigError(
                f"setting {key}={now.get(key)!r} differs from the resumed run's {value!r}; a "
                f"resumed run may change only {sorted(MAY_CHANGE_ON_RESUME - {'resume'})} "
                f"(start a new run in another out folder to change {key})"
            )


#: How a recipe names its out folder in messages (diffusers' flag, as the resume line has it).
OUT_OPTION = "--output_dir"


def run_record(family: str, config: RecipeConfig, lineage: Sequence[str] = ()) -> RunRecord:
    """The identity of ``config``'s run, as its folder's ``run.json`` records it: the
    script's command, the settings a resume may not change (:func:`run_settings`) and
    ``lineage``, the checkpoints of other folders the run continues from."""
    return RunRecord(
        command=f"gradest recipe {family}_{config.objective}",
        settings=run_settings(config),
        lineage=tuple(lineage),
    )


@attrs.frozen
class _Start:
    """How a run starts in its folder, worked out before anything is written.

    Attributes:
        record: the run's identity (``run.json``).
        resume_from: the recipe state of the checkpoint resumed, or None.
        in_place: the checkpoint lies in the run's own out folder (the run continues
            there); False for a new run and for a checkpoint of another folder (the run
            continues from it in a new or empty out folder).
        done: the folder's ``done.json`` (a run continued in place), or None.
    """

    record: RunRecord
    resume_from: RecipeState | None
    in_place: bool
    done: DoneRecord | None = None


@attrs.frozen(eq=False)
class _Inputs:
    """What a run's settings name, resolved and checked before its folder is looked at.

    Attributes:
        estimator: the estimator ``config.estimator`` builds.
        reward: the reward ``config.reward`` names.
        embeddings: the prompt embeddings trained on (``config.embeddings``, or the tiny
            ones; without the held-out prompts).
        held_out: the last ``eval_prompts`` prompts, never trained on; None without.
    """

    estimator: Any
    reward: Reward
    embeddings: PromptEmbeddings
    held_out: PromptEmbeddings | None = None


def _inputs_of(family: str, config: RecipeConfig) -> _Inputs:
    """Every setting that names something (an estimator, a reward, a file or folder to
    read) checked, reading only: a bad one is refused as itself, the same in an empty
    folder as in one that holds another run, before the run folder is looked at."""
    estimator = _estimator(config)  # a bad spec fails before any file is read
    reward: Reward = resolve_reward(config.reward)
    if config.mixed_precision == "fp16" and not _has_fp16_device():
        raise RecipeConfigError(
            "setting mixed_precision='fp16' is invalid on a CPU (torch autocasts CPUs to "
            "bf16 only); use 'bf16' or 'no' there, 'fp16' on a GPU"
        )
    embeddings = (
        tiny_embeddings(family)
        if config.tiny
        else load_embeddings(config.embeddings or "", family, guided=guided(family, config))
    )
    if not config.tiny:
        check_pretrained_folder(family, config)
    training, held_out = hold_out(embeddings, config.eval_prompts)
    return _Inputs(estimator=estimator, reward=reward, embeddings=training, held_out=held_out)


def _start_of(family: str, config: RecipeConfig) -> _Start:
    """Where ``config``'s run starts, and its record: only reads (the resumed checkpoint's
    state and settings are checked here, before the folder is claimed; so are the
    ``done.json`` and ``log.jsonl`` of a run continued in place)."""
    if not config.resume:
        return _Start(record=run_record(family, config), resume_from=None, in_place=False)
    state = find_checkpoint(config.resume)
    folder = state.folder
    _check_resume(family, config, state)
    lineage = state.lineage
    out = Path(config.out)
    in_place = holds_checkpoint(out, folder)
    if in_place and not (out / RUN_RECORD).is_file():
        raise InvalidValue(
            f"{OUT_OPTION} {str(out)!r} holds no {RUN_RECORD}: a run of an older gradest (or "
            f"not a recipe run), which is not continued in place; continue from its "
            f"checkpoint in a new folder: --resume_from_checkpoint {shlex.quote(str(folder))} "
            f"--output_dir NEW"
        )
    done = None
    if in_place:  # what the run wrote besides its checkpoints, read before anything is written
        done = read_done(out / DONE_FILE)
        read_log(out / LOG_FILE)
    else:  # continued from another folder's checkpoint: part of this run's identity
        lineage = (*lineage, *lineage_of([folder]))
    return _Start(
        record=run_record(family, config, lineage),
        resume_from=state,
        in_place=in_place,
        done=done,
    )


def _on_cpus(world: int) -> bool:
    """Whether accelerate is asked for CPUs (``cpu=True``): several processes on a machine
    without CUDA run data parallel on CPUs (gloo), which accelerate enables only so."""
    from accelerate.utils import parse_flag_from_env

    return (world > 1 and not torch.cuda.is_available()) or parse_flag_from_env(
        "ACCELERATE_USE_CPU"
    )


@contextlib.contextmanager
def _claimed(config: RecipeConfig, start: _Start) -> Iterator[RunFolder | None]:
    """Hold the run folder ``config.out`` for the body (gradest_lab.storage.run_folder's rule):
    the main
    process claims it (``run.json``, the lock) before any process writes anything there;
    the others wait for the outcome, and a refusal is raised on every process. Yields the
    claim on the main process, None on the others."""
    from accelerate import PartialState

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # The process group first (the Accelerator built later takes this state over), so that
    # the other processes can wait for the main one's claim.
    state = PartialState(cpu=_on_cpus(world))
    if world > 1 and state.num_processes != world:
        raise RecipeConfigError(
            f"launched as {world} processes but accelerate set up {state.num_processes}; "
            f"every process would write the same files. Launch with accelerate launch (or "
            f"torchrun) on a supported backend"
        )
    out = Path(config.out)
    hint = None
    if checkpoint_dirs(out / "checkpoints"):  # the documented resume (see interrupted_line)
        hint = f"--resume_from_checkpoint latest {OUT_OPTION} {shlex.quote(str(out))}"
    with contextlib.ExitStack() as stack:
        claimed: RunFolder | None = None
        refused: GradestError | None = None
        if state.is_main_process:
            try:
                claimed = stack.enter_context(
                    claim_run_folder(
                        out,
                        start.record,
                        what=OUT_OPTION,
                        resume=start.in_place,
                        resume_hint=hint,
                    )
                )
            except GradestError as err:
                refused = err
        if state.num_processes > 1:  # the others go on once the main process holds it
            from accelerate.utils import broadcast_object_list

            refused = broadcast_object_list([refused])[0]
        if refused is not None:
            raise refused
        yield claimed


class _EstimatorState:
    """An estimator's per-model state in the form accelerate checkpoints: ``state_dict()``
    and ``load_state_dict(state)`` without the model argument."""

    def __init__(self, estimator: Any, model: torch.nn.Module):
        self.estimator, self.model = estimator, model

    def state_dict(self) -> dict[str, Any]:
        return self.estimator.state_dict(self.model)  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.estimator.load_state_dict(self.model, state)


def _estimator(config: RecipeConfig) -> Any:
    import gradest
    from gradest.plugin import check_steps

    try:
        estimator = gradest.estimator(config.estimator)
        # Options that need more steps than the sampler has fail now, not after loading.
        check_steps(estimator, config.num_inference_steps)
    except (GradestError, ValueError, TypeError) as err:
        raise RecipeConfigError(
            f"setting estimator={config.estimator!r} is invalid: {err}"
        ) from None
    if config.objective != "reward" and not supports_stepwise(estimator):
        raise RecipeConfigError(
            f"setting estimator={config.estimator!r} is invalid for objective "
            f"{config.objective!r}: it is defined for terminal (reward) objectives only; the "
            f"RL objectives are stepwise: use e.g. exact, sdo, jagg, truncated or telescope"
        )
    return estimator


def _save_grid(images: Tensor, path: Path) -> Tensor:
    """Write ``images [n, 3, H, W]`` in ``[0, 1]`` as one PNG grid (atomically)."""
    from PIL import Image

    n, channels, height, width = images.shape
    columns = math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    pad = 2
    grid = torch.ones(channels, rows * (height + pad) + pad, columns * (width + pad) + pad)
    for i, image in enumerate(images.float().cpu()):
        r, c = divmod(i, columns)
        top, left = pad + r * (height + pad), pad + c * (width + pad)
        grid[:, top : top + height, left : left + width] = image
    pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda file: file.write(buffer.getbuffer()))
    return grid


def _has_fp16_device() -> bool:
    xpu = getattr(torch, "xpu", None)
    mps = getattr(torch.backends, "mps", None)
    return bool(
        torch.cuda.is_available()
        or (xpu is not None and xpu.is_available())
        or (mps is not None and mps.is_available())
    )


def _wandb_offline_unless_logged_in() -> None:
    """Offline wandb (files under ``out/wandb``, ``wandb sync`` later) unless WANDB_MODE is
    set or an API key is at hand (``WANDB_API_KEY``, or ``wandb login``'s netrc entry)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return
    try:
        import netrc

        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    if not logged_in:
        os.environ["WANDB_MODE"] = "offline"


def _trackers(family: str, config: RecipeConfig, out: Path, step: int) -> list[Any]:
    """accelerate trackers for ``report_to``: TensorBoard in ``out/tensorboard``, wandb in
    ``out/wandb`` (offline without an API key); ``step``: where a resumed run starts."""
    names = {"all": ["tensorboard", "wandb"], "none": []}.get(config.report_to, [config.report_to])
    trackers: list[Any] = []
    if "tensorboard" in names:
        from accelerate.tracking import TensorBoardTracker

        # A resumed run redoes the steps after its checkpoint: purge_step hides the
        # earlier run's events from the first redone step on, so none appears twice.
        trackers.append(TensorBoardTracker("tensorboard", str(out), purge_step=step + 1))
    if "wandb" in names:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise MissingDependency(
                f"setting report_to={config.report_to!r} needs wandb: "
                f"pip install './apps/recipes[wandb]'"
            )
        from accelerate.tracking import WandBTracker

        _wandb_offline_unless_logged_in()
        out.mkdir(parents=True, exist_ok=True)
        trackers.append(
            WandBTracker(f"gradest-recipes-{family}", dir=str(out), name=out.name or family)
        )
    return trackers


def _hparams(config: RecipeConfig) -> dict[str, Any]:
    """The settings as tracker hyperparameters (str, int, float, bool only)."""
    values: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if key in NOT_SAVED:
            continue
        if isinstance(value, list):
            value = ",".join(value)
        values[key] = "none" if value is None else value
    return values


def _validation_embeddings(family: str, config: RecipeConfig, device: Any) -> PromptEmbeddings:
    """The prompt embeddings of ``validation_prompt``: encoded with the pipeline's own text
    encoders from ``pretrained`` (:func:`gradest_recipes.prompts.encode_prompts`), or with
    ``tiny = true`` tiny random embeddings seeded by the prompt's text."""
    prompt = config.validation_prompt or ""
    if config.tiny:
        import zlib

        tiny = tiny_embeddings(family, seed=zlib.crc32(prompt.encode("utf-8")))
        tensors = {k: v if k.startswith("negative_") else v[:1] for k, v in tiny.tensors.items()}
        return PromptEmbeddings(family=family, prompts=(prompt,), tensors=tensors)
    from gradest_recipes.prompts import encode_prompts

    encoded = encode_prompts(
        family, config.pretrained or "", [prompt], device=str(device),
        dtype=WEIGHT_DTYPES[config.mixed_precision],
    )  # fmt: skip
    gc.collect()  # the text encoders are gone again
    return encoded


class _Run:
    """One run's state (kept in one place so the loop reads top to bottom)."""

    def __init__(self, family_name: str, config: RecipeConfig, start: _Start, inputs: _Inputs):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.config = config
        self.family_name = family_name
        self.estimator = inputs.estimator
        self.reward: Reward = inputs.reward
        # What the run trains on: every prompt draw (batch, grpo_step) reads these.
        self.embeddings: PromptEmbeddings = inputs.embeddings
        self.held_out: PromptEmbeddings | None = inputs.held_out
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.out = Path(config.out)
        self.start = start
        self.resume_from = start.resume_from
        resume_step = start.resume_from.step if start.resume_from else 0
        self.accelerator = accelerator = Accelerator(
            mixed_precision=config.mixed_precision,
            gradient_accumulation_steps=config.gradient_accumulation,
            cpu=_on_cpus(world),
            log_with=_trackers(family_name, config, self.out, resume_step) or None,
        )
        _check_fsdp(config, accelerator, world)
        set_seed(config.seed)  # LoRA's random init
        self.family: Family = build_family(
            family_name,
            config,
            self.embeddings,
            weight_dtype=WEIGHT_DTYPES[config.mixed_precision],
            device=accelerator.device,
        )
        self.family.vae.to(accelerator.device)
        self.rl: RLObjective | None = (
            RLObjective(self.family, config) if config.objective != "reward" else None
        )
        self.eval_sampler: Any = (
            eval_sampler(self.family, config) if self.held_out is not None else None
        )
        velocity = self.family.velocity
        if config.fsdp:  # torch's FSDP2, applied here: accelerate prepares FSDP on GPUs only
            shard_denoiser(self.family.denoiser)
        self.validation: PromptEmbeddings | None = (
            _validation_embeddings(family_name, config, accelerator.device)
            if config.validation_prompt
            else None
        )
        trainable = [p for p in velocity.parameters() if p.requires_grad]
        self.trainable = trainable
        optimizer_class = FullStateAdamW if config.fsdp else torch.optim.AdamW
        optimizer = optimizer_class(
            trainable,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            weight_decay=config.weight_decay,
        )
        if config.fsdp:
            # Not through accelerate.prepare, which would wrap the sharded model in DDP;
            # accelerate still handles the optimizer, accumulation, clipping and state.
            self.model, self.optimizer = velocity, accelerator.prepare(optimizer)
            _autocast_forward(accelerator, velocity)
            register_lora_hooks(accelerator, models=[velocity])
        else:
            self.model, self.optimizer = accelerator.prepare(velocity, optimizer)
            register_lora_hooks(accelerator)
        self.parallel = _parallel(self.model)
        # The schedule steps once per optimizer step, here (not prepared: accelerate would
        # step it once per process); its state and the EMA's go into every checkpoint.
        from diffusers.optimization import get_scheduler

        self.lr_scheduler = get_scheduler(
            config.lr_scheduler,
            self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer,
            step_rules=config.lr_step_rules,
            num_warmup_steps=config.lr_warmup_steps,
            num_training_steps=config.steps * updates_per_step(config),
            num_cycles=config.lr_num_cycles,
            power=config.lr_power,
        )
        # What accelerate checkpoints besides the model and the optimizer, in its order
        # (custom_checkpoint_N.pkl), each with whether it checks its own saved state.
        self.checkpointed: list[tuple[Any, bool]] = []
        self._checkpoint_with(self.lr_scheduler)
        self.ema: Any = None
        if config.use_ema:
            from gradest_recipes.ema import IntervalEMA

            self.ema = IntervalEMA(trainable, config.ema_decay, config.ema_every)
            self._checkpoint_with(self.ema)
        if is_stateful(self.estimator):
            # auto's schedule (its picks and probes so far) is part of the run: without it a
            # resumed run would probe again at other steps. Its length varies: the
            # estimator's own load_state_dict checks it.
            self._checkpoint_with(_EstimatorState(self.estimator, self.model), checks_itself=True)
        self.log = JsonLog(self.out / LOG_FILE) if accelerator.is_main_process else None
        self.step = 0
        if self.resume_from is not None:
            self._resume(self.resume_from)
        if accelerator.is_main_process:
            atomic_write_text(self.out / "config.toml", to_toml(config))
        accelerator.init_trackers(f"gradest-recipes-{family_name}", config=_hparams(config))

    def _checkpoint_with(self, obj: Any, *, checks_itself: bool = False) -> None:
        self.accelerator.register_for_checkpointing(obj)
        self.checkpointed.append((obj, checks_itself))

    def _resume(self, resumed: RecipeState) -> None:
        """Load the checkpoint ``resumed``: every file is read and checked first
        (:func:`check_checkpoint_files`; a damaged or foreign one is one line, and nothing
        in the run folder has changed), then accelerate loads them. A run continued in
        its own folder then sets its newer checkpoints aside and cuts its log back."""
        from accelerate.utils import DistributedType

        accelerator = self.accelerator
        # accelerate's own FSDP (GPUs) saves the sharded model and optimizer in its formats.
        if accelerator.distributed_type != DistributedType.FSDP:
            check_checkpoint_files(
                resumed.folder,
                optimizer=self.optimizer,
                custom=self.checkpointed,
                process_index=accelerator.process_index,
                scaler=getattr(accelerator, "scaler", None),
            )
        load_checkpoint(accelerator, resumed.folder)
        if self.ema is not None:
            self.ema.to(accelerator.device)
        # The schedule is a function of ``steps``, which a resume may change: the lr of
        # the next step from the loaded position under this run's schedule.
        self.lr_scheduler.last_epoch -= 1
        self.lr_scheduler.step()
        self.step = resumed.step
        if self.start.in_place:
            # This run's own newer checkpoints: kept aside (never another folder's: a run
            # resumed from another folder's checkpoint starts in a new or empty one).
            if accelerator.is_main_process:
                for moved in abandon_newer(self.out, resumed.step, resumed_from=resumed.folder):
                    print(f"resuming from step {resumed.step}: the newer checkpoint was "
                          f"moved to {moved}", file=sys.stderr)  # fmt: skip
            accelerator.wait_for_everyone()
        log = self.log
        if log is not None:
            log.keep(lambda record: log_step(record, log.path) <= self.step)

    # -- one step ------------------------------------------------------------------------------

    def batch(self, micro: int) -> tuple[Tensor, Tensor]:
        g = generator_for(self.config.seed, NOISE, self.step, micro, self.accelerator.process_index)
        if self.rl is not None:  # grpo: whole groups of one prompt
            index = self.rl.prompt_index(g, self.embeddings.count, self.config.batch_size)
        else:
            index = torch.randint(self.embeddings.count, (self.config.batch_size,), generator=g)
        noise = torch.randn((self.config.batch_size, *self.family.latent_shape), generator=g)
        return index, noise.to(self.accelerator.device)

    def train_step(self) -> dict[str, Any]:
        accelerator, config, family = self.accelerator, self.config, self.family
        started = time.perf_counter()
        values: list[float] = []
        losses: list[float] = []
        units, grad_norm = 0.0, float("nan")
        extras: dict[str, list[float]] = {}
        lr = float(self.lr_scheduler.get_last_lr()[0])  # this step's learning rate
        micro_steps = config.gradient_accumulation
        if config.objective == "grpo":  # Flow-GRPO's epoch: gradest_recipes.grpo_epoch
            streams = (NOISE, ESTIMATOR, ROLLOUT)
            values, losses, units, grad_norm, extras = grpo_step(self, generator_for, streams)
            micro_steps = 0
        for micro in range(micro_steps):
            index, noise = self.batch(micro)
            prompts = [self.embeddings.prompts[int(i)] for i in index]
            cond = family.make_cond(self.embeddings, index, accelerator.device)
            generator = generator_for(
                config.seed, ESTIMATOR, self.step, micro, accelerator.process_index
            )
            prepared = None
            if self.rl is None:
                sampler, inputs = family.sampler, {"noise": noise}
                objective = reward_objective(
                    self.reward, family.vae, family.to_vae_latents, prompts,
                    autocast=accelerator.autocast,
                )  # fmt: skip
            else:  # roll out the current model, then a stepwise objective on the path
                rewards = per_sample_reward(
                    self.reward, family.vae, family.to_vae_latents, prompts,
                    autocast=accelerator.autocast,
                )  # fmt: skip
                rollout = generator_for(
                    config.seed, ROLLOUT, self.step, micro, accelerator.process_index
                )
                prepared = self.rl.prepare(
                    accelerator.unwrap_model(self.model), noise, cond, rewards, rollout
                )
                sampler, objective = self.rl.sampler, prepared.objective
                inputs = {"trajectory": prepared.trajectory}
                for key, value in prepared.metrics.items():
                    extras.setdefault(key, []).append(value)
            with accelerator.accumulate(self.model):
                sur = self.estimator.surrogate(
                    self.model, sampler, objective, cond=cond, generator=generator, **inputs,
                )  # fmt: skip
                # A plugin's surrogate that is not a scalar loss: one line naming it.
                accelerator.backward(check_surrogate(self.estimator, sur).loss)
                if accelerator.sync_gradients:
                    parameters = [p for p in self.model.parameters() if p.requires_grad]
                    norm = accelerator.clip_grad_norm_(
                        parameters, config.max_grad_norm or float("inf")
                    )
                    if norm is not None and hasattr(norm, "full_tensor"):
                        norm = norm.full_tensor()  # FSDP: a DTensor
                    grad_norm = float(norm) if norm is not None else float("nan")
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:
                    self.lr_scheduler.step()
                    if self.ema is not None:
                        self.ema.step(self.trainable)
            # The reward of this step's samples. An estimator that takes its loss on other
            # points (draft_lv: on re-noised copies of the sample) reports the sample's own
            # loss as info["sample_loss"]; its objective value goes to "loss".
            if prepared is not None:  # the rollout's reward; sur.value is the RL objective
                values.append(prepared.reward)
            else:
                values.append(-sur.info.get("sample_loss", sur.value))
            losses.append(sur.value)
            units += sur.cost.model_units()
        self.step += 1
        if isinstance(self.reward, WeightedReward):
            # Each term's own (unweighted) mean over what the reward scored this step, under
            # the same keys on every process (NaN where a process scored none) for the gather.
            term_means = self.reward.take_term_means()
            for term in self.reward.terms:
                extras.setdefault(f"reward_{term.label}", []).append(
                    term_means.get(term.label, float("nan"))
                )
        names = sorted(extras)
        local = torch.tensor(
            [float(np.mean(values)), float(np.mean(losses))]
            + [float(np.mean(extras[name])) for name in names]
        )
        gathered = accelerator.gather(local.to(accelerator.device)).view(-1, local.numel())
        reward, loss, *rest = (float(x) for x in gathered.mean(0))
        means = dict(zip(names, rest, strict=True))
        if "objective_model_units" in means:  # work, summed over the micro-steps
            means["objective_model_units"] = float(np.sum(extras["objective_model_units"]))
        if not math.isfinite(reward):
            from gradest_lab.errors import Diverged

            raise Diverged(f"the reward is {reward} at step {self.step}; lower lr")
        return {
            "step": self.step,
            "reward": reward,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "model_forwards": units,
            **means,
            "seconds": time.perf_counter() - started,
        }

    # -- outputs -------------------------------------------------------------------------------

    def record(self, values: dict[str, Any]) -> None:
        if self.log is None:
            return
        self.log.append(values)
        # The trackers: the evaluation's values (eval_*) under eval/, the rest under train/.
        scalars = {
            f"eval/{key[len('eval_') :]}" if key.startswith("eval_") else f"train/{key}": value
            for key, value in values.items()
            if key != "step" and isinstance(value, int | float) and math.isfinite(value)
        }
        self.accelerator.log(scalars, step=values["step"])

    def _final_latents(
        self,
        model: torch.nn.Module,
        sampler: Any,
        embeddings: PromptEmbeddings,
        index: Tensor,
        noise: Tensor,
    ) -> Tensor:
        """The final states ``z_N`` of ``model`` sampled by ``sampler`` from ``noise`` for
        the prompts ``index`` of ``embeddings``, without a graph, in the run's mixed
        precision: the sampling of the sample grids and of the evaluation."""
        import gradest

        cond = self.family.make_cond(embeddings, index, self.accelerator.device)
        with self.accelerator.autocast():
            return gradest.rollout(model, sampler, noise, cond=cond).states[-1]

    @torch.no_grad()
    def sample_grid(self) -> None:
        """Sample ``sample_count`` images on fixed noise and prompts; main writes the PNG."""
        accelerator, config, family = self.accelerator, self.config, self.family
        g = generator_for(config.seed, SAMPLES)
        count = config.sample_count
        embeddings = self.validation or self.embeddings
        index = torch.arange(count) % embeddings.count
        noise = torch.randn((count, *family.latent_shape), generator=g).to(accelerator.device)
        final = self._final_latents(self.model, family.sampler, embeddings, index, noise)
        with accelerator.autocast():
            images = decode_images(family.vae, family.to_vae_latents(final))
        if accelerator.is_main_process:
            path = self.out / "samples" / f"step_{self.step:06d}.png"
            grid = _save_grid(images, path)
            for tracker in accelerator.trackers:
                if tracker.name == "tensorboard":
                    tracker.writer.add_image("samples", grid, self.step)
                    tracker.writer.flush()
                elif tracker.name == "wandb":
                    import wandb

                    caption = config.validation_prompt or "training prompts"
                    pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8)
                    tracker.log(
                        {"samples": wandb.Image(pixels.permute(1, 2, 0).numpy(), caption=caption)},
                        step=self.step,
                    )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Score the model on the held-out prompts (:mod:`gradest_recipes.evaluation`):
        each once, from its fixed noise, with the deterministic :attr:`eval_sampler`, the
        EMA weights with ``use_ema`` (the trained ones back afterwards, bit for bit),
        the reward per image; every process scores its share and every process returns
        ``{"eval_reward": mean over all held-out prompts}``. Draws from no global
        generator, and leaves the weights, the modes and the random streams as they were:
        a run trains the same with evaluations as without."""
        accelerator, family, held_out = self.accelerator, self.family, self.held_out
        if held_out is None:
            raise RecipeConfigError("an evaluation needs held-out prompts: set eval_prompts")
        device = accelerator.device
        first_row = self.embeddings.count  # held-out row r is the embeddings' row first_row + r
        model = accelerator.unwrap_model(self.model)  # no DDP buffer broadcasts per call
        total = torch.zeros(2, dtype=torch.float64)  # the rewards' sum, their count
        batches = eval_batches(
            held_out.count, accelerator.process_index, accelerator.num_processes,
            self.config.eval_batch_size,
        )  # fmt: skip
        with random_state_kept(device), ema_weights(self.ema, self.trainable), eval_mode(model):
            for batch in batches:
                noise = torch.stack([
                    torch.randn(family.latent_shape,
                                generator=generator_for(EVAL_SEED, EVAL, first_row + int(row)))
                    for row in batch.rows
                ]).to(device)  # fmt: skip
                final = self._final_latents(model, self.eval_sampler, held_out, batch.rows, noise)
                if not batch.scored:  # a stand-in: the processes' sampling calls in step
                    continue
                rows = batch.rows[: batch.scored]
                prompts = [held_out.prompts[int(row)] for row in rows]
                values = decoded_reward(
                    self.reward, family.vae, family.to_vae_latents, prompts,
                    autocast=accelerator.autocast,
                )(final[: batch.scored])  # fmt: skip
                if not isinstance(values, Tensor) or values.ndim > 1:
                    raise InvalidValue(
                        f"the reward returned {type(values).__name__} of shape "
                        f"{tuple(getattr(values, 'shape', ()))}; a reward returns a tensor "
                        f"[B] (one value per image) or a scalar"
                    )
                values = values.detach().double().cpu()
                # A scalar reward is its batch's mean: it counts once per image.
                total[0] += values.sum() if values.ndim else values * batch.scored
                total[1] += batch.scored
        gathered = accelerator.gather(total.to(device)).view(-1, 2).sum(0)
        return {"eval_reward": float(gathered[0] / gathered[1])}

    def lora_export_tensors(self, ema: bool = False) -> dict[str, Tensor]:
        """The denoiser's LoRA tensors by its own parameter names (every process calls it:
        FSDP shards are gathered); ``ema``: the EMA's values instead of the trained ones."""
        from accelerate.utils import DistributedType

        accelerator = self.accelerator
        if ema:
            shadow = {id(p): s for p, s in zip(self.trainable, self.ema.shadow_params, strict=True)}
            return {
                name: shadow[id(p)].detach().float().cpu().contiguous()
                for name, p in self.family.denoiser.named_parameters()
                if "lora_" in name
            }
        if accelerator.distributed_type == DistributedType.FSDP:  # accelerate's own FSDP
            state = accelerator.get_state_dict(self.model)  # every process (gathers)
            inner = next(
                name
                for name, module in self.family.velocity.named_modules()
                if module is self.family.denoiser
            )
            prefix = f"{inner}." if inner else ""
            return {
                key[len(prefix) :]: value
                for key, value in state.items()
                if key.startswith(prefix) and "lora_" in key
            }
        return lora_tensors(self.family.denoiser)

    def export(self, folder: Path) -> None:
        """Write ``folder/pytorch_lora_weights.safetensors`` (diffusers' LoRA format; with
        ``use_ema`` also ``folder/ema/...``, the EMA weights). Every process calls it."""
        exports = [(folder, self.lora_export_tensors())]
        if self.ema is not None:
            exports.append((folder / "ema", self.lora_export_tensors(ema=True)))
        if self.accelerator.is_main_process:
            for where, tensors in exports:
                export_lora(
                    tensors, self.family.lora_prefix, where / LORA_FILE,
                    self.config.lora_rank, self.config.lora_alpha,
                )  # fmt: skip

    def checkpoint(self) -> None:
        saved = {k: v for k, v in self.config.to_dict().items() if k not in NOT_SAVED}
        lineage = list(self.start.record.lineage)
        state = {"family": self.family_name, "config": saved, "lineage": lineage}
        save_checkpoint(
            self.accelerator, self.out, self.step, state, self.config.keep_checkpoints,
            export=self.export,
        )  # fmt: skip

    def finish(self) -> None:
        accelerator = self.accelerator
        accelerator.wait_for_everyone()
        self.export(self.out / "lora")
        # A DDP wrapper must not outlive its process group (end_training destroys it): with
        # gloo that aborted processes at exit (docs/distributed.md). Keep the bare module.
        self.model = accelerator.unwrap_model(self.model)
        accelerator._models.clear()
        gc.collect()
        accelerator.end_training()


def _write_done(run: _Run) -> None:
    """``done.json`` (:class:`DoneRecord`), written last, after the final LoRA export: a
    run folder without it, or whose record is of an earlier step, was stopped before its
    export finished, and resuming it at its last step finishes the export."""
    record = DoneRecord(
        step=run.step,
        out=str(run.out),
        processes=run.accelerator.num_processes,
        parallel=run.parallel,
    )
    atomic_write_text(run.out / DONE_FILE, record.to_json())


def train(family: str, config: RecipeConfig) -> _Run:
    """Run the recipe for ``family`` with ``config``; returns the finished run (its
    ``family.denoiser``, ``out``, ``step``).

    The out folder is claimed for the whole run (gradest_lab.storage.run_folder): a new run
    starts only
    in a new or empty folder; resuming a checkpoint of the folder continues its run (the
    same settings and lineage); resuming a checkpoint of another folder starts a run in a
    new or empty one, which records the checkpoint as its lineage. Another run's folder,
    other files, or a folder another live process writes are refused in one line, before
    anything there is written."""
    inputs = _inputs_of(family, config)  # the settings first, then the folder
    start = _start_of(family, config)
    # A setting refused while the run is set up (fsdp needs accelerate's process state) is
    # refused inside the claim, before anything but run.json is written: the claim then
    # removes its run.json and the folders it created (gradest_lab.storage.run_folder).
    with _claimed(config, start):
        return _train(family, _Run(family, config, start, inputs))


def _train(family: str, run: _Run) -> _Run:
    """The loop of :func:`train`, in the claimed folder."""
    config = run.config
    done = run.start.done
    if run.step == config.steps and (done is None or done.step != run.step):
        # Killed after its last checkpoint but before the export: finish the export only.
        run.finish()
        if run.accelerator.is_main_process:
            _write_done(run)
            print(
                f"{family}: the run was already at step {run.step}; exported its LoRA "
                f"weights to {run.out / 'lora' / LORA_FILE}"
            )
        return run
    if run.step >= config.steps:
        raise InvalidValue(
            f"setting steps={config.steps} is invalid: the resumed run is already at step "
            f"{run.step}; pass a larger --steps to continue it"
        )
    main_process = run.accelerator.is_main_process
    # On the main process only; tqdm hides itself when stderr is not a terminal (logs, CI).
    progress = tqdm(
        total=config.steps,
        initial=run.step,
        desc=f"{family} {config.objective} fine-tuning",
        unit="step",
        disable=None if main_process else True,
    )
    if run.step == 0 and evaluates_at(config, 0, last=False):
        # The model before training (Flow-GRPO's epoch 0): a record of step 0 of its own.
        run.record({"step": 0, **run.evaluate()})
    with progress:
        while run.step < config.steps:
            values = run.train_step()
            progress.update(1)
            progress.set_postfix(reward=f"{values['reward']:.4g}", refresh=False)
            last = run.step == config.steps
            evaluated = evaluates_at(config, run.step, last=last)
            if evaluated:  # before the checkpoint: a resumed run has its record
                values = {**values, **run.evaluate()}
            if run.step % config.log_every == 0 or last or evaluated:
                run.record(values)
            if last or (config.sample_every and run.step % config.sample_every == 0):
                run.sample_grid()
            if last or (config.save_every and run.step % config.save_every == 0):
                run.checkpoint()
    run.finish()
    if main_process:
        _write_done(run)
        print(
            f"{family}: {run.step} steps done, last reward {values['reward']:.4g}; "
            f"LoRA weights {run.out / 'lora' / LORA_FILE}, log {run.out / LOG_FILE}"
        )
    return run
