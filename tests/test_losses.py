"""Distillation losses against hand-computed values."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.losses import (
    cross_entropy,
    decay_weights,
    forward_kl,
    gamma_weights,
    masked_mean,
    per_position_loss,
    reverse_kl,
)

P = np.array([0.5, 0.25, 0.25])
Q = np.array([0.25, 0.5, 0.25])


def _logits(p):
    return jnp.log(jnp.asarray(p, jnp.float32)) + 3.0  # any shift gives the same softmax


def test_forward_kl_by_hand():
    # KL(P || Q) = 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2
    assert float(forward_kl(_logits(Q), _logits(P))) == pytest.approx(0.25 * math.log(2), abs=1e-6)


def test_reverse_kl_by_hand():
    # KL(Q || P) = 0.25 ln 0.5 + 0.5 ln 2 = 0.25 ln 2 (symmetric here by construction); use an asymmetric pair too
    q2, p2 = np.array([0.9, 0.1]), np.array([0.5, 0.5])
    expected = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert float(reverse_kl(_logits(q2), _logits(p2))) == pytest.approx(expected, abs=1e-6)
    assert float(forward_kl(_logits(q2), _logits(p2))) == pytest.approx(
        0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), abs=1e-6)


def test_forward_kl_is_zero_iff_the_distributions_match():
    assert float(forward_kl(_logits(P), _logits(P))) == pytest.approx(0.0, abs=1e-7)
    assert float(forward_kl(_logits(Q), _logits(P))) > 1e-3
    # p with zero mass where q has some: still finite, zero terms dropped
    p0 = jnp.array([0.0, -jnp.inf, 0.0])
    assert np.isfinite(float(forward_kl(_logits(Q), p0)))


def test_cross_entropy_and_sft():
    assert float(cross_entropy(_logits(Q), jnp.array(1))) == pytest.approx(-math.log(0.5), abs=1e-6)
    # SFT takes the target's argmax (token 0 under P) as the label
    assert float(per_position_loss("sft", _logits(Q), _logits(P))) == pytest.approx(-math.log(0.25), abs=1e-6)
    with pytest.raises(ValueError, match="Unknown loss"):
        per_position_loss("l2", _logits(Q), _logits(P))


def test_masks_and_weights():
    values = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = jnp.array([[True, False, True], [False, False, True]])
    assert float(masked_mean(values, mask)) == pytest.approx((1 + 3 + 6) / 3)
    weights = jnp.array([1.0, 0.5, 0.25])
    assert float(masked_mean(values, mask, weights)) == pytest.approx((1 + 0.75 + 1.5) / (1 + 0.25 + 0.25))
    np.testing.assert_allclose(np.asarray(decay_weights(4, 0.8)), [1, 0.8, 0.64, 0.512], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gamma_weights(3, 0.0)), [1, 1, 1])
    g = np.asarray(gamma_weights(3, 0.5))
    assert g[0] == 1 and g[0] > g[1] > g[2]
