#!/usr/bin/env bash
# Issue 16's training data: SmolLM2-135M-Instruct answers the ShareGPT prompts (templated prompts up to 128 tokens,
# answers up to 256), greedy, with the residual stream after layers 2, 15, 27 and 29 saved while generating (what
# EAGLE-3 trains on; 29 is the last layer, for the target's own logits), so training never runs the target again.
# Batch 64 (BATCH=N for another: on the Intel Xeon of 2026-12-07, 256 made 257 tok/s against 203 at 64; a run
# may resume with another batch size). The CPU weight layout is measured at start (--layers auto, about a minute:
# per-layer buffers won clearly on an AMD EPYC; on the Intel Xeon of 2026-12-04 a batch-64 step took 281 ms
# per-layer against 295 ms stacked).
#
# Runs in the background at low priority and resumes where it stopped: rerun the same command after any
# interruption (finished shards are kept, checked by sha256). Progress: tail -f logs/regenerate-FOLDER.log; the counts
# (samples, response tokens, disk bytes) are in data/regen-smollm2-135m-b64/manifest.json.
#
#   bash scripts/regenerate_data.sh            # start or resume in the background
#   bash scripts/regenerate_data.sh --wait     # the same in the foreground
#
# The code-and-math set (issue 16: the evaluation sets ask for code and arithmetic, most ShareGPT prompts do not):
# the ShareGPT prompts from 2916 on (past the first folder's shards 0-32) that ask for code or math, in its own folder:
#   OUT=data/regen-smollm2-135m-codemath FIRST_PROMPT=2916 TOPICS=code,math bash scripts/regenerate_data.sh
# and the rest of those prompts, without overlap (the first folder stops at shard 32: do not resume it past there):
#   OUT=data/regen-smollm2-135m-other FIRST_PROMPT=2916 TOPICS=other bash scripts/regenerate_data.sh
# Those folders trained stages 7-9 (the "other" one reached prompt 6631). The next data, prompts no head has seen
# (started 2026-12-07 on the Intel Xeon; resume it with the same command):
#   OUT=data/regen-smollm2-135m-p7000 FIRST_PROMPT=7000 BATCH=256 bash scripts/regenerate_data.sh
# Prompts in the evaluation sets' forms, none of their items (the sixteenth session; scripts/make_prompts.py):
#   .venv/bin/python scripts/make_prompts.py --kind code --count 2000 --out data/prompts-code.jsonl
#   .venv/bin/python scripts/make_prompts.py --kind math --count 1500 --out data/prompts-math.jsonl
#   OUT=data/regen-smollm2-135m-code PROMPTS=data/prompts-code.jsonl MAX_PROMPT_TOKENS=256 BATCH=128 bash scripts/regenerate_data.sh
#   OUT=data/regen-smollm2-135m-math PROMPTS=data/prompts-math.jsonl BATCH=256 bash scripts/regenerate_data.sh
# All the code prompts the installed packages give (3,940 on the AMD EPYC of 2026-12-08 with llama-cpp-python
# installed; 3,796 fit 256 tokens), and new arithmetic problems (another seed), for the next stage (started
# 2026-12-08, the twenty-first session; resume with the same commands):
#   .venv/bin/python scripts/make_prompts.py --kind code --count 100000 --out data/prompts-code-all.jsonl
#   .venv/bin/python scripts/make_prompts.py --kind math --count 1500 --seed 1 --out data/prompts-math-s1.jsonl
#   OUT=data/regen-smollm2-135m-code2 PROMPTS=data/prompts-code-all.jsonl MAX_PROMPT_TOKENS=256 BATCH=128 bash scripts/regenerate_data.sh
#   OUT=data/regen-smollm2-135m-math2 PROMPTS=data/prompts-math-s1.jsonl BATCH=256 bash scripts/regenerate_data.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-data/regen-smollm2-135m-b64}
mkdir -p logs
PROMPT_ARGS=()
if [[ -n "${PROMPTS:-}" ]]; then PROMPT_ARGS=(--prompts "$PROMPTS"); fi
CMD=(nice -n 19 .venv/bin/jaxspec regenerate --out "$OUT" --max-prompt-tokens "${MAX_PROMPT_TOKENS:-128}" --max-new-tokens 256
     --batch-size "${BATCH:-64}" --shard-size 64 --layers auto --feature-layers 2,15,27,29
     --first-prompt "${FIRST_PROMPT:-0}" --topics "${TOPICS:-all}" "${PROMPT_ARGS[@]}")
if [[ "${1:-}" == "--wait" ]]; then
    exec "${CMD[@]}"
fi
nohup "${CMD[@]}" >> "logs/regenerate-$(basename "$OUT").log" 2>&1 &
echo "regenerating in the background (pid $!): tail -f logs/regenerate-$(basename "$OUT").log"
