"""Metrics of METHODS.md: acceptance length tau, per-position acceptance, theoretical and wall-clock speedups."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def tau(accepted: Sequence[Sequence[int]]) -> float:
    """Mean tokens committed per verification round, the bonus token included. accepted[r]: drafted tokens
    accepted in each round of row r."""
    per_round = [a + 1 for row in accepted for a in row]
    return float(np.mean(per_round)) if per_round else float("nan")


def acceptance_by_position(accepted: Sequence[Sequence[int]], num_positions: int) -> list[float]:
    """Fraction of rounds whose drafted token at depth i (1-based) was accepted, for i = 1..num_positions."""
    rounds = np.array([a for row in accepted for a in row])
    if rounds.size == 0:
        return [float("nan")] * num_positions
    return [float(np.mean(rounds >= i)) for i in range(1, num_positions + 1)]


def accepted_length_histogram(accepted: Sequence[Sequence[int]], num_positions: int) -> list[int]:
    """Rounds that accepted 0, 1, ..., num_positions drafted tokens."""
    rounds = np.array([a for row in accepted for a in row], dtype=int)
    return np.bincount(rounds, minlength=num_positions + 1).tolist() if rounds.size else [0] * (num_positions + 1)


def chain_speedup(alpha: float, num_draft: int, cost_ratio: float) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)): a chain of K drafts, per-token acceptance alpha, draft cost c
    (Leviathan et al.)."""
    if alpha >= 1.0:
        return (num_draft + 1) / (num_draft * cost_ratio + 1)
    return (1 - alpha ** (num_draft + 1)) / ((1 - alpha) * (num_draft * cost_ratio + 1))


def theoretical_speedup(tau_value: float, target_layers: int, draft_cost_layers: float) -> float:
    """tau * L / (C + L): tau tokens per round for one L-layer verification plus C target-layer equivalents of
    drafting (METHODS.md; C = Ls * m for EAGLE-3, 0 for prompt lookup)."""
    return tau_value * target_layers / (draft_cost_layers + target_layers)


def eagle3_speedup(tau_value: float, target_layers: int, draft_layers: int, draft_steps: int) -> float:
    """tau * L / (Ls * m + L): m draft steps of an Ls-layer head before each L-layer verification."""
    return tau_value * target_layers / (draft_layers * draft_steps + target_layers)


def ppsd_speedup(equivalent_acceptance: float, target_layers: int, draft_layers: int, num_stages: int) -> float:
    """L'acc * L / (Ls * n + L) for PPSD with n stages."""
    return equivalent_acceptance * target_layers / (draft_layers * num_stages + target_layers)


def spd_speedup(tokens_generated: int, pipeline_steps: int, num_stages: int) -> float:
    """SPD: L'acc = alpha * n with alpha = tokens generated / pipeline steps (the drafter is hidden)."""
    return tokens_generated / pipeline_steps * num_stages


def wall_clock_speedup(baseline_seconds: float, method_seconds: float) -> float:
    """How many times faster than the baseline (autoregressive decoding of the same target, same device)."""
    return baseline_seconds / method_seconds
