"""Every size argument of ``gradest.integrations.pipelines`` is checked at the boundary.

Issue 45, item 5. A size or a count (``num_inference_steps``, ``num_images_per_prompt``,
``height``, ``width``, ``max_sequence_length``; the latent helpers' ``height``, ``width``,
``rows``, ``image_seq_len`` and the latents' shape) is checked by one rule before any
model call or allocation:

* **type**: an ``int`` (numpy / torch integer scalars too, as everywhere in gradest); a
  bool, a float (``2.5`` and ``16.0``), a string is :class:`~gradest.errors.InvalidType`;
* **bounds**: ``>= 1`` and within int64, and below what it would allocate (the schedule,
  the initial latents, the prompt embeddings against the device's memory), what the
  scheduler takes (DDIM: ``num_train_timesteps``) and what the tokenizer takes (T5:
  512 tokens): :class:`~gradest.errors.InvalidValue`;
* **shape**: Flux's packing needs even latent sides.

Each refusal is one line naming the argument and the value. "Before any model call" is
checked by making the pipeline's ``encode_prompt`` (its first model call) fail the test;
"before any allocation" by sizes whose allocation would need terabytes (``10**12``):
they must be refused as a ``GradestError``, never torch's or numpy's ``MemoryError`` /
``RuntimeError``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from gradest.errors import InvalidType, InvalidValue  # noqa: E402
from gradest.integrations.pipelines import (  # noqa: E402
    dynamic_shift_mu,
    flux_image_ids,
    from_pipeline,
    pack_latents,
    sdxl_time_ids,
    unpack_latents,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:There are modules in .* that should be kept in float32"),
]

try:
    from tiny_pipelines import tiny_flux_pipeline, tiny_sd3_pipeline, tiny_sdxl_pipeline
except TypeError:  # pragma: no cover - transformers < 5 reads tokenizer files
    pytest.skip("needs transformers >= 5 to build tokenizers in memory", allow_module_level=True)

PROMPTS = ["a red cat", "blue sky"]
SIDE = 16  # pixels: a multiple of every tiny pipeline's VAE x denoiser downsampling (4)
TERA = 10**12  # a size whose tensors would need terabytes
BUILD = {"sd3": tiny_sd3_pipeline, "flux": tiny_flux_pipeline, "sdxl": tiny_sdxl_pipeline}


@pytest.fixture(scope="module")
def pipes() -> dict:
    """One tiny pipeline per family, shared by the module (building them takes seconds)."""
    return {family: build() for family, build in BUILD.items()}


@pytest.fixture
def guarded(pipes, monkeypatch) -> dict:
    """The pipelines with ``encode_prompt`` (the first model call) failing the test: a
    refusal must come before it."""

    def no_model_call(*args, **kwargs):
        raise AssertionError("encode_prompt was called before the sizes were checked")

    for pipe in pipes.values():
        monkeypatch.setattr(pipe, "encode_prompt", no_model_call)
    return pipes


def _one_line(caught: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(caught.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# -- from_pipeline ------------------------------------------------------------------------------

# Values that are not a whole number: refused as a type, whatever the argument.
NOT_INTS = [2.5, 16.0, True, False, "4", np.float64(4.0), None]
# Whole numbers below the bounds every size has.
TOO_SMALL = [0, -3]
SIZES = ["num_inference_steps", "num_images_per_prompt", "height", "width"]


def _call(pipe, **options):
    options = {"num_inference_steps": 2, "height": SIDE, "width": SIDE, **options}
    return from_pipeline(pipe, PROMPTS, **options)


# None is the default of every size but num_images_per_prompt (the pipeline's own).
NOT_INT_SIZES = [
    (name, value)
    for name in SIZES
    for value in NOT_INTS
    if value is not None or name == "num_images_per_prompt"
]


@pytest.mark.parametrize("family", list(BUILD))
@pytest.mark.parametrize(("name", "value"), NOT_INT_SIZES, ids=repr)
def test_a_size_that_is_not_an_int_is_a_type_error(guarded, family, name, value):
    with pytest.raises(InvalidType) as caught:
        _call(guarded[family], **{name: value})
    _one_line(caught, f"{name}={value!r}", "int")


@pytest.mark.parametrize("family", list(BUILD))
@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize("value", TOO_SMALL)
def test_a_size_below_one_is_refused(guarded, family, name, value):
    with pytest.raises(InvalidValue) as caught:
        _call(guarded[family], **{name: value})
    _one_line(caught, f"{name}={value!r}", ">= 1")


@pytest.mark.parametrize("family", list(BUILD))
@pytest.mark.parametrize("name", SIZES)
def test_a_size_beyond_int64_is_refused(guarded, family, name):
    with pytest.raises(InvalidValue) as caught:
        _call(guarded[family], **{name: 2**64})
    _one_line(caught, f"{name}={2**64!r}", "2**63 - 1")


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("name", ["num_inference_steps", "num_images_per_prompt", "height"])
def test_a_size_whose_tensors_cannot_fit_is_refused_before_allocating(guarded, family, name):
    # 10**12 steps: a schedule of terabytes; 10**12 images: latents and embeddings of
    # terabytes; a 10**12-pixel side: latents of terabytes. Refused naming the argument,
    # with the largest value that fits, not torch's / numpy's allocation error.
    with pytest.raises(InvalidValue) as caught:
        _call(guarded[family], **{name: TERA})
    _one_line(caught, f"{name}={TERA!r}", "would allocate", "memory", "use ")


def test_ddim_steps_beyond_the_training_timesteps_are_refused(guarded):
    # DDIMScheduler.set_timesteps refuses more steps than num_train_timesteps: named here,
    # before the prompts are encoded.
    pipe = guarded["sdxl"]
    train = pipe.scheduler.config.num_train_timesteps
    with pytest.raises(InvalidValue) as caught:
        _call(pipe, num_inference_steps=train + 1)
    _one_line(caught, f"num_inference_steps={train + 1}", f"num_train_timesteps={train}",
              f"num_inference_steps <= {train}")  # fmt: skip
    with pytest.raises(InvalidValue) as caught:
        _call(pipe, num_inference_steps=TERA)
    _one_line(caught, f"num_inference_steps={TERA}")


# -- max_sequence_length (T5: SD3 and Flux) -----------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("value", [v for v in NOT_INTS if v is not None], ids=repr)
def test_max_sequence_length_that_is_not_an_int_is_a_type_error(guarded, family, value):
    with pytest.raises(InvalidType) as caught:
        _call(guarded[family], max_sequence_length=value)
    _one_line(caught, f"max_sequence_length={value!r}", "int")


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("value", [0, -3])
def test_max_sequence_length_below_one_is_refused(guarded, family, value):
    # 0 used to reach the tokenizer and fail later blaming the negative prompt; -3 was
    # the tokenizer's OverflowError.
    with pytest.raises(InvalidValue) as caught:
        _call(guarded[family], max_sequence_length=value)
    _one_line(caught, f"max_sequence_length={value!r}", ">= 1")


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("value", [513, 10**6, TERA, 2**64])
def test_max_sequence_length_beyond_the_tokenizer_is_refused(guarded, family, value):
    # The T5 tokenizer's model_max_length (512 here, as the real ones) and the
    # pipelines' own limit (diffusers' check_inputs takes at most 512).
    with pytest.raises(InvalidValue) as caught:
        _call(guarded[family], max_sequence_length=value)
    _one_line(caught, f"max_sequence_length={value!r}")
    if value <= 2**63 - 1:
        _one_line(caught, "512", "max_sequence_length <= 512")


def test_max_sequence_length_names_a_shorter_tokenizer_limit(pipes, monkeypatch):
    pipe = pipes["flux"]
    monkeypatch.setattr(pipe.tokenizer_2, "model_max_length", 64)
    monkeypatch.setattr(pipe, "encode_prompt", None)  # not reached
    with pytest.raises(InvalidValue) as caught:
        _call(pipe, max_sequence_length=65)
    _one_line(caught, "max_sequence_length=65", "model_max_length=64",
              "max_sequence_length <= 64")  # fmt: skip


# -- what is accepted -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "flux", "sdxl"])
def test_numpy_and_torch_integers_are_sizes(pipes, family):
    # gradest takes numbers of any kind wherever a number is (docs/errors.md, "Types"):
    # the result is the one of plain ints, with plain ints in it.
    pipe = pipes[family]
    tokens: dict[str, Any] = {} if family == "sdxl" else {"max_sequence_length": 8}
    plain = from_pipeline(pipe, PROMPTS, num_inference_steps=2, height=SIDE, width=SIDE,
                          num_images_per_prompt=2, **tokens)  # fmt: skip
    # Typed as Any: the signature says int, and these are what it takes as ints.
    scalar_sizes: dict[str, Any] = {
        "num_inference_steps": np.int64(2), "height": np.int32(SIDE),
        "width": torch.tensor(SIDE), "num_images_per_prompt": np.array(2),
        **{k: np.int64(v) for k, v in tokens.items()},
    }  # fmt: skip
    scalars = from_pipeline(pipe, PROMPTS, **scalar_sizes)
    assert scalars.latent_shape == plain.latent_shape
    assert type(scalars.height) is int and type(scalars.width) is int
    assert all(type(n) is int for n in scalars.latent_shape)
    assert torch.equal(scalars.sampler.times, plain.sampler.times)
    assert scalars.cond["encoder_hidden_states"].shape == plain.cond["encoder_hidden_states"].shape


def test_the_largest_t5_length_is_accepted(pipes):
    parts = from_pipeline(pipes["flux"], PROMPTS[:1], num_inference_steps=1, height=SIDE,
                          width=SIDE, max_sequence_length=512)  # fmt: skip
    assert parts.cond["encoder_hidden_states"].shape[1] == 512


# -- the latent helpers -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 4, 5, 6), (1, 4, 6, 5), (2, 4, 3, 3)])
def test_pack_latents_needs_even_sides(shape):
    # An odd latent side used to be a raw RuntimeError from view().
    with pytest.raises(InvalidValue) as caught:
        pack_latents(torch.zeros(shape))
    _one_line(caught, f"latents has shape {shape}", "even", "2 x vae_scale_factor")


@pytest.mark.parametrize("shape", [(4, 6, 6), (1, 1, 4, 6, 6), (0, 4, 6, 6), (1, 4, 0, 6)])
def test_pack_latents_needs_b_c_h_w_latents(shape):
    with pytest.raises(InvalidValue) as caught:
        pack_latents(torch.zeros(shape))
    _one_line(caught, f"latents has shape {shape}", "[B, C, H, W]")


def test_pack_latents_needs_a_tensor():
    with pytest.raises(InvalidType) as caught:
        pack_latents(np.zeros((1, 4, 6, 6)))  # type: ignore[arg-type]
    _one_line(caught, "latents", "ndarray", "torch.Tensor")


# (function, the size arguments it takes, keyword arguments that are valid)
HELPERS = {
    "unpack_latents": (
        lambda **kw: unpack_latents(torch.zeros(2, 12, 16), **kw),
        {"height": 8, "width": 6},
    ),
    "flux_image_ids": (lambda **kw: flux_image_ids(**kw), {"height": 8, "width": 6}),
    "sdxl_time_ids": (lambda **kw: sdxl_time_ids(**kw), {"height": 64, "width": 32, "rows": 3}),
    "dynamic_shift_mu": (
        lambda **kw: dynamic_shift_mu(diffusers.FlowMatchEulerDiscreteScheduler(), **kw),
        {"image_seq_len": 1024},
    ),
}
HELPER_SIZES = [(helper, name) for helper, (_, valid) in HELPERS.items() for name in valid]


@pytest.mark.parametrize(("helper", "name"), HELPER_SIZES)
@pytest.mark.parametrize("value", [2.5, 8.0, True, "8", None], ids=repr)
def test_helper_sizes_that_are_not_ints_are_type_errors(helper, name, value):
    call, valid = HELPERS[helper]
    with pytest.raises(InvalidType) as caught:
        call(**{**valid, name: value})
    _one_line(caught, f"{name}={value!r}", "int")


@pytest.mark.parametrize(("helper", "name"), HELPER_SIZES)
@pytest.mark.parametrize("value", [0, -2, 2**64])
def test_helper_sizes_out_of_bounds_are_refused(helper, name, value):
    call, valid = HELPERS[helper]
    with pytest.raises(InvalidValue) as caught:
        call(**{**valid, name: value})
    _one_line(caught, f"{name}={value!r}")


@pytest.mark.parametrize(("helper", "name"), HELPER_SIZES)
def test_helper_sizes_take_numpy_integers(helper, name):
    call, valid = HELPERS[helper]
    plain = call(**valid)
    scalar = call(**{**valid, name: np.int64(valid[name])})
    if isinstance(plain, torch.Tensor) and isinstance(scalar, torch.Tensor):
        assert torch.equal(scalar, plain)
    else:
        assert scalar == plain


@pytest.mark.parametrize(("helper", "name"), [("flux_image_ids", "height"),
                                              ("flux_image_ids", "width"),
                                              ("sdxl_time_ids", "rows")])  # fmt: skip
def test_helper_sizes_that_cannot_fit_are_refused_before_allocating(helper, name):
    call, valid = HELPERS[helper]
    value = 2**62  # within int64 (and even): refused by what it would allocate
    with pytest.raises(InvalidValue) as caught:
        call(**{**valid, name: value})
    _one_line(caught, f"{name}={value!r}", "would allocate", "memory")


@pytest.mark.parametrize("name", ["height", "width"])
def test_packed_latent_sides_must_be_even(name):
    # Flux's ids and unpacking are for packed latents (2 x 2 patches): an odd side used
    # to be floored silently (ids) or a raw view() error (unpack).
    for helper in ("flux_image_ids", "unpack_latents"):
        call, valid = HELPERS[helper]
        with pytest.raises(InvalidValue) as caught:
            call(**{**valid, name: 7})
        _one_line(caught, f"{name}=7", "even", "2 x vae_scale_factor")


def test_unpack_latents_names_a_packed_shape_that_does_not_match():
    with pytest.raises(InvalidValue) as caught:
        unpack_latents(torch.zeros(2, 12, 16), 8, 8)
    _one_line(caught, "packed has shape (2, 12, 16)", "height=8", "width=8", "16")
    with pytest.raises(InvalidValue) as caught:
        unpack_latents(torch.zeros(2, 12, 6), 8, 6)
    _one_line(caught, "packed has shape (2, 12, 6)", "4")
    with pytest.raises(InvalidType) as not_a_tensor:
        unpack_latents([[0.0]], 8, 6)  # type: ignore[arg-type]
    _one_line(not_a_tensor, "packed", "list", "torch.Tensor")


def test_the_helpers_still_do_what_the_pipeline_does():
    # Validation changes nothing for valid input (FluxPipeline's own packing and ids).
    latents = torch.randn(2, 4, 8, 6)
    packed = pack_latents(latents)
    assert torch.equal(packed, diffusers.FluxPipeline._pack_latents(latents, 2, 4, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), latents)
    ids = diffusers.FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    assert torch.equal(flux_image_ids(8, 6), ids)


# -- sampler_from_scheduler called directly: the same rule for its steps ---------------------


@pytest.mark.parametrize("kind", ["flow", "ddim"])
def test_sampler_from_scheduler_takes_integer_steps_of_any_kind_and_bounds_them(kind):
    from gradest.integrations.diffusers import sampler_from_scheduler

    scheduler = (
        diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
        if kind == "flow"
        else diffusers.DDIMScheduler(clip_sample=False)
    )
    plain = sampler_from_scheduler(scheduler, 8)
    for same in (np.int64(8), torch.tensor(8)):
        torch.testing.assert_close(sampler_from_scheduler(scheduler, same).times, plain.times)
    for bad, error, fragment in [
        (2.5, InvalidType, "num_inference_steps=2.5 (a float)"),
        (True, InvalidType, "num_inference_steps=True"),
        (0, InvalidValue, "num_inference_steps=0"),
        (
            TERA,
            InvalidValue,
            f"num_inference_steps={TERA} would allocate"
            if kind == "flow"
            else "more than the scheduler's num_train_timesteps=1000",
        ),
    ]:
        with pytest.raises(error) as caught:
            sampler_from_scheduler(scheduler, bad)
        message = str(caught.value)
        assert "\n" not in message and fragment in message, message
    if kind == "ddim":
        with pytest.raises(InvalidValue, match="num_train_timesteps=1000"):
            sampler_from_scheduler(scheduler, 1001)
