"""Stores a head's measured acceptance in its drafter folder, so that --budget auto reads it instead of running the
calibration prompts on first use: an EAGLE head's draft ranks (jaxspec.methods.save_draft_ranks), a block head's
tokens per round at each auto budget (DFlash, DDTree, JetSpec: jaxspec.methods.save_budget_taus).

    .venv/bin/python scripts/calibrate_drafter.py --drafter jaxspec/drafters/shipped/eagle3-smollm2-135m
    .venv/bin/python scripts/calibrate_drafter.py --method jetspec --drafter runs/jetspec-smollm2-135m/drafter

The ranks are those of the head along the target's own greedy answers to jaxspec.methods.CALIBRATION_PROMPTS, the
taus those of the decoding loop on the first of them; each file records the target, the head and the calibration
settings, and is ignored when any differs.
"""

import argparse
import sys

from jaxspec.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="a drafter folder written by `jaxspec train`")
    parser.add_argument("--method", default="eagle3", choices=("eagle2", "eagle3", "dflash", "ddtree", "jetspec"))
    parser.add_argument("--model", default="smollm2-135m", help="the target the drafter was trained for")
    args = parser.parse_args(argv)
    from jaxspec.loading import load_model
    from jaxspec.methods import MethodOptions, auto_budgets, load_learned_drafter, save_budget_taus, save_draft_ranks
    from jaxspec.registry import method_spec

    try:
        target = load_model(args.model)
        drafter, params = load_learned_drafter(args.method, target, args.drafter, MethodOptions(drafter=args.drafter))
        if args.method in ("dflash", "ddtree", "jetspec"):
            budgets = auto_budgets(drafter, method_spec(args.method))
            print(f"wrote {save_budget_taus(args.drafter, target, drafter, params, budgets)}")
            return 0
        if getattr(drafter, "choices", None) is not None:
            raise UserError("This head drafts a fixed tree (tree_choices); draft ranks serve dynamic trees only.")
        print(f"wrote {save_draft_ranks(args.drafter, target, drafter, params)}")
    except UserError as e:
        print(f"calibrate_drafter: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
