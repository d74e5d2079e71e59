"""The Gated DeltaNet of Qwen3.5's linear-attention layers, for prefill, decoding and tree verification alike.

Per value head the layer keeps a state S [Dk, Dv] that every token t updates (transformers'
`torch_recurrent_gated_delta_rule`):

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

A sequential scan would need a state per tree node to verify a tree (a node's state follows from its parent's, not
from its left neighbour in the flattened tree). Instead, with the nodes in parents-first order, M the
ancestor-or-self mask and G = M g the log-decay summed along each node's path, every node's output follows from the
committed state S0 in one forward (docs/hybrid.md; ../shared/HYBRID_MOE.md):

    R_i = beta_i (v_i - exp(G_i) S0^T k_i)
    (I + A) U = R,  A_ij = beta_i exp(G_i - G_j) k_i^T k_j  for j a strict ancestor of i   (unit lower triangular)
    o_i = exp(G_i) S0^T q_i + sum_{j in M(i)} exp(G_i - G_j) (q_i^T k_j) u_j

A chain (a prefill, a decoding step) is the tree whose mask is causal. Verification writes no state: the forward
returns (k, u, G) per node, and the commit builds the state after the last accepted node a from them,
S_a = exp(G_a) S0 + sum_{j in M(a)} exp(G_a - G_j) k_j u_j^T. The short causal convolution in front of the
recurrence is handled the same way: each node's window holds its own input and those of its K - 1 nearest
ancestors, reaching into the committed inputs (the conv state) above the root.

Shapes: B rows, T new tokens (nodes), H value heads, Dk / Dv key / value head dims, C conv channels, K kernel width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingDelta:
    """What one forward of T nodes leaves for the commit of one linear-attention layer: k [B, T, H, Dk] (normalised,
    expanded to the value heads), u [B, T, H, Dv], log_decay [B, T, H] (G: g summed along each node's path) and
    window [B, T, K, C] (each node's conv inputs, oldest first, its own last)."""

    k: jax.Array
    u: jax.Array
    log_decay: jax.Array
    window: jax.Array


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (transformers' and flash-linear-attention's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def tree_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array, ancestors: jax.Array):
    """The depthwise causal convolution (then SiLU) of every node over its own path.

    x: [B, T, C] the nodes' raw inputs; conv_state: [B, K-1, C] the last K-1 committed inputs (oldest first);
    weight: [C, K] (weight[:, K-1] multiplies the node's own input); ancestors: bool[B, T, T] ancestor-or-self.
    Returns (y [B, T, C] float32, window [B, T, K, C]: each node's inputs, oldest first).
    """
    kernel = weight.shape[1]
    depth = jnp.sum(ancestors, axis=-1, dtype=jnp.int32) - 1  # [B, T]: 0 for the root (as in verify_forward)
    lags = jnp.arange(kernel - 1, -1, -1)  # [K]: oldest input first
    wanted = depth[:, :, None] - lags[None, None, :]  # [B, T, K]: the depth each window slot comes from
    # the node at that depth on this node's path (a one-hot over the T nodes; none when the depth is above the root)
    pick = ancestors[:, :, None, :] & (depth[:, None, None, :] == wanted[..., None])  # [B, T, K, T]
    index = jnp.argmax(pick, axis=-1)  # [B, T, K]
    from_tree = jnp.take_along_axis(x[:, None, :, :], index[..., None], axis=2)  # [B, T, K, C]
    committed = jnp.take_along_axis(conv_state[:, None, :, :],
                                    jnp.clip(kernel - 1 + wanted, 0, kernel - 2)[..., None], axis=2)  # [B, T, K, C]
    window = jnp.where((wanted >= 0)[..., None], from_tree, committed)  # [B, T, K, C]
    y = jnp.einsum("btkc,ck->btc", window.astype(jnp.float32), weight.astype(jnp.float32))
    return jax.nn.silu(y), window


def tree_gated_delta(q, k, v, g, beta, state, ancestors):
    """The gated delta rule over T nodes from the committed state, every node on its own path.

    q, k: [B, T, H, Dk] (l2-normalised, expanded to the value heads; q also scaled by Dk^-1/2); v: [B, T, H, Dv];
    g: [B, T, H] log decay (<= 0); beta: [B, T, H]; state: [B, H, Dk, Dv] float32 (S0); ancestors: bool[B, T, T]
    ancestor-or-self mask in parents-first order (a padded node is nobody's ancestor).
    Returns (out [B, T, H, Dv] float32, PendingDelta without the conv window).
    """
    f32 = jnp.float32
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    m = ancestors.astype(f32)  # [B, T, T]
    log_decay = jnp.einsum("btu,buh->bth", m, g)  # [B, T, H]: G
    diff = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [B, T, T, H]: G_i - G_j
    on_path = ancestors[..., None]  # [B, T, T, 1]
    decay = jnp.where(on_path, jnp.exp(jnp.where(on_path, diff, 0.0)), 0.0)  # [B, T, T, H]; masked before exp
    scale = jnp.exp(log_decay)[..., None]  # [B, T, H, 1]
    residual = beta[..., None] * (v - scale * jnp.einsum("bthk,bhkv->bthv", k, state))  # [B, T, H, Dv]: R
    strict = decay * (1.0 - jnp.eye(k.shape[1], dtype=f32))[None, :, :, None]  # strict ancestors only
    a = beta.transpose(0, 2, 1)[..., None] * strict.transpose(0, 3, 1, 2) * jnp.einsum("bihk,bjhk->bhij", k, k)
    lower = a + jnp.eye(k.shape[1], dtype=f32)  # [B, H, T, T]: I + A, unit lower triangular
    u = jax.scipy.linalg.solve_triangular(lower, residual.transpose(0, 2, 1, 3), lower=True,
                                          unit_diagonal=True)  # [B, H, T, Dv]
    u = u.transpose(0, 2, 1, 3)  # [B, T, H, Dv]
    scores = jnp.einsum("bihk,bjhk->bhij", q, k) * decay.transpose(0, 3, 1, 2)  # [B, H, T, T]
    out = scale * jnp.einsum("bthk,bhkv->bthv", q, state) + jnp.einsum("bhij,bjhv->bihv", scores, u)
    return out, PendingDelta(k=k, u=u, log_decay=log_decay, window=None)


CHUNK = 64  # tokens per chunk of a long chain (a prefill): its work and memory grow as CHUNK^2, not T^2


def chain_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array):
    """`tree_conv` for a chain (each token's ancestors are the tokens before it): windows by shifting.
    x: [B, T, C]; conv_state: [B, K-1, C]; weight: [C, K]. Returns (y [B, T, C] float32, window [B, T, K, C])."""
    kernel, t = weight.shape[1], x.shape[1]
    inputs = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    window = jnp.stack([inputs[:, j:j + t] for j in range(kernel)], axis=2)  # [B, T, K, C], oldest first
    y = jnp.einsum("btkc,ck->btc", window.astype(jnp.float32), weight.astype(jnp.float32))
    return jax.nn.silu(y), window


def chain_gated_delta(q, k, v, g, beta, state, chunk: int = CHUNK):
    """`tree_gated_delta` for a chain of T tokens, in chunks of `chunk`: each chunk in the single-chunk form from the
    state after the chunks before it (carried by `state_after`). The same outputs and stash (its G summed from the
    first token, so the commit is unchanged); work and memory grow as T * chunk instead of T^2 per head."""
    b, t, h = g.shape
    if t <= chunk:
        return tree_gated_delta(q, k, v, g, beta, state, jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)),
                                                                           (b, t, t)))
    n = -(-t // chunk)
    pad = n * chunk - t  # padded tokens come last, with beta 0 and g 0: they change nothing before them

    def split(a):  # [B, T, ...] -> [n, B, chunk, ...]
        a = jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, n, chunk, *a.shape[2:]), 1, 0)

    causal = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (b, chunk, chunk))
    path = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
    full = jnp.full((b,), chunk, jnp.int32)

    def step(carry, inputs):
        s, offset = carry  # [B, H, Dk, Dv], [B, H]: the state and the summed log decay before this chunk
        out, pending = tree_gated_delta(*inputs, s, causal)
        s = state_after(s, pending, path, full)
        return (s, offset + pending.log_decay[:, -1]), (out, pending.k, pending.u, pending.log_decay + offset[:, None])

    _, (out, ks, us, decays) = jax.lax.scan(step, (state.astype(jnp.float32), jnp.zeros((b, h), jnp.float32)),
                                            tuple(split(a) for a in (q, k, v, g, beta)))

    def join(a):  # [n, B, chunk, ...] -> [B, T, ...]
        return jnp.moveaxis(a, 0, 1).reshape(b, n * chunk, *a.shape[3:])[:, :t]

    return join(out), PendingDelta(k=join(ks), u=join(us), log_decay=join(decays), window=None)


