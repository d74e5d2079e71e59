"""Do the tests have power? Applies known-bad variants of the acceptance rule and the drafters' q, one at a time,
and runs the tests that should catch each: every mutant must make them fail.

    .venv/bin/python scripts/mutation_check.py            # all mutants (about 15 minutes on 2 CPU cores)
    .venv/bin/python scripts/mutation_check.py --list
    .venv/bin/python scripts/mutation_check.py residual-not-updated dflash-raw-marginal

Each mutant is a small, plausible bug (the kind an independent audit planted): a text replacement in one source
file. The file is changed in place and restored afterwards (also on Ctrl-C); the script refuses to start when a file
it would change has uncommitted edits. Exit status 1 when a mutant survives (its tests still pass).

Not mutants (tried, and they survive as they must: they are still lossless). A draft reported as a point mass is
accepted with probability p(x) and the residual is p without x, so the output follows p whatever x is, however x
was chosen (independently of the acceptance uniforms). Hence: letting the rule try padding nodes (valid False: each
drafter gives them a token under a consistent parent) as drafts; a sampled chain that drops q (reported as a point
mass); sibling tokens drawn at random but reported as point masses. They lower acceptance, not exactness.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSSLESS = "tests/test_lossless.py"
SAMPLED = "tests/test_sampled_loop.py"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    path: str  # file changed, relative to the repository
    old: str  # exact text replaced (must occur once)
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail


MUTANTS = (
    Mutant("acceptance-ignores-q", "a drafted token is accepted with probability p(x), not min(1, p(x) / q(x))",
           "jaxspec/verification.py", "jnp.minimum(1.0, rx / jnp.where(qx > 0, qx, 1.0))", "jnp.minimum(1.0, rx)",
           (LOSSLESS, SAMPLED, "-k", "not wrong_q")),
    Mutant("residual-not-updated", "after a rejected sibling the next one is tested against p, not the residual",
           "jaxspec/verification.py",
           "jnp.where(rejected, residual_after_rejection(residual, q, vocab_axis), residual)", "residual",
           (LOSSLESS, SAMPLED, "-k", "not wrong_q")),
    Mutant("residual-not-clipped", "the residual is |r - q| instead of max(0, r - q)",
           "jaxspec/verification.py", "left = jnp.maximum(residual - q, 0.0)", "left = jnp.abs(residual - q)",
           (LOSSLESS, SAMPLED, "-k", "not wrong_q")),
    Mutant("bonus-from-p", "the bonus token is drawn from p at the last accepted node, not from the residual",
           "jaxspec/verification.py",
           "_, residual, path, count = jax.lax.fori_loop(0, num_nodes, visit, init)",
           "current, residual, path, count = jax.lax.fori_loop(0, num_nodes, visit, init)\n"
           "    residual = target_probs[current]",
           (LOSSLESS, SAMPLED, "-k", "not wrong_q")),
    Mutant("chain-q-untempered", "a sampled draft chain reports q from the untempered softmax",
           "jaxspec/drafters/base.py", "return sample_categorical(rng, logq)[:, None], jnp.exp(logq)",
           "return sample_categorical(rng, logq)[:, None], "
           "jax.nn.softmax(logits, axis=-1)", (SAMPLED, "-k", "not wrong_q")),
    Mutant("chain-q-without-filters", "a sampled draft chain's q is tempered but misses top-k and top-p",
           "jaxspec/drafters/base.py", "return sample_categorical(rng, logq)[:, None], jnp.exp(logq)",
           "return sample_categorical(rng, logq)[:, None], "
           "jax.nn.softmax(logits / sampling.temperature, axis=-1)", (SAMPLED, "-k", "not wrong_q")),
    Mutant("top-p-drops-crossing-token", "top-p keeps only the tokens strictly inside the threshold, not the one "
           "that crosses it", "jaxspec/sampling.py",
           "logits = jnp.where(keys < cutoff, -jnp.inf, logits)\n    top = vocab_max",
           "logits = jnp.where(keys <= cutoff, -jnp.inf, logits)\n    top = vocab_max",
           ("tests/test_generate.py", "-k", "process_logits")),
    Mutant("ancestor-mask-short", "tree verification's ancestor mask stops one pointer-doubling step "
           "early (deep nodes miss their farthest ancestors)", "jaxspec/tree.py",
           "for _ in range(t.bit_length()):", "for _ in range(t.bit_length() - 1):",
           (LOSSLESS, "tests/test_registry.py", "-k", "not refused")),
    Mutant("dflash-raw-marginal", "DFlash samples from the processed marginal but reports the raw one as q",
           "jaxspec/drafters/dflash.py", "draft_probs=jnp.exp(logq))", "draft_probs=jnp.exp(full))",
           (SAMPLED, "-k", "dflash")),
    Mutant("commit-drops-bonus", "the round commits the accepted drafts to the cache but not the bonus token",
           "jaxspec/speculative.py", "committed = jnp.where(active, acc.num_accepted + 1, 0)",
           "committed = jnp.where(active, acc.num_accepted, 0)", (SAMPLED, "tests/test_registry.py", "-k",
                                                                  "not wrong_q and not refused")),
    Mutant("greedy-bonus-at-root", "greedy acceptance takes the bonus from the root's argmax, not the last accepted "
           "node's", "jaxspec/verification.py", "    bonus = best[current]\n", "    bonus = best[0]\n",
           (LOSSLESS, "-k", "greedy_acceptance")),
    Mutant("tree-commit-as-chain", "an EAGLE head drafting trees claims chains, so the commit leaves a side branch's "
           "keys and values where the verification wrote them", "jaxspec/drafters/eagle.py",
           "return self.num_nodes == 1 or (self.top_k == 1 and self.choices is None and not self.lookup_depth)",
           "return True", ("tests/test_registry.py", "-k", "eagle3 and not refused")),
    Mutant("sampler-block-starts-at-zero", "the two-level inverse-CDF draw searches the right block but forgets the "
           "mass before it", "jaxspec/sampling.py", "start = jnp.where(b > 0, ends[jnp.maximum(b - 1, 0)], before)",
           "start = before", ("tests/test_generate.py", "-k", "inverse_cdf")),
)


def _dirty(paths: list[str]) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True, text=True)
    return [line[3:] for line in out.stdout.splitlines()]


def run_mutant(mutant: Mutant) -> tuple[bool, float, str]:
    """(caught, seconds, last line of pytest's output) with the mutant applied; the file restored after."""
    path = os.path.join(ROOT, mutant.path)
    with open(path) as f:
        original = f.read()
    if original.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: the text to replace occurs {original.count(mutant.old)} times in "
                         f"{mutant.path} (the code changed: update the mutant)")
    start = time.perf_counter()
    try:
        with open(path, "w") as f:
            f.write(original.replace(mutant.old, mutant.new))
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *mutant.tests]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    finally:
        with open(path, "w") as f:
            f.write(original)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return out.returncode != 0, time.perf_counter() - start, lines[-1] if lines else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = p.parse_args()
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:27s} {m.path:27s} {m.what}")
        return
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutants {sorted(unknown)}; --list shows them")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    dirty = _dirty(sorted({m.path for m in chosen}))
    if dirty:
        raise SystemExit(f"uncommitted edits in {', '.join(dirty)}: commit or stash them first (the mutants change "
                         "these files in place)")
    survived = []
    for m in chosen:
        caught, seconds, last = run_mutant(m)
        print(f"{'caught  ' if caught else 'SURVIVED'} {m.name:26s} {seconds:6.0f} s  {m.what}  [{last}]", flush=True)
        if not caught:
            survived.append(m.name)
    print(f"\n{len(chosen) - len(survived)} of {len(chosen)} mutants caught"
          + (f"; survived: {', '.join(survived)}" if survived else ""))
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
