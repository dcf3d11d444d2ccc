"""An adaLN-Zero diffusion transformer (DiT, Peebles & Xie 2023) as a flow velocity model.

``v = DiT(x, t, y)`` maps images ``x [B, C, H, W]``, flow times ``t [B]`` in ``[0, 1]``
and optional class labels ``y [B]`` to a velocity of the same shape as ``x``
(``learn_sigma=False``: a flow model predicts one field, not a mean and a variance).

Architecture, as in the paper: a patch embedding (``Conv2d`` with kernel = stride =
patch), a fixed 2-D sin-cos position embedding (a buffer, not a parameter), a sinusoidal
timestep embedder, an optional class embedding whose extra row ``num_classes`` is the
null (unconditional) label, ``depth`` transformer blocks whose LayerNorms are modulated
by ``c = t_emb + y_emb`` (shift, scale and a residual gate for attention and for the
MLP), and a modulated final linear layer followed by un-patchify.

adaLN-Zero: every modulation layer and the final linear layer start at zero, so at
initialisation each block is the identity map (its gates are zero) and the model outputs
exactly zero. Training then grows the residual branches from zero, which is what makes
deep DiTs train stably.

The forward pass is written for ``torch.func``: no in-place updates, no Python control
flow on tensor values, no randomness (no classifier-free-guidance label dropout; pass
the null label ``num_classes`` explicitly to train or sample unconditionally).

Named configurations are in :data:`DIT_CONFIGS`; :func:`dit_parameter_count` counts
parameters analytically, so the 300M-parameter configurations can be sized without
allocating them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradest.errors import InvalidType, InvalidValue
from gradest.models.embeddings import TimestepEmbedder

ATTENTION_KERNELS = ("sdpa", "math")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise InvalidValue(f"DiT option {attribute.name} must be positive, got {value!r}")


@attrs.frozen
class DiTConfig:
    """Shape of a :class:`DiT`; validated at construction.

    Attributes:
        input_size: height and width of the (square) input in pixels / latent cells.
        in_channels: channels of the input.
        patch_size: side of a square patch; must divide ``input_size``.
        hidden: token width; must be divisible by ``heads``.
        depth: number of transformer blocks.
        heads: attention heads per block.
        mlp_ratio: MLP hidden width as a multiple of ``hidden``.
        num_classes: number of class labels, or None for an unconditional model. The
            class embedding has ``num_classes + 1`` rows; label ``num_classes`` is null.
        frequency_dim: number of sinusoidal time features fed to the timestep MLP
            (256 in the paper; smaller for tiny models, where it dominates the count).
        out_channels: channels of the output; None means ``in_channels`` (a velocity
            has the shape of the state).
        attention: ``"sdpa"`` (``F.scaled_dot_product_attention``: fused kernels where
            available, the default) or ``"math"`` (explicit ``softmax(q k^T / sqrt(d)) v``).
            Both compute the same function; ``"math"`` is several times faster under
            ``jacrev``/``vmap`` on CPU, where SDPA's fused CPU backward has no batching
            rule and falls back to a per-sample loop (dense reference Jacobians).
    """

    input_size: int = attrs.field(validator=_positive)
    in_channels: int = attrs.field(validator=_positive)
    patch_size: int = attrs.field(validator=_positive)
    hidden: int = attrs.field(validator=_positive)
    depth: int = attrs.field(validator=_positive)
    heads: int = attrs.field(validator=_positive)
    mlp_ratio: float = attrs.field(default=4.0, validator=_positive)
    num_classes: int | None = attrs.field(default=None, validator=_positive)
    frequency_dim: int = attrs.field(default=256, validator=_positive)
    out_channels: int | None = attrs.field(default=None, validator=_positive)
    attention: str = attrs.field(default="sdpa")

    @attention.validator
    def _check_attention(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in ATTENTION_KERNELS:
            raise InvalidValue(
                f"DiT option attention={value!r} is not one of {', '.join(ATTENTION_KERNELS)}"
            )

    def __attrs_post_init__(self) -> None:
        if self.input_size % self.patch_size:
            raise InvalidValue(
                f"DiT patch_size={self.patch_size} must divide input_size={self.input_size}; "
                f"choose a divisor of {self.input_size} (or pad the input)"
            )
        if self.hidden % self.heads:
            raise InvalidValue(
                f"DiT hidden={self.hidden} must be divisible by heads={self.heads}; "
                f"e.g. heads={max(d for d in range(1, self.heads) if self.hidden % d == 0)}"
            )
        if self.hidden % 4:
            # Half the channels encode rows, half columns, each as sin and cos pairs.
            raise InvalidValue(
                f"DiT hidden={self.hidden} must be divisible by 4 (2-D sin-cos position "
                f"embedding); e.g. hidden={4 * math.ceil(self.hidden / 4)}"
            )

    @property
    def output_channels(self) -> int:
        return self.in_channels if self.out_channels is None else self.out_channels

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def num_patches(self) -> int:
        return (self.input_size // self.patch_size) ** 2


# Paper configurations (S/B/L) are for 256x256 images as 32x32x4 latents, patch 2,
# 1000 ImageNet classes; their counts (33M / 130M / 458M) are checked in tests/test_dit.py.
# "gpu300m" is DiT-L's width with 16 instead of 24 blocks: about 307M parameters.
# "digits" fits 28x28x1 MNIST (49 tokens of 4x4 patches); for the 8x8 sklearn digits use
# DiT.from_config("digits", input_size=8, patch_size=2), which changes the count only by
# the patch embedding and the final layer.
DIT_CONFIGS: dict[str, DiTConfig] = {
    # For dense-Jacobian tests: explicit attention keeps jacrev fast on CPU.
    "micro": DiTConfig(
        input_size=4,
        in_channels=1,
        patch_size=2,
        hidden=8,
        depth=2,
        heads=2,
        mlp_ratio=2.0,
        num_classes=3,
        frequency_dim=8,
        attention="math",
    ),
    "tiny": DiTConfig(
        input_size=8,
        in_channels=1,
        patch_size=2,
        hidden=32,
        depth=2,
        heads=2,
        num_classes=10,
        frequency_dim=32,
    ),
    "digits": DiTConfig(
        input_size=28,
        in_channels=1,
        patch_size=4,
        hidden=128,
        depth=3,
        heads=4,
        num_classes=10,
        frequency_dim=128,
    ),
    "S": DiTConfig(
        input_size=32,
        in_channels=4,
        patch_size=2,
        hidden=384,
        depth=12,
        heads=6,
        num_classes=1000,
    ),
    "B": DiTConfig(
        input_size=32,
        in_channels=4,
        patch_size=2,
        hidden=768,
        depth=12,
        heads=12,
        num_classes=1000,
    ),
    "L": DiTConfig(
        input_size=32,
        in_channels=4,
        patch_size=2,
        hidden=1024,
        depth=24,
        heads=16,
        num_classes=1000,
    ),
    "gpu300m": DiTConfig(
        input_size=32,
        in_channels=4,
        patch_size=2,
        hidden=1024,
        depth=16,
        heads=16,
        num_classes=1000,
    ),
}


def resolve_config(config: str | DiTConfig | Mapping[str, Any], **overrides: Any) -> DiTConfig:
    """A :class:`DiTConfig` from a name in :data:`DIT_CONFIGS`, a config, or a dict of fields.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        TypeError: an override that is not a :class:`DiTConfig` field.
    """
    if isinstance(config, str):
        if config not in DIT_CONFIGS:
            raise InvalidValue(
                f"unknown DiT config {config!r}; valid names: {', '.join(DIT_CONFIGS)}"
            )
        base = DIT_CONFIGS[config]
    elif isinstance(config, DiTConfig):
        base = config
    elif isinstance(config, Mapping):
        _check_fields(config)
        return DiTConfig(**{**config, **overrides})
    else:
        raise InvalidType(
            f"config must be a name ({', '.join(DIT_CONFIGS)}), a DiTConfig or a dict, "
            f"got {type(config).__name__}"
        )
    _check_fields(overrides)
    return attrs.evolve(base, **overrides)


def _check_fields(values: Mapping[str, Any]) -> None:
    valid = [field.name for field in attrs.fields(DiTConfig)]
    unknown = [key for key in values if key not in valid]
    if unknown:
        raise InvalidType(f"unknown DiT option(s) {unknown}; valid options: {', '.join(valid)}")


def dit_parameter_count(config: str | DiTConfig | Mapping[str, Any], **overrides: Any) -> int:
    """Trainable parameters of a :class:`DiT` with this config, without building it.

    Counts exactly the modules :class:`DiT` creates (the position embedding is a buffer
    and not counted), so it can size configurations too large to allocate here.
    """
    c = resolve_config(config, **overrides)
    h, m, p = c.hidden, c.mlp_hidden, c.patch_size

    def linear(fan_in: int, fan_out: int) -> int:
        return fan_in * fan_out + fan_out

    patch_embed = c.in_channels * p * p * h + h
    time_embed = linear(c.frequency_dim, h) + linear(h, h)
    class_embed = 0 if c.num_classes is None else (c.num_classes + 1) * h
    block = (
        linear(h, 3 * h)  # qkv
        + linear(h, h)  # attention output projection
        + linear(h, m)
        + linear(m, h)  # MLP
        + linear(h, 6 * h)  # adaLN: shift/scale/gate for attention and MLP
    )
    final = linear(h, 2 * h) + linear(h, p * p * c.output_channels)
    return patch_embed + time_embed + class_embed + c.depth * block + final


def sincos_position_embedding(hidden: int, grid_size: int) -> Tensor:
    """Fixed 2-D sin-cos position embedding ``[grid_size**2, hidden]`` (MAE / DiT).

    Half the channels encode the row, half the column, each as 1-D sin/cos features with
    geometrically spaced frequencies; tokens are in row-major order, as produced by
    flattening the patch grid.
    """
    if hidden % 4:
        raise InvalidValue(
            f"DiT hidden={hidden} must be divisible by 4 for the 2-D sin-cos embedding"
        )
    coords = torch.arange(grid_size, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")

    def one_axis(positions: Tensor) -> Tensor:
        quarter = hidden // 4
        omega = 1.0 / 10_000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
        angles = positions.reshape(-1)[:, None] * omega[None, :]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    # The reference implementation embeds the column coordinate first.
    return torch.cat([one_axis(cols), one_axis(rows)], dim=1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: ``x * (1 + scale) + shift`` with per-sample ``shift, scale [B, hidden]``."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


def math_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``softmax(q k^T / sqrt(head_dim)) v`` from plain ops (every op has a vmap rule)."""
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


