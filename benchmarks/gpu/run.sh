#!/usr/bin/env bash
# The GPU benchmark in one call: on a fresh single-GPU machine (the torch already there, no
# package registry), build a larger built-in policy of the default task on the GPU, run the bench
# arms on the transformers engine on CUDA for a shortened run, price the same trace for the
# same device with the cost model (a projection, next to what was measured), and, first, profile
# a plain and a reuse step of some arms (benchmarks/profile_steps.py).
#
#   benchmarks/gpu/run.sh [--dry-run] [OUT]       (OUT: default benchmarks/gpu/out, or $OUT)
#
# specrl runs from this working tree (PYTHONPATH); the pure-Python dependencies that machine
# lacks travel as wheels in .whl/ (benchmarks/gpu/wheels.sh, run where pip works). --dry-run runs
# every command with a tiny policy and run on the CPU: what CI checks.
# Sizes and lengths: HIDDEN, LAYERS, HEADS, SFT_STEPS, SFT_LR, STEPS, TRAIN_SIZE (environment);
# ARMS: the bench's arms; PROFILE_ARMS: the arms profiled (none: no profile), each over the first
# step of epochs 0 and 1 (torch.profiler) and the second of epoch 1 (cProfile); STATIC_DECODE=1:
# the transformers engine decodes at static shapes, as CUDA graphs (rollout.static_decode; the
# dry run decodes so, eagerly, on the CPU); EXTRA: more config overrides for every arm (words).
set -euo pipefail
cd "$(dirname "$0")/../.."
dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
out=${1:-${OUT:-benchmarks/gpu/out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}

if compgen -G ".whl/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/specrl-site .whl/*.whl
  export PYTHONPATH=/tmp/specrl-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPECRL_CACHE=${SPECRL_CACHE:-$out/cache}
export PYTHONUNBUFFERED=1

if [ "$dry" = 1 ]; then
  device=cpu
  build=(--hidden-size 32 --layers 1 --heads 2 --sft-steps 20)
  # two epochs of two steps: the second reuses the first's rollouts
  run=(data.train_size=8 data.val_size=8 data.train_batch_size=4 rollout.n=2
       actor.ppo_mini_batch_size=4 trainer.total_training_steps=4 trainer.test_freq=4
       trainer.num_threads=1 rollout.static_decode=true)
  project_device=h100
else
  device=cuda
  build=(--hidden-size "${HIDDEN:-512}" --layers "${LAYERS:-8}" --heads "${HEADS:-8}"
         --sft-steps "${SFT_STEPS:-800}" --sft-lr "${SFT_LR:-1e-3}")
  # the default task, shortened: TRAIN_SIZE / 32 steps per epoch, reuse from the second
  run=(data.train_size="${TRAIN_SIZE:-256}" data.val_size=256
       trainer.total_training_steps="${STEPS:-24}" trainer.test_freq=8
       trainer.n_gpus_per_node=1 model.dtype=bfloat16)
  if [ "${STATIC_DECODE:-0}" = 1 ]; then run+=(rollout.static_decode=true); fi
  name=$("$python" -c "import torch; print(torch.cuda.get_device_name())")
  case "$name" in *H200*) project_device=h200 ;; *) project_device=h100 ;; esac
fi
if [ -n "${EXTRA:-}" ]; then
  read -r -a extra <<< "$EXTRA"
  run+=("${extra[@]}")
fi

{
  echo "date: $(date -u +%FT%TZ)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$python" -c "import platform, torch; print('python', platform.python_version(), 'torch', \
torch.__version__, 'cuda', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
} | tee "$out/machine.txt"

started=$(date +%s)
policy=$("$python" -m specrl toy-policy --device "$device" "${build[@]}" | tail -n 1)
echo "policy: $policy (built in $(($(date +%s) - started)) s)" | tee -a "$out/machine.txt"

per_epoch=$(( ${TRAIN_SIZE:-256} / 32 ))
if [ "$dry" = 1 ]; then per_epoch=2; fi
# where a step's time goes, by op and by Python function
if [ -n "${PROFILE_ARMS-vanilla,trie,spec+tree}" ]; then
  "$python" benchmarks/profile_steps.py --out "$out/profile" \
    --arms "${PROFILE_ARMS-vanilla,trie,spec+tree}" --steps "1,$((per_epoch + 1))" \
    --python-steps "$((per_epoch + 2))" model.path="$policy" "${run[@]}"
fi
# the arms take turns step by step: each window of every arm is timed over the same minutes
"$python" -m specrl bench --interleave --out "$out/bench" \
  --arms "${ARMS:-vanilla,spec,trie,trie+tree,spec+tree}" model.path="$policy" \
  trainer.logger=[jsonl] "${run[@]}"
"$python" -m specrl project "$out/bench" --device "$project_device" \
  --model "$policy/config.json" --stretch 1,20
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"

"$python" - "$out" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
bench = json.loads((out / "bench" / "bench.json").read_text())
projection = json.loads(next((out / "bench").glob("projection-*.json")).read_text())
check = bench.get("cost_model_check", {}).get("arms", {})
print("arm          measured rollout s   speedup   cost model here (residual)   projected s (x1)")
for arm, summary in bench["arms"].items():
    projected = projection["projections"][0]["arms"][arm]["projected_rollout_s"]
    here = check.get(arm, {})
    print(
        f"{arm:12} {summary['rollout_time_s']:18.2f} {summary['rollout_speedup']:9.2f}"
        f" {here.get('predicted_s', float('nan')):14.2f} ({here.get('residual', float('nan')):+.1%})"
        f" {projected:18.2f}"
    )
EOF
