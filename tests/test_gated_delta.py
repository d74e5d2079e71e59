"""The Gated DeltaNet in tree form (jaxspec.gated_delta) against the token-by-token recurrence: on a chain, and on a
tree where every node must see exactly its own root-to-node path (siblings take different states)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.gated_delta import (
    conv_state_after,
    l2_normalize,
    sequential_gated_delta,
    state_after,
    tree_conv,
    tree_gated_delta,
)
from jaxspec.tree import ancestor_mask

B, H, DK, DV, C, K = 2, 3, 4, 5, 6, 4


def _inputs(t, seed):
    rng = np.random.default_rng(seed)
    q = l2_normalize(jnp.asarray(rng.normal(size=(B, t, H, DK)), jnp.float32)) * DK ** -0.5
    k = l2_normalize(jnp.asarray(rng.normal(size=(B, t, H, DK)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(B, t, H, DV)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.05, 1.5, size=(B, t, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, size=(B, t, H)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(B, H, DK, DV)), jnp.float32)
    return q, k, v, g, beta, state


def _path(parents, node):
    """Verification indices from the root (0) to `node`; parents are the drafted nodes' (node j is index j + 1)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node - 1] + 1
    return [0] + path[::-1]


def test_a_chain_equals_the_recurrence_and_its_final_state():
    t = 7
    q, k, v, g, beta, state = _inputs(t, 0)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (B, t, t))
    out, pending = tree_gated_delta(q, k, v, g, beta, state, causal)
    ref, final = sequential_gated_delta(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    path = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    np.testing.assert_allclose(np.asarray(state_after(state, pending, path, jnp.full((B,), t))), np.asarray(final),
                               atol=1e-5)
    # a prefix of the chain: the state after its last token
    _, after3 = sequential_gated_delta(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], state)
    np.testing.assert_allclose(np.asarray(state_after(state, pending, path, jnp.full((B,), 3))), np.asarray(after3),
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state_after(state, pending, path, jnp.zeros((B,), jnp.int32))),
                                  np.asarray(state))


def test_every_tree_node_sees_only_its_own_path():
    """A tree whose siblings branch at several depths (and a padded node that is nobody's ancestor): each node's
    output equals the recurrence along its root-to-node path, the state after any node equals the recurrence's final
    state there, and each node's conv window is its own path's last K inputs."""
    parents = [-1, -1, 0, 0, 1, 2, -1]  # drafted nodes; the last one a padding leaf under the root
    t = len(parents) + 1  # with the root
    q, k, v, g, beta, state = _inputs(t, 1)
    anc = ancestor_mask(jnp.asarray(np.broadcast_to(parents, (B, len(parents))), jnp.int32))  # [B, T, T]
    out, pending = tree_gated_delta(q, k, v, g, beta, state, anc)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(B, t, C)), jnp.float32)
    conv_state = jnp.asarray(rng.normal(size=(B, K - 1, C)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(C, K)), jnp.float32)
    y, window = tree_conv(x, conv_state, weight, anc)
    pending = pending.__class__(k=pending.k, u=pending.u, log_decay=pending.log_decay, window=window)
    for node in range(t):
        path = _path(parents, node)
        sl = np.asarray(path)
        ref, final = sequential_gated_delta(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state)
        np.testing.assert_allclose(np.asarray(out[:, node]), np.asarray(ref[:, -1]), atol=1e-5, err_msg=str(node))
        padded = jnp.asarray(np.broadcast_to(np.asarray(path + [0] * (t - len(path)), np.int32), (B, t)))
        count = jnp.full((B,), len(path), jnp.int32)
        np.testing.assert_allclose(np.asarray(state_after(state, pending, padded, count)), np.asarray(final),
                                   atol=1e-5, err_msg=str(node))
        inputs = np.concatenate([np.asarray(conv_state), np.asarray(x[:, sl])], axis=1)[:, -K:]  # [B, K, C]
        np.testing.assert_allclose(np.asarray(window[:, node]), inputs, err_msg=str(node))
        expected = jax.nn.silu(np.einsum("bkc,ck->bc", inputs, np.asarray(weight)))
        np.testing.assert_allclose(np.asarray(y[:, node]), np.asarray(expected), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(conv_state_after(conv_state, pending, padded, count)), inputs[:, 1:])


def test_a_long_chain_in_chunks_equals_the_recurrence():
    """150 tokens in chunks of 64 (the last one padded): the outputs, and the state after any prefix from the
    stash, equal the token-by-token recurrence; the conv by shifting equals the tree conv on a causal mask."""
    from jaxspec.gated_delta import chain_conv, chain_gated_delta

    t = 150
    q, k, v, g, beta, state = _inputs(t, 3)
    out, pending = chain_gated_delta(q, k, v, g, beta, state, chunk=64)
    ref, final = sequential_gated_delta(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4)
    path = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    for count in (t, 100, 64, 1):
        _, expected = sequential_gated_delta(q[:, :count], k[:, :count], v[:, :count], g[:, :count],
                                             beta[:, :count], state)
        np.testing.assert_allclose(np.asarray(state_after(state, pending, path, jnp.full((B,), count))),
                                   np.asarray(expected), atol=1e-4, err_msg=str(count))
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(B, 9, C)), jnp.float32)
    conv_state = jnp.asarray(rng.normal(size=(B, K - 1, C)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(C, K)), jnp.float32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((9, 9), bool)), (B, 9, 9))
    for a, b in zip(chain_conv(x, conv_state, weight), tree_conv(x, conv_state, weight, causal)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
