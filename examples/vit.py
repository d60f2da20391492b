"""A small vision transformer with neighborhood attention, in pure JAX (no flax, no optax).

The image ``[B, image, image, channels]`` is cut into ``patch x patch`` patches,
each embedded linearly: a ``grid x grid`` token grid (``grid = image // patch``),
plus a learned position embedding per grid cell. Every block is the GPT
example's pre-norm block (:func:`examples.gpt_jax._block`: RMSNorm, attention,
RMSNorm, GELU MLP) on tokens ``[B, grid, grid, W]``; its attention is
:func:`splat.neighborhood_attention` over a ``kernel x kernel`` neighborhood
(NATTEN semantics: windows shifted inside at the borders, so every token sees
``kernel**2`` keys), with ``dilation`` on the layers in ``dilated_layers``
(keys ``dilation`` apart: a wider view for the same work). A final RMSNorm, the
mean over the grid and a linear head give the class logits.

Attention modes (``attention=``): ``"splat"`` (splat's kernels: Triton on a
CUDA GPU, pure JAX elsewhere, as every example picks with ``backend="auto"``) and
``"dense"`` (``jax.nn.dot_product_attention`` with the layer's neighborhood as a
dense ``[1, 1, S, S]`` mask on the flattened tokens, XLA): the same maths, the
check of the first.

The task (:func:`make_images`), which needs attention between neighbouring
patches: the image holds ``classes`` square blocks of ``block x block`` patches,
one per colour of a fixed palette, on dark noise, each at a random place in its
own cell of ``(block + 1) x (block + 1)`` patches. The centre patch of every
block is replaced by a texture, a checkerboard, and one block's checkerboard is
the inverted one -- the *marker*. The label is the colour of the marked block.
Every block shows ``block**2 - 1`` patches of its colour and one texture, so a
model that pools per-patch features sees the same colours in every image: only
a token that relates the marker to the colours around it (the marker attending
to its neighborhood) finds the label. Chance is ``log(classes)`` of loss; a
model whose tokens see only themselves (``kernel=1``) stays there
(``tests/test_examples.py`` checks both).

Usage:
  python -m examples.vit                      # 64 x 64 images, a 16 x 16 grid, kernel 7, blocks of 7
  python -m examples.vit --image 16 --patch 2 --kernel 3 --block 3 --layers 2 --width 32 --heads 2

Example:
  >>> from examples import vit
  >>> cfg = vit.ViTConfig(image=16, patch=2, block=3, layers=2, width=32, heads=2, kernel=3)
  >>> params = vit.init_params(cfg, seed=0)
  >>> images, labels = vit.make_images(cfg, np.random.default_rng(0), 2)
  >>> images.shape, vit.forward(params, images, cfg).shape
  ((2, 16, 16, 3), (2, 4))
"""

from __future__ import annotations

import argparse
import colorsys
import functools
import json
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import splat
from examples.gpt_jax import _block, _linear, _rms_norm, adam_init, adam_update
from splat import masks

__all__ = [
    "ATTENTION_MODES",
    "ViTConfig",
    "attend",
    "forward",
    "init_params",
    "layer_masks",
    "loss_fn",
    "main",
    "make_images",
    "make_train_step",
    "train",
]

ATTENTION_MODES = ("splat", "dense")


