"""The training config: the sections of a training YAML file (read by `jaxspec.config_files.load_config`) and the
optimizer they describe.

A training config has the sections every method shares (`data`, `optim`, `loss`, `run`, `mesh`) plus a
free-form `drafter` mapping. The method named by `method` owns its own frozen dataclass and converts the
`drafter` mapping with `from_dict(its_cls, cfg.drafter, path="drafter")` before any work starts, so a typo
there is refused with the same message (dotted key, valid keys, closest key) as anywhere else. This keeps this
module free of imports from the methods (each method registers itself with the training loop, not here) and a
new method needs no edit to this file. The format is described key by key in `configs/README.md`.

    cfg = load_config("configs/medusa-smollm2.yaml", TrainConfig, overrides=["optim.learning_rate=3e-4"])
    optimizer = make_optimizer(cfg.optim, cfg.run.steps)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import optax

from jaxspec.errors import UserError

SCHEDULES = ("linear", "cosine", "constant")
LOSS_KINDS = ("forward_kl", "reverse_kl", "sft")
DTYPES = ("auto", "float32", "bfloat16")


# ---------------------------------------------------------------------------------------------- the sections


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the regenerated training data is and how it is cut."""

    path: str  # the regenerated data set (the target's own responses) as written by `jaxspec regenerate`; several
    # folders of the same target separated by commas (the held-out samples come from the last one)
    seq_len: int = 2048  # tokens per training sequence (prompt + response; longer ones are cut)
    eval_holdout: float = 0.01  # held out for evaluation: a fraction in [0, 1), or a whole count >= 1
    # compute the frozen target's hidden states once and store them on disk (run.out_dir/features) instead of
    # running the target inside every step; full-vocabulary logits are never stored
    cache_features: bool = False

    def __post_init__(self):
        _require(bool(self.path), "data.path must name the regenerated data set.")
        _require(self.seq_len > 0, f"data.seq_len must be positive, got {self.seq_len}.")
        h = self.eval_holdout
        _require(h >= 0 and (h < 1 or float(h).is_integer()),
                 f"data.eval_holdout must be a fraction in [0, 1) or a whole count of examples, got {h}.")

    def num_held_out(self, num_examples: int) -> int:
        """How many of `num_examples` are held out for evaluation (at least 1 when the fraction is non-zero)."""
        if self.eval_holdout >= 1:
            return min(int(self.eval_holdout), num_examples)
        if self.eval_holdout == 0:
            return 0
        return min(max(1, round(self.eval_holdout * num_examples)), num_examples)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with warm-up and decay, global-norm clipping, gradient accumulation (see `make_optimizer`)."""

    learning_rate: float = 1e-4  # peak learning rate, reached after the warm-up
    warmup_steps: int = 100  # linear warm-up from 0, in optimizer updates
    schedule: Literal["linear", "cosine", "constant"] = "cosine"  # after the warm-up, until the last update
    final_lr_fraction: float = 0.0  # the decay ends at learning_rate * final_lr_fraction (linear, cosine)
    weight_decay: float = 0.0  # decoupled (AdamW), on matrices only (ndim >= 2), not on norms and biases
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # global-norm clipping of the (accumulated) gradient; null disables
    grad_accum: int = 1  # micro-batches averaged per optimizer update (optax.MultiSteps when > 1)

    def __post_init__(self):
        _require(self.learning_rate > 0, f"optim.learning_rate must be positive, got {self.learning_rate}.")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}.")
        _require(self.schedule in SCHEDULES,
                 f"optim.schedule must be one of {', '.join(SCHEDULES)}, got '{self.schedule}'.")
        _require(0 <= self.final_lr_fraction <= 1,
                 f"optim.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}.")
        _require(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}.")
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, f"optim.b1 and optim.b2 must be in [0, 1), got "
                 f"{self.b1} and {self.b2}.")
        _require(self.eps > 0, f"optim.eps must be positive, got {self.eps}.")
        _require(self.grad_clip is None or self.grad_clip > 0,
                 f"optim.grad_clip must be positive (or null to disable clipping), got {self.grad_clip}.")
        _require(self.grad_accum >= 1, f"optim.grad_accum must be >= 1, got {self.grad_accum}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The distillation loss and its per-draft-position weights (see `jaxspec/losses.py`)."""

    kind: Literal["forward_kl", "reverse_kl", "sft"] = "forward_kl"
    position_decay: float | None = None  # weight decay**i for draft position i (Medusa, EAGLE-3: 0.8); null: none
    gamma: float | None = None  # DFlash-style weight exp(-gamma * i); null: none

    def __post_init__(self):
        _require(self.kind in LOSS_KINDS, f"loss.kind must be one of {', '.join(LOSS_KINDS)}, got '{self.kind}'.")
        _require(self.position_decay is None or 0 < self.position_decay <= 1,
                 f"loss.position_decay must be in (0, 1] or null, got {self.position_decay}.")
        _require(self.gamma is None or self.gamma >= 0, f"loss.gamma must be >= 0 or null, got {self.gamma}.")
        _require(self.position_decay is None or self.gamma is None,
                 "loss.position_decay and loss.gamma are two ways to weight draft positions; set only one.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Length, batch, seed, output and the cadence of logs, evaluations and checkpoints (in optimizer updates)."""

    steps: int = 1000  # optimizer updates; each sees grad_accum micro-batches of batch_size sequences
    batch_size: int = 8  # sequences per micro-batch, over all data-parallel devices
    seed: int = 0  # parameter initialisation and data order
    out_dir: str = "runs/drafter"  # checkpoints/, metrics.jsonl, config.json, loss.png, drafter/
    save_every: int = 500  # training checkpoint interval; the last step is always saved
    keep_checkpoints: int = 3  # training checkpoints kept (the newest)
    eval_every: int = 0  # acceptance evaluation interval; 0 disables it
    eval_prompts: int = 16  # held-out prompts used by each evaluation
    log_every: int = 10  # metrics line interval
    init_from: str | None = None  # a drafter folder (same method, target and drafter settings) whose parameters
    # start a fresh run (fine-tuning on more data, or with a new schedule); ignored when the run resumes
    rebuild_draft_vocab: bool = False  # with init_from, an EAGLE-3 head moves to the draft vocabulary of this run's
    # data (its most frequent response tokens) even at the same size, keeping the trained column of every token both
    # hold; false keeps the saved head's vocabulary (a different draft_vocab_size always moves it)

    def __post_init__(self):
        for name in ("steps", "batch_size", "save_every", "keep_checkpoints", "log_every"):
            value = getattr(self, name)
            _require(value > 0, f"run.{name} must be positive, got {value}.")
        _require(self.eval_every >= 0, f"run.eval_every must be >= 0 (0 disables evaluation), got {self.eval_every}.")
        _require(self.eval_prompts > 0, f"run.eval_prompts must be positive, got {self.eval_prompts}.")
        _require(self.seed >= 0, f"run.seed must be >= 0, got {self.seed}.")
        _require(bool(self.out_dir), "run.out_dir must name a directory.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh for training: data parallelism over `data` devices, times `model` devices that split the
    frozen target (tensor parallelism: heads, widths and vocabulary, as `jaxspec.sharding` splits it for decoding)
    when it is too large for one device. The drafter is replicated."""

    data: int = 1
    model: int = 1

    def __post_init__(self):
        _require(self.data >= 1, f"mesh.data must be >= 1, got {self.data}.")
        _require(self.model >= 1, f"mesh.model must be >= 1, got {self.model}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A drafter training run. `drafter` is free-form here; the method's own dataclass reads it."""

    method: str  # the drafter family to train (medusa, eagle3, dflash, ...)
    target: str = "smollm2-135m"  # the frozen target: a known name, a .gguf file or a HF folder
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # target dtype; auto: float32 on CPU, bfloat16 else
    data: DataConfig
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    run: RunConfig = RunConfig()
    mesh: MeshConfig = MeshConfig()
    # Excluded from the hash (a dict is unhashable) but compared, so equal configs still hash equally.
    drafter: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self):
        _require(bool(self.method), "method must name the drafter to train (for example medusa or eagle3).")
        _require(bool(self.target), "target must name the target model (a known name, .gguf file or HF folder).")
        _require(self.run.batch_size % self.mesh.data == 0,
                 f"run.batch_size={self.run.batch_size} must be a multiple of mesh.data={self.mesh.data}.")


# ---------------------------------------------------------------------------------------------- optimizer


def make_schedule(optim: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate per optimizer update: linear warm-up from 0, then linear/cosine decay or constant.

    Args:
        optim: the optimizer section.
        total_steps: optimizer updates in the run (`run.steps`); the decay ends there.

    Returns:
        step -> learning rate; 0 at step 0, `learning_rate` at `warmup_steps`, `learning_rate *
        final_lr_fraction` at `total_steps` (linear, cosine).

    Raises:
        UserError: `total_steps` is not positive or is shorter than the warm-up.
    """
    _require(total_steps > 0, f"The run must have a positive number of steps, got {total_steps}.")
    _require(optim.warmup_steps <= total_steps, f"optim.warmup_steps={optim.warmup_steps} is longer than the run "
             f"({total_steps} steps); shorten the warm-up or train longer.")
    peak, warm = optim.learning_rate, optim.warmup_steps
    end = peak * optim.final_lr_fraction
    decay_steps = total_steps - warm
    if optim.schedule == "constant" or decay_steps == 0:
        after = optax.constant_schedule(peak)
    elif optim.schedule == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=optim.final_lr_fraction)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _decay_mask(params):
    # Weight decay on matrices only: decaying norm scales and biases towards 0 hurts and is not what AdamW
    # recipes for transformers do.
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(optim: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW on the `make_schedule` learning rate, after global-norm clipping, with gradient accumulation.

    With `grad_accum = k > 1` the result is `optax.MultiSteps`: call `update` once per micro-batch; every k-th
    call applies one AdamW update on the mean of the k gradients (clipped as a whole), the others return zero
    updates. The schedule counts optimizer updates, not micro-batches.

    Args:
        optim: the optimizer section.
        total_steps: optimizer updates in the run (`run.steps`).

    Returns:
        The optax transformation (its `init` and `update`).
    """
    schedule = make_schedule(optim, total_steps)
    parts = []
    if optim.grad_clip is not None:
        parts.append(optax.clip_by_global_norm(optim.grad_clip))
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                             mask=_decay_mask))
    tx = optax.chain(*parts)
    if optim.grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=optim.grad_accum).gradient_transformation()
    return tx