class Attention(nn.Module):
    """Multi-head self-attention; ``kernel`` is ``"sdpa"`` or ``"math"`` (same function).

    SDPA picks a fused kernel where one exists (flash / memory-efficient on CUDA, a
    flash kernel on CPU, float64 included) and works under ``torch.func.vjp`` and the
    ``vmap`` inside ``jacrev``; the explicit ``"math"`` form is for the latter on CPU,
    where it avoids a slow per-sample fallback.
    """

    def __init__(self, hidden: int, heads: int, kernel: str = "sdpa"):
        super().__init__()
        self.heads = heads
        self.kernel = kernel
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, hidden = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        if self.kernel == "math":
            out = math_attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class DiTBlock(nn.Module):
    """Pre-norm transformer block with adaLN-Zero conditioning on ``c [B, hidden]``.

    ``x + gate * branch(modulate(norm(x), shift, scale))`` for attention and for the MLP;
    the six vectors come from one ``SiLU -> Linear(hidden, 6 * hidden)`` of ``c``, which
    starts at zero so every gate is zero and the block is the identity at init.
    """

    def __init__(self, hidden: int, heads: int, mlp_hidden: int, attention: str = "sdpa"):
        super().__init__()
        # No affine parameters: adaLN's shift and scale take their place.
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads, attention)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp_hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_hidden, hidden),
        )
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)
        x = x + gate_msa[:, None, :] * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp[:, None, :] * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """Modulated LayerNorm and a linear map from tokens to ``patch**2 * out_channels``."""

    def __init__(self, hidden: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """adaLN-Zero diffusion transformer predicting a flow velocity ``v(x, t, y)``.

    Build by name with :meth:`from_config` (``DiT.from_config("tiny")``, see
    :data:`DIT_CONFIGS`) or with keyword arguments (the fields of :class:`DiTConfig`).
    Initialisation follows the paper: Xavier-uniform linear layers with zero biases,
    ``N(0, 0.02)`` label and timestep-MLP weights, and zeros for every adaLN modulation
    layer and the final linear layer, so a fresh model outputs exactly zero.

    Attributes:
        config: the :class:`DiTConfig` this model was built from.
    """

    def __init__(self, **options: Any):
        super().__init__()
        config = resolve_config(dict(options))
        self.config = config
        hidden, patch = config.hidden, config.patch_size
        self.x_embedder = nn.Conv2d(config.in_channels, hidden, kernel_size=patch, stride=patch)
        # Fixed, not learned; a non-persistent buffer is rebuilt from the config, follows
        # .to(dtype/device), and is passed to functional_call as a buffer.
        self.register_buffer(
            "pos_embed",
            sincos_position_embedding(hidden, config.input_size // patch)[None].to(
                torch.get_default_dtype()
            ),
            persistent=False,
        )
        self.t_embedder = TimestepEmbedder(hidden, frequency_dim=config.frequency_dim)
        self.y_embedder = (
            nn.Embedding(config.num_classes + 1, hidden) if config.num_classes is not None else None
        )
        self.blocks = nn.ModuleList(
            DiTBlock(hidden, config.heads, config.mlp_hidden, config.attention)
            for _ in range(config.depth)
        )
        self.final_layer = FinalLayer(hidden, patch, config.output_channels)
        self.initialize_weights()

    @classmethod
    def from_config(cls, name: str, **overrides: Any) -> DiT:
        """The named configuration from :data:`DIT_CONFIGS`, with fields overridden.

        Raises:
            ValueError: ``name`` is not in :data:`DIT_CONFIGS` (the message lists them).
        """
        return cls(**attrs.asdict(resolve_config(name, **overrides)))

    @property
    def num_classes(self) -> int | None:
        return self.config.num_classes

    def initialize_weights(self) -> None:
        """Re-initialise every parameter as in the paper (adaLN-Zero: output zero)."""

        def xavier_linear(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

        self.apply(xavier_linear)
        # The patch embedding is a linear map of flattened patches: Xavier on that view.
        weight = self.x_embedder.weight
        nn.init.xavier_uniform_(weight.data.view(weight.shape[0], -1))
        if self.x_embedder.bias is not None:
            nn.init.zeros_(self.x_embedder.bias)
        if self.y_embedder is not None:
            nn.init.normal_(self.y_embedder.weight, std=0.02)
        for layer in self.t_embedder.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.02)
        # adaLN-Zero: zero gates make every block the identity; a zero final layer
        # makes the output zero.
        zero_layers: list[nn.Module] = [self.final_layer.linear]
        for module in self.modules():
            if isinstance(module, DiTBlock | FinalLayer):
                zero_layers.append(module.adaLN_modulation[-1])
        for layer in zero_layers:
            assert isinstance(layer, nn.Linear)
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def unpatchify(self, tokens: Tensor) -> Tensor:
        """``[B, T, patch**2 * C] -> [B, C, H, W]`` (inverse of the patch embedding's layout)."""
        patch, channels = self.config.patch_size, self.config.output_channels
        grid = self.config.input_size // patch
        x = tokens.reshape(tokens.shape[0], grid, grid, patch, patch, channels)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(tokens.shape[0], channels, grid * patch, grid * patch)

    def condition(self, t: Tensor, y: Tensor | None) -> Tensor:
        """The conditioning vector ``c = t_emb(t) + y_emb(y)``, ``[B, hidden]``.

        ``y=None`` on a class-conditional model means the null label for every sample.
        """
        c = self.t_embedder(t)
        if self.y_embedder is None:
            if y is not None:
                raise InvalidType(
                    "this DiT was built without num_classes, so it takes no labels; "
                    "call model(x, t) or build it with num_classes=..."
                )
            return c
        if y is None:
            null = self.y_embedder.num_embeddings - 1
            y = torch.full(t.shape, null, dtype=torch.long, device=t.device)
        return c + self.y_embedder(y)

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        """Velocity at images ``x [B, C, H, W]``, times ``t [B]``, labels ``y [B]`` or None.

        Label ``num_classes`` (or ``y=None``) is the unconditional (null) class.
        """
        size, channels = self.config.input_size, self.config.in_channels
        if x.ndim != 4 or tuple(x.shape[1:]) != (channels, size, size):
            raise InvalidValue(
                f"DiT expects x of shape [B, {channels}, {size}, {size}], got "
                f"{tuple(x.shape)}; build it with input_size/in_channels matching the data"
            )
        tokens = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.condition(t, y)
        for block in self.blocks:
            tokens = block(tokens, c)
        return self.unpatchify(self.final_layer(tokens, c))