@dataclass(frozen=True)
class ViTConfig:
    """Sizes of the model and its task.

    Attributes:
      image: image side in pixels, a multiple of ``patch``.
      patch: patch side in pixels; the token grid is ``grid x grid``, ``grid = image // patch``.
      channels: image channels (the palette is RGB: 3).
      classes: colours, blocks per image and classes; at most ``(grid // (block + 1)) ** 2`` (a cell each).
      block: side of a coloured block of the task, in patches, odd. With ``block == kernel``
        (both 7 by default) the marker's neighborhood is its block.
      layers, width, heads, mlp_ratio: transformer sizes (``width % heads == 0``).
      kernel: neighborhood side in tokens, every layer.
      dilation: key spacing of the layers in ``dilated_layers`` (``kernel * dilation <= grid``).
      dilated_layers: indices of the dilated layers.
      dtype: compute dtype; parameters stay float32.
    """

    image: int = 64
    patch: int = 4
    channels: int = 3
    classes: int = 4
    block: int = 7
    layers: int = 4
    width: int = 128
    heads: int = 4
    kernel: int = 7
    dilation: int = 2
    dilated_layers: tuple[int, ...] = (1,)
    mlp_ratio: int = 4
    dtype: str = "float32"

    def __post_init__(self):
        for name in (
            "image",
            "patch",
            "classes",
            "layers",
            "width",
            "heads",
            "kernel",
            "dilation",
            "mlp_ratio",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ViTConfig.{name} must be a positive int, got {v!r}")
        if self.channels != 3:
            raise ValueError(f"ViTConfig.channels must be 3 (an RGB palette), got {self.channels!r}")
        if self.image % self.patch:
            raise ValueError(f"ViTConfig.image ({self.image}) must be a multiple of patch ({self.patch})")
        if self.width % self.heads:
            raise ValueError(f"ViTConfig.width ({self.width}) must be a multiple of heads ({self.heads})")
        if self.block % 2 == 0:
            raise ValueError(
                f"ViTConfig.block must be odd (a centre patch holds the texture), got {self.block}"
            )
        cell = self.block + 1
        if self.classes > (self.grid // cell) ** 2:
            raise ValueError(
                f"ViTConfig.classes ({self.classes}) must be <= (grid // (block + 1)) ** 2 = "
                f"{(self.grid // cell) ** 2}: each coloured block needs a {cell}x{cell} cell of the "
                f"{self.grid}x{self.grid} grid"
            )
        if self.kernel * self.dilation > self.grid:
            raise ValueError(
                f"ViTConfig.kernel * dilation ({self.kernel} * {self.dilation}) must be <= grid ({self.grid})"
            )
        bad = [i for i in self.dilated_layers if not (isinstance(i, int) and 0 <= i < self.layers)]
        if bad:
            raise ValueError(
                f"ViTConfig.dilated_layers must be layer indices in [0, {self.layers}), got {bad}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f'ViTConfig.dtype must be "float32", "bfloat16" or "float16", got {self.dtype!r}'
            )

    @property
    def grid(self) -> int:
        """Tokens per side of the token grid."""
        return self.image // self.patch

    def dilation_of(self, layer: int) -> int:
        """The dilation of layer ``layer``: ``dilation`` for the dilated layers, else 1."""
        return self.dilation if layer in self.dilated_layers else 1


def layer_masks(cfg: ViTConfig) -> list[masks.Mask]:
    """The neighborhood of each layer on the flattened ``grid x grid`` tokens (what the model attends)."""
    return [
        masks.neighborhood((cfg.grid, cfg.grid), cfg.kernel, dilation=cfg.dilation_of(i))
        for i in range(cfg.layers)
    ]


# -----------------------------------------------------------------------------
# the task
# -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _palette(classes: int) -> np.ndarray:
    """float32 ``[classes, 3]``: evenly spaced hues, full saturation and value."""
    return np.asarray([colorsys.hsv_to_rgb(c / classes, 1.0, 1.0) for c in range(classes)], np.float32)


def make_images(cfg: ViTConfig, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of the task (module docstring): ``(images float32 [B, image, image, 3], labels int32 [B])``.

    Pixel values: background noise of std 0.05; block patches their palette colour
    plus noise of std 0.05; centre patches a 0/1 checkerboard of pixels (the marker:
    the inverted one), the same in every channel.
    """
    g, p, n, side = cfg.grid, cfg.patch, cfg.classes, cfg.block
    cell = side + 1
    cells = g // cell
    out = (0.05 * rng.standard_normal((batch, g, p, g, p, 3))).astype(np.float32)
    palette = _palette(n)
    checker = (np.add.outer(np.arange(p), np.arange(p)) % 2).astype(np.float32)[:, :, None]  # [p, p, 1]
    labels = rng.integers(0, n, size=batch).astype(np.int32)
    for b in range(batch):
        where = rng.choice(cells * cells, size=n, replace=False)  # colour c's block in cell where[c]
        for c, at in enumerate(where):
            r0 = at // cells * cell + rng.integers(0, 2)
            c0 = at % cells * cell + rng.integers(0, 2)
            out[b, r0 : r0 + side, :, c0 : c0 + side, :] += palette[c]
            texture = 1.0 - checker if c == labels[b] else checker
            out[b, r0 + side // 2, :, c0 + side // 2, :] = texture
    return out.reshape(batch, g * p, g * p, 3), labels


# -----------------------------------------------------------------------------
# the model
# -----------------------------------------------------------------------------


def init_params(cfg: ViTConfig, seed: int = 0) -> dict:
    """Fresh float32 parameters, a plain pytree, drawn with numpy (no compile).

    Shapes (W = width, H = heads, D = W // H, F = mlp_ratio * W, P = patch**2 * 3, G = grid)::

      embed: kernel [P, W], bias [W];  pos [G, G, W];  norm [W];  head: kernel [W, classes], bias [classes]
      blocks[i]: as examples.gpt_jax.init_params (norm1, q, k, v, out, norm2, up, down)

    Kernels are normal with std ``1 / sqrt(fan_in)`` (LeCun, untruncated), biases 0,
    norm scales 1, position embeddings normal with std 0.02.
    """
    if not isinstance(cfg, ViTConfig):
        raise TypeError(f"cfg must be an examples.vit.ViTConfig, got {type(cfg).__name__}")
    rng = np.random.default_rng(seed)
    w, h = cfg.width, cfg.heads
    d, f = w // h, cfg.mlp_ratio * w

    def dense(in_shape, out_shape):
        fan_in = int(np.prod(in_shape))
        kernel = rng.standard_normal((*in_shape, *out_shape), np.float32) / np.sqrt(fan_in)
        return {"kernel": jnp.asarray(kernel), "bias": jnp.zeros(out_shape, jnp.float32)}

    def ones():  # a buffer of its own per leaf: the training step donates them
        return jnp.ones((w,), jnp.float32)

    def block():
        return {
            "norm1": ones(),
            "q": dense((w,), (h, d)),
            "k": dense((w,), (h, d)),
            "v": dense((w,), (h, d)),
            "out": dense((h, d), (w,)),
            "norm2": ones(),
            "up": dense((w,), (f,)),
            "down": dense((f,), (w,)),
        }

    return {
        "embed": dense((cfg.patch * cfg.patch * cfg.channels,), (w,)),
        "pos": jnp.asarray(0.02 * rng.standard_normal((cfg.grid, cfg.grid, w), np.float32)),
        "blocks": [block() for _ in range(cfg.layers)],
        "norm": ones(),
        "head": dense((w,), (cfg.classes,)),
    }


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cfg: ViTConfig, layer: int, attention: str = "splat"):
    """Layer ``layer``'s attention on the token grid: ``q, k, v: [B, G, G, H, D]`` -> ``[B, G, G, H, D]``.

    ``"splat"``: :func:`splat.neighborhood_attention` (``kernel``, the layer's
    dilation); ``"dense"``: ``jax.nn.dot_product_attention`` on the flattened tokens
    with the same neighborhood as a dense mask (:func:`layer_masks`).
    """
    if attention == "splat":
        return splat.neighborhood_attention(q, k, v, cfg.kernel, dilation=cfg.dilation_of(layer))
    if attention != "dense":
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    b, s = q.shape[0], cfg.grid * cfg.grid
    mask = jnp.asarray(layer_masks(cfg)[layer].to_acsr().to_dense())[None, None]
    flat = [x.reshape(b, s, *x.shape[-2:]) for x in (q, k, v)]
    return jax.nn.dot_product_attention(*flat, mask=mask).reshape(q.shape)


def _patches(images: jax.Array, p: int) -> jax.Array:
    """``[B, G*p, G*p, C]`` -> ``[B, G, G, p*p*C]``: each patch's pixels, row-major."""
    b, hh, ww, c = images.shape
    x = images.reshape(b, hh // p, p, ww // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, hh // p, ww // p, p * p * c)


def forward(params: dict, images: jax.Array, cfg: ViTConfig, attention: str = "splat") -> jax.Array:
    """Class logits float32 ``[B, classes]`` of images ``[B, image, image, 3]``."""
    if images.ndim != 4 or images.shape[1:] != (cfg.image, cfg.image, cfg.channels):
        raise ValueError(
            f"images must be [B, {cfg.image}, {cfg.image}, {cfg.channels}], got shape {tuple(images.shape)}"
        )
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    dt = jnp.dtype(cfg.dtype)
    x = _linear(_patches(images, cfg.patch), params["embed"], 1, dt) + params["pos"].astype(dt)
    for i, p in enumerate(params["blocks"]):
        x = _block(x, p, functools.partial(attend, cfg=cfg, layer=i, attention=attention), dt)
    pooled = _rms_norm(x, params["norm"], dt).mean(axis=(1, 2))
    return _linear(pooled, params["head"], 1, dt).astype(jnp.float32)


def loss_fn(params, images, labels, cfg: ViTConfig, attention: str = "splat") -> tuple[jax.Array, jax.Array]:
    """``(mean cross-entropy, accuracy)`` of the class logits on a batch."""
    logits = forward(params, images, cfg, attention)
    label_logit = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    accuracy = (logits.argmax(-1) == labels).mean()
    return (jax.nn.logsumexp(logits, axis=-1) - label_logit).mean(), accuracy


# -----------------------------------------------------------------------------
# training
# -----------------------------------------------------------------------------


def make_train_step(cfg: ViTConfig, attention: str = "splat", *, lr: float = 3e-3):
    """A jitted ``step(params, opt_state, images, labels) -> (params, opt_state, loss, accuracy)``.

    Adam as ``examples.gpt_jax``'s; ``loss`` and ``accuracy`` are the batch's before
    the update. Donates ``params`` and ``opt_state``.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")

    def step(params, opt_state, images, labels):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, accuracy), grads = grad_fn(params, images, labels, cfg, attention)
        params, opt_state = adam_update(params, grads, opt_state, lr)
        return params, opt_state, loss, accuracy

    return jax.jit(step, donate_argnums=(0, 1))


def train(
    cfg: ViTConfig,
    *,
    attention: str = "splat",
    steps: int = 200,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    log_every: int = 25,
    quiet: bool = False,
) -> dict:
    """Trains a fresh model, a fresh batch of the task each step.

    Returns:
      ``{"losses": [float per step], "accuracies": [float per step], "accuracy": float,
      "step_s": float, "images_per_s": float, "params": the trained parameters}``.
      Each step's loss and accuracy are measured on its batch before the update (data
      the model has not seen); ``accuracy`` is the mean of the last 20 steps'. Timings
      exclude the first (compiling) step.
    """
    rng = np.random.default_rng(seed)
    params = init_params(cfg, seed)
    opt_state = adam_init(params)
    step = make_train_step(cfg, attention, lr=lr)
    losses, accuracies, times = [], [], []
    for i in range(steps):
        images, labels = make_images(cfg, rng, batch)
        t0 = time.perf_counter()
        params, opt_state, loss, accuracy = step(params, opt_state, images, labels)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
        accuracies.append(float(accuracy))
        if not quiet and (i % log_every == 0 or i == steps - 1):
            print(
                f"[{attention}] step {i:4d}  loss {losses[-1]:.4f}  accuracy {accuracies[-1]:.2f}", flush=True
            )
    step_s = float(np.median(times[1:] or times))
    return {
        "losses": losses,
        "accuracies": accuracies,
        "accuracy": float(np.mean(accuracies[-20:])),
        "step_s": step_s,
        "images_per_s": batch / step_s,
        "params": params,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", choices=ATTENTION_MODES, default="splat")
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--patch", type=int, default=4)
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--block", type=int, default=7, help="side of the task's coloured blocks, in patches")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kernel", type=int, default=7)
    ap.add_argument("--dilation", type=int, default=2)
    ap.add_argument("--dilated-layers", type=int, nargs="*", default=[1], help="dilated layers (indices)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    a = ap.parse_args(argv)
    cfg = ViTConfig(
        image=a.image,
        patch=a.patch,
        classes=a.classes,
        block=a.block,
        layers=a.layers,
        width=a.width,
        heads=a.heads,
        kernel=a.kernel,
        dilation=a.dilation,
        dilated_layers=tuple(a.dilated_layers),
        dtype=a.dtype,
    )
    res = train(cfg, attention=a.attention, steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed)
    summary = {
        "model": "vit",
        "attention": a.attention,
        "grid": [cfg.grid, cfg.grid],
        "first_loss": res["losses"][0],
        "final_loss": res["losses"][-1],
        "chance_loss": float(np.log(cfg.classes)),
        "accuracy": res["accuracy"],
        "step_s": res["step_s"],
        "images_per_s": res["images_per_s"],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
