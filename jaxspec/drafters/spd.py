"""SPD's pipeline drafter (Speculative Pipeline Decoding, METHODS.md method 11) and its training loss.

At every pipeline step the drafter predicts the token that enters stage 0 next. Its input is every token's
multi-depth feature: FC(concat(embedding, deepest layer reached, middle snapshot)) -> d.

- In-flight tokens have done 0..n-1 stages. The newest one is only embedded: its three snapshots are all its
  embedding.
- Committed tokens (through every layer) use their final feature for both the deepest and the middle snapshot.

Ls target-shaped decoder layers run over these features: causal, over its own KV cache of committed tokens. An
LM head follows, initialised from the target's and restricted to a draft vocabulary as EAGLE-3's is.

Input state (the default, SPD's simultaneous schedule): the drafter reads the pipeline as it is when the newest
token enters stage 0. So it can run while the stages run, and its cost is hidden. Output state: it waits for the
step, and every in-flight token is one stage deeper (the paper's ablation).

Training (`spd_loss`) replays exactly what the drafter sees at inference, for every position at once:
- The committed tokens' pass is one causal forward over the final features.
- Each position then gets its own block of in-flight tokens, the "n + 1 depth blocks" (depths 0..n-1 and the
  final one). The block attends to the committed tokens before it and causally to itself.
- A random pipeline occupancy (warm-up after a flush: only m <= n tokens in flight) is drawn per position.
- The stage count n is drawn per step from `train_num_stages`, so one drafter serves every n.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache, write_new_entries
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import choose_draft
from jaxspec.drafters.eagle import build_vocab_map, draft_to_target, head_logits, to_target_logits
from jaxspec.errors import UserError
from jaxspec.losses import masked_mean, per_position_loss
from jaxspec.model import LayerWeights, Weights, causal_mask, embed_tokens, lm_head, run_layers
from jaxspec.pipeline import PipelineDrafter, PipelineView, check_num_stages, stage_size

STATES = ("input", "output")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SPDConfig:
    """The SPD drafter's settings (the `drafter:` section of a training config)."""

    num_layers: int = 1  # Ls, the drafter's decoder layers
    draft_vocab_size: int = 4096  # the most frequent response tokens (0: the whole vocabulary)
    num_stages: int = 0  # n used at inference unless --num-stages says otherwise (0: 5, or a divisor of L near it)
    train_num_stages: tuple[int, ...] = ()  # n drawn per training step (empty: every divisor of L in 2..16)
    state: str = "input"  # input: simultaneous schedule (hidden cost); output: wait for the step
    full_pipeline_rate: float = 0.5  # training: positions with a full pipeline; the rest a random warm-up
    init_scale: float = 0.02

    def __post_init__(self):
        if self.num_layers < 1:
            raise UserError(f"drafter.num_layers must be at least 1, got {self.num_layers}.")
        if self.state not in STATES:
            raise UserError(f"drafter.state must be one of {', '.join(STATES)}, got '{self.state}'.")
        if not 0.0 <= self.full_pipeline_rate <= 1.0:
            raise UserError(f"drafter.full_pipeline_rate must be in [0, 1], got {self.full_pipeline_rate}.")

    def for_target(self, target_cfg: ModelConfig) -> SPDConfig:
        """This config with the target-dependent defaults filled in (stage counts, Vd <= V); checks them."""
        divisors = [n for n in range(2, min(16, target_cfg.num_layers) + 1) if target_cfg.num_layers % n == 0]
        if not divisors:
            raise UserError(f"A target of {target_cfg.num_layers} layer(s) cannot be split into pipeline stages.")
        stages = tuple(self.train_num_stages) or tuple(divisors)
        num_stages = self.num_stages or min(divisors, key=lambda n: (abs(n - 5), n))
        for n in (num_stages, *stages):
            check_num_stages(target_cfg, n)
        vocab = self.draft_vocab_size
        vocab = target_cfg.vocab_size if vocab == 0 or vocab > target_cfg.vocab_size else vocab
        return dataclasses.replace(self, draft_vocab_size=vocab, train_num_stages=stages, num_stages=num_stages)

    def make_drafter(self, num_stages: int | None = None, tree_width: int = 1) -> SPDDrafter:
        return SPDDrafter(num_stages=self.num_stages if num_stages is None else num_stages, tree_width=tree_width,
                          state=self.state,
                          num_draft_layers=self.num_layers, hides_drafting=self.state == "input")

    def init_params(self, target_cfg: ModelConfig, target_weights: Weights, key: jax.Array | None = None,
                    vocab_counts: np.ndarray | None = None) -> SPDParams:
        """Fresh parameters: the fusion FC starts as 'take the deepest snapshot' plus noise, the layers as copies
        of the target's last Ls layers (of a hybrid target, its last Ls attention layers), the final norm and LM
        head as the target's (on the draft vocabulary)."""
        cfg = self.for_target(target_cfg)
        counts = np.zeros(target_cfg.vocab_size, np.int64) if vocab_counts is None else vocab_counts
        d2t, _ = build_vocab_map(counts, cfg.draft_vocab_size)
        key = jax.random.key(0) if key is None else key
        d = target_cfg.hidden_size
        dtype = target_weights.embed.dtype
        noise = self.init_scale * jax.random.normal(key, (3 * d, d))
        fuse = noise.at[d:2 * d].add(jnp.eye(d)).astype(dtype)  # rows: [embedding; deepest; middle]
        if target_cfg.is_hybrid:  # the drafter's layers attend: copies of the target's last Ls attention layers
            attention = [lw for lw, linear in zip(target_weights.layers, target_cfg.linear_layers, strict=True)
                         if not linear]
            if len(attention) < self.num_layers:
                raise UserError(f"drafter.num_layers={self.num_layers}, but this hybrid target has only "
                                f"{len(attention)} attention layer(s) to start the drafter's layers from.")
            layers = jax.tree.map(lambda *w: jnp.stack(w).astype(dtype), *attention[len(attention) - self.num_layers:])
        else:
            first = target_cfg.num_layers - self.num_layers
            layers = jax.tree.map(lambda w: jnp.array(w[first:], dtype, copy=True), target_weights.layers)
        shared = target_weights.embed.T if target_weights.lm_head is None else target_weights.lm_head  # [d, V]
        d2t = jnp.asarray(d2t, jnp.int32)
        return SPDParams(fuse=fuse, layers=layers, final_norm=jnp.array(target_weights.final_norm, dtype, copy=True),
                         lm_head=jnp.take(shared, d2t, axis=1).astype(dtype), d2t=d2t.astype(jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SPDParams:
    """fuse: [3d, d] over concat(embedding, deepest, middle); layers: LayerWeights [Ls, ...]; final_norm: [d];
    lm_head: [d, Vd]; d2t: float32[Vd] the target id of each draft id."""

    fuse: jax.Array
    layers: LayerWeights
    final_norm: jax.Array
    lm_head: jax.Array
    d2t: jax.Array


def fuse_snapshots(params: SPDParams, emb: jax.Array, deepest: jax.Array, middle: jax.Array) -> jax.Array:
    """emb, deepest, middle: [..., d] -> the drafter's input feature [..., d]."""
    x = jnp.concatenate([emb, deepest, middle], axis=-1).astype(params.fuse.dtype)  # [..., 3d]
    return jnp.einsum("...e,ed->...d", x, params.fuse)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SPDState:
    """cache: the drafter's KV cache [Ls, B, Hkv, S, h] over committed tokens, lengths = committed - 1 (the last
    committed token is re-fed every step as the first token of the block); last_token: int32[B] and last_final:
    [B, d], that token and its final feature."""

    cache: KVCache
    last_token: jax.Array
    last_final: jax.Array


def middle_layer(cfg: ModelConfig, num_stages: int, stages_done: int) -> int:
    """The layer whose output is the 'middle' snapshot of a token that has done `stages_done` >= 1 stages: the
    middle layer of the last stage it ran (see docs/spd.md)."""
    s = stage_size(cfg, num_stages)
    return (stages_done - 1) * s + (s - 1) // 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class SPDDrafter(PipelineDrafter):
    name: str = "spd"
    state: str = "input"
    num_draft_layers: int = 1
    hides_drafting: bool = True

    def init(self, params: SPDParams, target_weights, target_cfg, prompt_tokens, prompt_lengths, prompt_hidden,
             cache_size):
        b, p = prompt_tokens.shape
        emb = embed_tokens(target_weights, target_cfg, prompt_tokens)  # [B, P, d]
        feats = fuse_snapshots(params, emb, prompt_hidden, prompt_hidden)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, new_k, new_v, _ = run_layers(target_cfg, params.layers, feats, positions, None, None,
                                        jnp.zeros((b,), jnp.int32), causal_mask(b, p))  # [Ls, B, Hkv, P, h]
        shape = (self.num_draft_layers, b, target_cfg.num_kv_heads, cache_size, target_cfg.head_dim)
        cache = KVCache(k=jnp.zeros(shape, emb.dtype).at[:, :, :, :p].set(new_k),
                        v=jnp.zeros(shape, emb.dtype).at[:, :, :, :p].set(new_v),
                        lengths=(prompt_lengths - 1).astype(jnp.int32))
        last = (prompt_lengths - 1)[:, None]
        return SPDState(cache=cache, last_token=jnp.take_along_axis(prompt_tokens, last, axis=1)[:, 0],
                        last_final=jnp.take_along_axis(prompt_hidden, last[:, :, None], axis=1)[:, 0])

    def block(self, params: SPDParams, state: SPDState, view: PipelineView, target_weights, target_cfg):
        """The drafter's forward over [last committed token, slots n-1 .. 0]. Returns (h [B, n+1, d], new cache)."""
        order = jnp.arange(self.num_stages - 1, -1, -1)  # oldest slot first
        if self.state == "input":
            deepest, middle = view.hidden[order], view.middle[order]  # [n, B, d]
        else:  # one stage deeper; the oldest slot has just finished (final format)
            deepest, middle = view.out[order], view.out_middle[order]
            middle = middle.at[0].set(deepest[0])
        tokens = jnp.concatenate([state.last_token[None], view.tokens[order]]).T  # [B, n+1]
        deepest = jnp.concatenate([state.last_final[None], deepest]).transpose(1, 0, 2)  # [B, n+1, d]
        middle = jnp.concatenate([state.last_final[None], middle]).transpose(1, 0, 2)
        feats = fuse_snapshots(params, embed_tokens(target_weights, target_cfg, tokens), deepest, middle)
        positions = jnp.concatenate([(view.committed - 1)[None], view.positions[order]]).T  # [B, n+1]
        present = jnp.concatenate([jnp.ones_like(view.active[:1]), view.active[order]]).T  # [B, n+1]
        mask = causal_mask(*present.shape) & present[:, None, :]
        h, new_k, new_v, _ = run_layers(target_cfg, params.layers, feats, positions, state.cache.k, state.cache.v,
                                        state.cache.lengths, mask)
        return h, write_new_entries(state.cache, new_k, new_v)

    def propose(self, params, state, view, target_weights, target_cfg, sampling, rng):
        h, cache = self.block(params, state, view, target_weights, target_cfg)
        logits = to_target_logits(params, head_logits(params, target_cfg, h[:, -1]), target_cfg.vocab_size)
        draft, q = choose_draft(logits, sampling, rng, self.tree_width)
        return draft, q, dataclasses.replace(state, cache=cache)

    def update(self, params, state, view, exiting, exit_token, exit_hidden):
        cache = dataclasses.replace(state.cache, lengths=jnp.where(exiting, view.committed, state.cache.lengths))
        return SPDState(cache=cache, last_token=jnp.where(exiting, exit_token, state.last_token),
                        last_final=jnp.where(exiting[:, None], exit_hidden, state.last_final))

    def draft_cost_layers(self, target_cfg):
        return float(self.num_draft_layers)

    def snapshot_layer(self, target_cfg):
        return middle_layer(target_cfg, self.num_stages, 1)  # each stage's middle layer (the multi-depth feature)

    def check_compatible(self, params: SPDParams, target_cfg, target_tokenizer=None):
        super().check_compatible(params, target_cfg, target_tokenizer)
        if params.fuse.shape != (3 * target_cfg.hidden_size, target_cfg.hidden_size):
            raise UserError(f"This SPD drafter was built for a model of width {params.fuse.shape[1]}, not this "
                            f"target's {target_cfg.hidden_size}; train one for this target (jaxspec train).")
        if params.layers.wq.shape[0] != self.num_draft_layers:
            raise UserError(f"The drafter has {params.layers.wq.shape[0]} layers but its config says "
                            f"{self.num_draft_layers}.")


# ---------------------------------------------------------------------------------------------- training


def depth_snapshots(emb: jax.Array, hidden: jax.Array, num_stages: int, target_cfg: ModelConfig):
    """The (deepest, middle) snapshots of every token at every pipeline depth.

    emb: [B, N, d]; hidden: [L, B, N, d], every layer's output. Returns (deepest, middle), each [n+1, B, N, d]:
    depth 0 is the embedding, depth k in 1..n-1 has done k stages, depth n is the final feature.
    """
    s = stage_size(target_cfg, num_stages)
    final = hidden[-1]
    deepest = [emb] + [hidden[k * s - 1] for k in range(1, num_stages)] + [final]
    middle = [emb] + [hidden[middle_layer(target_cfg, num_stages, k)] for k in range(1, num_stages)] + [final]
    return jnp.stack(deepest), jnp.stack(middle)


def spd_block_logits(params: SPDParams, target_cfg: ModelConfig, emb, hidden, occupancy, *, num_stages: int,
                     state: str = "input"):
    """The drafter's draft logits at every position, each under its own pipeline occupancy.

    emb: [B, N, d] token embeddings; hidden: [L, B, N, d] the target's layer outputs; occupancy: int32[B, N], m_i
    in 1..n, the in-flight tokens when position i is the newest (n: a full pipeline; fewer: warm-up after a flush;
    the committed tokens before them number at least 1). Returns float32 [B, N, Vd]: at position i, the drafter's
    logits for token i + 1, exactly what `SPDDrafter.propose` computes for that pipeline state.
    """
    n = num_stages
    b, length, d = emb.shape
    offset = 1 if state == "output" else 0
    deepest, middle = depth_snapshots(emb, hidden, n, target_cfg)  # [n+1, B, N, d]
    # committed tokens: one causal pass over final features gives every layer's keys and values
    final = fuse_snapshots(params, emb, deepest[n], middle[n])  # [B, N, d]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    _, final_k, final_v, _ = run_layers(target_cfg, params.layers, final, positions, None, None,
                                        jnp.zeros((b,), jnp.int32), causal_mask(b, length))  # [Ls, B, Hkv, N, h]
    # in-flight blocks: slot t (oldest first) of position i holds token i - (n-1-t) at depth (n-1-t) + offset
    slot_feats, slot_positions = [], []
    for t in range(n):
        back = n - 1 - t
        depth = min(back + offset, n)
        f = fuse_snapshots(params, emb, deepest[depth], middle[depth])  # [B, N, d] (depth n: final, final)
        slot_feats.append(jnp.roll(f, back, axis=1))  # position i holds token i - back (wrapped ones are masked)
        slot_positions.append(positions - back)
    feats = jnp.stack(slot_feats, axis=2).reshape(b * length, n, d)  # [B N, n, d]
    slot_positions = jnp.maximum(jnp.stack(slot_positions, axis=2), 0).reshape(b * length, n)
    m = occupancy.reshape(b * length)
    in_flight = (n - 1 - jnp.arange(n))[None, :] < m[:, None]  # [B N, n]
    mask = causal_mask(b * length, n) & in_flight[:, None, :]
    committed_end = (positions.reshape(b * length) - m + 1)  # tokens before it are committed (final)

    def per_row(cache):  # [Ls, B, Hkv, N, h] -> [Ls, B N, Hkv, N, h]: every position of a row sees its row
        return jnp.repeat(cache, length, axis=1)

    h, _, _, _ = run_layers(target_cfg, params.layers, feats, slot_positions, per_row(final_k), per_row(final_v),
                            jnp.maximum(committed_end, 0), mask)
    return head_logits(params, target_cfg, h[:, -1]).reshape(b, length, -1)


def random_occupancy(key: jax.Array, shape: tuple[int, int], num_stages: int, full_rate: float) -> jax.Array:
    """int32[B, N]: m_i = n with probability full_rate, else uniform in 1..n; at most i (one committed token)."""
    k1, k2 = jax.random.split(key)
    warm = jax.random.randint(k1, shape, 1, num_stages + 1)
    m = jnp.where(jax.random.uniform(k2, shape) < full_rate, num_stages, warm)
    return jnp.clip(m, 1, jnp.maximum(jnp.arange(shape[1])[None, :], 1)).astype(jnp.int32)


def spd_loss(params: SPDParams, target_weights: Weights, target_cfg: ModelConfig, tokens, hidden, target_last,
             loss_mask, key, *, num_stages: int, state: str = "input", full_rate: float = 0.5,
             kind: str = "forward_kl"):
    """Distillation loss at one stage count. tokens: int32[B, N] text the target generated; hidden: [L, B, N, d];
    target_last: [B, N, d] the last layer's output (its logits are needed on the draft vocabulary only);
    loss_mask: bool[B, N] (True at i when token i + 1 is a response token). Returns (loss, metrics: acc is the
    draft argmax equal to the text's next token, the target's argmax in text it generated at T=0)."""
    emb = embed_tokens(target_weights, target_cfg, tokens)
    occupancy = random_occupancy(key, tokens.shape, num_stages, full_rate)
    logits = spd_block_logits(params, target_cfg, emb, hidden, occupancy, num_stages=num_stages, state=state)
    d2t = draft_to_target(params)
    restricted = jax.lax.stop_gradient(lm_head(target_weights, target_cfg, target_last, d2t))  # [B, N, Vd]
    mask = loss_mask & (jnp.arange(tokens.shape[1]) >= 1)[None]  # position 0 has no committed token before it
    loss = masked_mean(per_position_loss(kind, logits, restricted), mask)
    next_token = jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], -1)], axis=1)  # [B, N]
    hit = d2t[jnp.argmax(logits, axis=-1)] == next_token
    full = occupancy == num_stages
    return loss, {"acc": masked_mean(hit.astype(jnp.float32), mask),
                  "acc_full_pipeline": masked_mean(hit.astype(jnp.float32), mask & full)}


def spd_training_loss(params, mcfg: SPDConfig, target_weights, target_cfg, features, loss_mask, loss_cfg, key):
    """`spd_loss` with the training loop's signature: the stage count is drawn per step from
    `mcfg.train_num_stages` (one compiled branch per count, `lax.switch` picks one)."""
    stages = tuple(mcfg.train_num_stages)
    pick_key, loss_key = jax.random.split(key)

    def branch(n):
        return lambda params: spd_loss(params, target_weights, target_cfg, features.tokens, features.hidden,
                                       features.last_hidden, loss_mask, loss_key, num_stages=n, state=mcfg.state,
                                       full_rate=mcfg.full_pipeline_rate, kind=loss_cfg.kind)

    index = jax.random.randint(pick_key, (), 0, len(stages))
    loss, metrics = jax.lax.switch(index, [branch(n) for n in stages], params)
    metrics["num_stages"] = jnp.asarray(stages)[index].astype(jnp.float32)
    return loss, metrics
