#!/usr/bin/env bash
# Issue 16 on an accelerator: regenerate the training data and train the EAGLE-3 head of SmolLM2-135M-Instruct on
# one GPU or TPU, in minutes instead of CPU days, then export the drafter for shipping.
#
# 1. `jaxspec regenerate`: the target's greedy float32 answers to ShareGPT prompts 0..NUM_PROMPTS-1 (templated
#    prompts up to 128 tokens, answers up to 256), tokens only: on an accelerator the trainer runs the frozen target
#    inside each training step (cheaper there than writing and reading 4.6 KB of features per token). Prompts from
#    NUM_PROMPTS on stay out of training: the held-out set is regenerated from them (see configs/eagle3-smollm2-135m.yaml).
# 2. `jaxspec train`: the shipped head grown to DRAFT_VOCAB tokens and fine-tuned STEPS updates at batch BATCH.
# 3. `jaxspec export`: bfloat16 storage, ready to replace jaxspec/drafters/shipped/eagle3-smollm2-135m.
#
# Each phase stops at its time limit and keeps what it finished: regeneration keeps its finished shards, and a
# training run cut short is resumed with run.steps set to its last checkpoint, which writes the drafter of that step.
# Rerunning the script resumes every phase.
#
#   bash scripts/train_on_accelerator.sh                      # WORK=runs/accelerator, the sizes below
#   REGEN_SECONDS=120 TRAIN_SECONDS=180 bash scripts/train_on_accelerator.sh
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/accelerator}
JAXSPEC=${JAXSPEC:-jaxspec}
NUM_PROMPTS=${NUM_PROMPTS:-9000}
REGEN_BATCH=${REGEN_BATCH:-256}
REGEN_SECONDS=${REGEN_SECONDS:-600}
STEPS=${STEPS:-400}
BATCH=${BATCH:-64}
LR=${LR:-1e-3}
WARMUP=${WARMUP:-20}
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}
TRAIN_SECONDS=${TRAIN_SECONDS:-1200}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
mkdir -p "$WORK"

echo "== regenerate ($(date +%T)): prompts 0-$((NUM_PROMPTS - 1)), batch $REGEN_BATCH, at most ${REGEN_SECONDS}s"
timeout "$REGEN_SECONDS" $JAXSPEC regenerate --out "$WORK/data" --num-prompts "$NUM_PROMPTS" --dtype float32 \
    --max-prompt-tokens 128 --max-new-tokens "$MAX_NEW_TOKENS" --batch-size "$REGEN_BATCH" --shard-size 256 \
    --layers stacked --no-progress
echo "regenerate exit $? ($(date +%T))"
python -c "import json; print(json.load(open('$WORK/data/manifest.json'))['counts'])"

TRAIN=($JAXSPEC train --config configs/eagle3-smollm2-135m.yaml --set data.path="$WORK/data"
       --set run.out_dir="$WORK/eagle3" --set run.init_from=jaxspec/drafters/shipped/eagle3-smollm2-135m
       --set drafter.draft_vocab_size="$DRAFT_VOCAB" --set run.batch_size="$BATCH" --set run.save_every=25
       --set run.eval_every=0 --set run.log_every=10 --set optim.learning_rate="$LR"
       --set optim.warmup_steps="$WARMUP" --no-progress)
echo "== train ($(date +%T)): $STEPS steps at batch $BATCH, at most ${TRAIN_SECONDS}s"
timeout "$TRAIN_SECONDS" "${TRAIN[@]}" --set run.steps="$STEPS"
echo "train exit $? ($(date +%T))"
if [[ ! -d "$WORK/eagle3/drafter" ]]; then  # cut short: finish at the last checkpoint
    last=$(ls "$WORK/eagle3/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1)
    if [[ -n "$last" ]]; then
        echo "== the drafter of step $last"
        "${TRAIN[@]}" --set run.steps="$last"
    fi
fi
if [[ -d "$WORK/eagle3/drafter" ]]; then
    $JAXSPEC export --drafter "$WORK/eagle3/drafter" --out "$WORK/eagle3-export" --storage-dtype bfloat16
    echo "exported to $WORK/eagle3-export ($(date +%T))"
fi