def state_after(state: jax.Array, pending: PendingDelta, path: jax.Array, count: jax.Array) -> jax.Array:
    """The recurrent state after the last of the first `count` nodes of `path` (a chain of nodes from the root).

    state: [B, H, Dk, Dv] float32 (S0); path: int32[B, A] node indices, root first; count: int32[B] (0 keeps S0).
    Returns [B, H, Dk, Dv] float32.
    """
    a = path.shape[1]
    on = jnp.arange(a)[None, :] < count[:, None]  # [B, A]
    last = jnp.take_along_axis(path, jnp.clip(count - 1, 0, a - 1)[:, None], axis=1)[:, 0]  # [B]
    rows = jnp.arange(path.shape[0])
    g_last = pending.log_decay[rows, last]  # [B, H]
    g_path = jnp.take_along_axis(pending.log_decay, path[:, :, None], axis=1)  # [B, A, H]
    k_path = jnp.take_along_axis(pending.k, path[:, :, None, None], axis=1)  # [B, A, H, Dk]
    u_path = jnp.take_along_axis(pending.u, path[:, :, None, None], axis=1)  # [B, A, H, Dv]
    weight = jnp.where(on[..., None], jnp.exp(jnp.where(on[..., None], g_last[:, None] - g_path, 0.0)), 0.0)
    moved = jnp.exp(g_last)[:, :, None, None] * state + jnp.einsum("bah,bahk,bahv->bhkv", weight, k_path, u_path)
    return jnp.where((count > 0)[:, None, None, None], moved, state)


