"""Stores an EAGLE head's measured draft ranks in its drafter folder (jaxspec.methods.save_draft_ranks), so that
eagle2/eagle3 with --budget auto read them instead of running the calibration prompts on first use.

    .venv/bin/python scripts/calibrate_drafter.py --drafter jaxspec/drafters/shipped/eagle3-smollm2-135m

The ranks are those of the head along the target's own greedy answers to jaxspec.methods.CALIBRATION_PROMPTS; the
file records the target's fingerprint and the calibration settings, and is ignored when either differs.
"""

import argparse
import sys

from jaxspec.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="a drafter folder written by `jaxspec train` (an EAGLE head)")
    parser.add_argument("--method", default="eagle3", choices=("eagle2", "eagle3"))
    parser.add_argument("--model", default="smollm2-135m", help="the target the drafter was trained for")
    args = parser.parse_args(argv)
    from jaxspec.loading import load_model
    from jaxspec.methods import MethodOptions, load_learned_drafter, save_draft_ranks

    try:
        target = load_model(args.model)
        drafter, params = load_learned_drafter(args.method, target, args.drafter, MethodOptions(drafter=args.drafter))
        if getattr(drafter, "choices", None) is not None:
            raise UserError("This head drafts a fixed tree (tree_choices); draft ranks serve dynamic trees only.")
        print(f"wrote {save_draft_ranks(args.drafter, target, drafter, params)}")
    except UserError as e:
        print(f"calibrate_drafter: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
