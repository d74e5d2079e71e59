"""Where a speculative round's time goes: draft, verify, accept, commit, in milliseconds per round.

One generation runs under `jax.profiler`; every executed op's time is attributed to the phase of the loop it was
compiled from (the loop body's `jax.named_scope`s, `jaxspec.speculative.ROUND_PHASES`, read from the op_name
metadata of the compiled program). Ops may run concurrently on several cores, so a phase's summed op time is turned
into wall-clock time by its share: phase ms per round = the run's wall seconds x the phase's share of all op time /
the loop's iterations. What lies outside the phases is "loop" (the loop's own bookkeeping: its condition, the round's
random keys) and "prefill" (everything before the first round, reported once, not per round).

Used by `jaxspec bench --phases`; `benchmarks/profile_step.py` breaks a round down further, by kind of op.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

LOOP, PREFILL = "loop", "prefill"


def op_scopes(compiled_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata (the JAX name stack it was traced under), from the text of a
    compiled program (`jax.jit(f).lower(...).compile().as_text()`)."""
    out = {}
    for line in compiled_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*op_name=\"([^\"]*)\"", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def traced_op_times(run: Callable[[], object], module_prefix: str = "") -> collections.Counter:
    """Runs `run` once under the profiler; returns {HLO op name: microseconds summed over the trace} for the ops of
    compiled modules whose name starts with `module_prefix` (e.g. "jit_speculative_generate_tokens")."""
    folder = tempfile.mkdtemp(prefix="jaxspec-profile-")
    try:
        jax.profiler.start_trace(folder)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = sorted(glob.glob(folder + "/**/*.trace.json.gz", recursive=True))
        if not files:
            raise RuntimeError(f"jax.profiler wrote no trace under {folder}")
        with gzip.open(files[-1]) as f:
            trace = json.load(f)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    times = collections.Counter()
    for event in trace["traceEvents"]:
        args = event.get("args") or {}
        if event.get("ph") == "X" and "hlo_op" in args and str(args.get("hlo_module", "")).startswith(module_prefix):
            times[args["hlo_op"]] += event["dur"]
    return times


def phase_of(scope: str, phases: Sequence[str]) -> str:
    """The phase an op belongs to from its name stack: the first of `phases` named in it, else LOOP inside the
    while loop, else PREFILL."""
    parts = scope.split("/")
    for phase in phases:
        if phase in parts:
            return phase
    return LOOP if "while" in parts else PREFILL


def split_by_phase(op_times: collections.Counter, scopes: dict[str, str],
                   phases: Sequence[str]) -> collections.Counter:
    """{phase: microseconds}: `op_times` summed by `phase_of` each op's scope."""
    grouped = collections.Counter()
    for op, us in op_times.items():
        grouped[phase_of(scopes.get(op, ""), phases)] += us
    return grouped


def round_phase_ms(method, rows: Sequence[Sequence[int]], *, max_new_tokens: int, sampling, seed: int = 0,
                   eos_ids: Sequence[int] | None = None) -> dict[str, float]:
    """The time of one round of `method` (a `jaxspec.methods.Method` on the speculative loop) on these prompts,
    split by phase: {"draft", "verify", "accept", "commit", "loop": ms per round, "round": their sum,
    "prefill": ms once, "rounds": loop iterations}. Compiles the loop once more (for its op names) when it is new."""
    from jaxspec.speculative import ROUND_PHASES, loop_arguments, speculative_generate_tokens

    if method.drafter is None or method.is_pipeline:
        raise ValueError(f"{method.name} does not run the speculative loop's rounds")
    target = method.target
    drafter = method.drafter_for_batch(len(rows), sampling.temperature == 0)
    if drafter is None:
        raise ValueError(f"{method.name}'s --budget auto chose no draft at batch {len(rows)}: there are no rounds")
    args, kwargs = loop_arguments(target.weights, target.config, drafter, method.params, rows,
                                  max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, eos_ids=eos_ids,
                                  max_cache_length=None, mesh=method.mesh)

    def run():
        return jax.block_until_ready(speculative_generate_tokens(*args, **kwargs))

    run()  # compiled (or found compiled) and warm
    start = time.perf_counter()
    outputs = run()
    seconds = time.perf_counter() - start
    iterations = max(int(np.max(np.asarray(outputs[2]))), 1)  # the loop runs as long as its longest row
    scopes = op_scopes(speculative_generate_tokens.lower(*args, **kwargs).compile().as_text())
    grouped = split_by_phase(traced_op_times(run, "jit_speculative_generate_tokens"), scopes, ROUND_PHASES)
    total = sum(grouped.values())
    if total <= 0:
        raise RuntimeError("the profiler recorded no op of the decoding loop")
    per_round = {phase: 1e3 * seconds * grouped[phase] / total / iterations for phase in (*ROUND_PHASES, LOOP)}
    return {**per_round, "round": sum(per_round.values()),
            PREFILL: 1e3 * seconds * grouped[PREFILL] / total, "rounds": iterations}