def conv_state_after(conv_state: jax.Array, pending: PendingDelta, path: jax.Array, count: jax.Array) -> jax.Array:
    """The conv state (last K-1 inputs, oldest first) after the last of the first `count` nodes of `path`.
    conv_state: [B, K-1, C]; path: int32[B, A]; count: int32[B]. Returns [B, K-1, C]."""
    last = jnp.take_along_axis(path, jnp.clip(count - 1, 0, path.shape[1] - 1)[:, None], axis=1)[:, 0]  # [B]
    window = pending.window[jnp.arange(path.shape[0]), last]  # [B, K, C]
    return jnp.where((count > 0)[:, None, None], window[:, 1:], conv_state)


def sequential_gated_delta(q, k, v, g, beta, state):
    """The recurrence token by token (a chain; the reference the tree form is tested against).
    Shapes as `tree_gated_delta` without the mask. Returns (out [B, T, H, Dv], final state [B, H, Dk, Dv])."""
    f32 = jnp.float32

    def step(s, inputs):  # s: [B, H, Dk, Dv]
        q_t, k_t, v_t, g_t, b_t = inputs  # [B, H, Dk], [B, H, Dk], [B, H, Dv], [B, H], [B, H]
        s = s * jnp.exp(g_t)[..., None, None]
        u = b_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * u[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(a.astype(f32), 1, 0) for a in (q, k, v, g, beta))
    final, out = jax.lax.scan(step, state.astype(f32), xs)
    return jnp.moveaxis(out, 0, 1), final
