"""The digits problems both sides of the K-FAC comparison train: scikit-learn's digits (1,797
images, float32, full batch) and the initial parameters of the tanh MLP 64-128-128-10 and of the
CNN (8×8×1 → conv 3×3 16 → conv 3×3 32, SAME, tanh → dense 10), from a seed. Plain JAX, no
linbackprop: `kfac_jax_digits.py` imports it in kfac-jax's own environment (an older JAX), and
`kfac_rows` builds its Networks on the same data and parameters.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

SIZES = (64, 128, 128, 10)
CNN_CHANNELS = (16, 32)


def digits(images_shape: tuple[int, ...] = (-1, 64)) -> tuple[jax.Array, jax.Array]:
    """The images scaled to [0, 1] (reshaped to ``images_shape``) and their labels."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    return jnp.asarray(images.reshape(images_shape) / 16.0, jnp.float32), jnp.asarray(labels)


def mlp_params(seed: int) -> dict[str, jax.Array]:
    """W{i} ~ N(0, 1/fan-in), b{i} = 0 for the MLP's ``SIZES``."""
    keys = jax.random.split(jax.random.key(seed), len(SIZES) - 1)
    params = {}
    for i, (m, n) in enumerate(itertools.pairwise(SIZES)):
        params[f"W{i}"] = jax.random.normal(keys[i], (m, n), jnp.float32) / jnp.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n, jnp.float32)
    return params


def cnn_params(seed: int) -> dict[str, jax.Array]:
    """The CNN's kernels K1, K2 (HWIO) and head H ~ N(0, 1/fan-in), biases k1, k2, h = 0."""
    keys = jax.random.split(jax.random.key(seed), 3)
    c1, c2 = CNN_CHANNELS
    return {"K1": jax.random.normal(keys[0], (3, 3, 1, c1), jnp.float32) / 3.0, "k1": jnp.zeros(c1, jnp.float32),
            "K2": jax.random.normal(keys[1], (3, 3, c1, c2), jnp.float32) / jnp.sqrt(9.0 * c1),
            "k2": jnp.zeros(c2, jnp.float32),
            "H": jax.random.normal(keys[2], (64 * c2, 10), jnp.float32) / jnp.sqrt(64.0 * c2),
            "h": jnp.zeros(10, jnp.float32)}


def mean_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The mean softmax cross-entropy of integer labels."""
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))
