#!/bin/bash
# SmolLM2 training steps with glibc keeping freed memory (specrl's setting, specrl/host_memory.py)
# against glibc's defaults (MALLOC_TRIM_THRESHOLD_=131072, glibc's default value, makes specrl
# leave malloc alone): `specrl train` with issue 53's check config (chain_sum, LoRA rank 8, 4 steps),
# the two settings taking turns, each in its own process, then a summary per run.
#
#   benchmarks/host_memory_steps.sh DATA_DIR OUT [TURNS]
#
# DATA_DIR: `specrl data chain_sum --out DATA_DIR --train-size 64 --val-size 64 --seed 239
# min_terms=2 max_terms=3 max_digits=1`. Run alone: it measures the machine.
set -euo pipefail
data=$1 out=$2 turns=${3:-2}
mkdir -p "$out"
for turn in $(seq "$turns"); do
  for setting in kept glibc; do
    run=(env -u MALLOC_TRIM_THRESHOLD_ -u MALLOC_MMAP_THRESHOLD_ -u GLIBC_TUNABLES)
    [ "$setting" = glibc ] && run+=(MALLOC_TRIM_THRESHOLD_=131072)
    "${run[@]}" specrl train trainer.output_dir="$out/$setting$turn" trainer.logger=[jsonl] \
      model.path=builtin:smollm2-135m-instruct data.train_files="$data/train.parquet" \
      data.val_files="$data/val.parquet" data.max_prompt_length=160 data.max_response_length=48 \
      data.train_batch_size=4 rollout.n=8 actor.ppo_mini_batch_size=4 actor.ppo_micro_batch_size=8 \
      trainer.total_training_steps=4 trainer.test_freq=100 trainer.num_threads=2 actor.lora.rank=8 \
      actor.optim.lr=2e-4 > "$out/$setting$turn.log" 2>&1
  done
done
python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
for run in sorted(p for p in out.iterdir() if p.is_dir()):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    rows = [r for r in rows if "timing_s/rollout" in r]
    total = lambda key: round(sum(r[key] for r in rows), 2)
    summary[run.name] = {
        "rollout_s": total("timing_s/rollout"), "update_s": total("timing_s/update_actor"),
        "step_s": total("timing_s/step"), "decode_forward_s": total("timing_s/forward/decode"),
        "update_s_per_step": [round(r["timing_s/update_actor"], 2) for r in rows],
        "response_length": [r["response_length/mean"] for r in rows],
    }
    print(run.name, summary[run.name])
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
PY
