#!/usr/bin/env bash
# Issue 16: the block heads (JetSpec's tree-causal head, then DFlash's, which DDTree drafts from) trained on the
# regenerated answers the shipped EAGLE-3 head trains on, one after the other, in the background. Resumable: rerun
# the same command after an interruption (each run resumes from its last checkpoint; a finished one is skipped).
# Progress: tail -f logs/train-jetspec.log logs/train-dflash.log
#
#   bash scripts/train_block_heads.sh            # in the background
#   bash scripts/train_block_heads.sh --wait     # in the foreground
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p logs
run_all() {
    for method in jetspec dflash; do
        if [[ -d "runs/$method-smollm2-135m/drafter" ]]; then
            echo "$method: runs/$method-smollm2-135m/drafter exists, skipped"
            continue
        fi
        .venv/bin/jaxspec train --config "configs/$method-smollm2-135m.yaml" >> "logs/train-$method.log" 2>&1
    done
}
if [[ "${1:-}" == "--wait" ]]; then
    run_all
else
    nohup bash -c "$(declare -f run_all); run_all" > /dev/null 2>&1 &
    echo "training in the background (pid $!): tail -f logs/train-jetspec.log logs/train-dflash.log"
fi
