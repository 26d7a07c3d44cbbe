#!/usr/bin/env bash
# One lent GPU's checks of the static-shape decode path, in one call of the device tool (about
# 9 minutes): the tests marked gpu (CUDA graphs against the eager loop), then benchmarks/gpu/run.sh
# with arms vanilla and trie on the default 25M policy with rollout.static_decode (CUDA graphs),
# without it (eager), and on the 268M policy with it; last, a profile of a plain and a reuse step
# of each arm with graphs (benchmarks/profile_steps.py; the bench after it is cut off). Each part
# has its own time limit, so one that fails or runs long leaves the others; what comes back is
# OUT's logs and one tarball of the benches (bench.json, bench.png, metrics, profiles and logs;
# no weights or checkpoints).
#
#   benchmarks/gpu/session.sh [--dry-run] [OUT]      (OUT: default benchmarks/gpu/out, or $OUT)
#
# --dry-run: every part on the CPU at run.sh's dry-run size (the tests marked gpu skip there).
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=()
if [ "${1:-}" = "--dry-run" ]; then
  dry=(--dry-run)
  shift
fi
out=${1:-${OUT:-benchmarks/gpu/out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/specrl-site .whl/*.whl
fi
PYTHONPATH="/tmp/specrl-site:$PWD" timeout 120 "$python" -m pytest -p no:cacheprovider \
  --numprocesses=0 -q -rs -o addopts= -m gpu tests/engines/test_static_decode.py 2>&1 \
  | tee "$out/gpu-tests.log"

part() {  # part NAME SECONDS VAR=VALUE...: run.sh into $work/NAME, its output in $out/NAME.log
  local name=$1 seconds=$2
  shift 2
  env SPECRL_CACHE="$work/cache" PROFILE_ARMS= "$@" timeout "$seconds" \
    benchmarks/gpu/run.sh "${dry[@]}" "$work/$name" 2>&1 | tee "$out/$name.log"
  echo "$name: exit ${PIPESTATUS[0]}" | tee -a "$out/parts.txt"
}
part graphs-25m 200 STATIC_DECODE=1 STEPS=12 TRAIN_SIZE=128 ARMS=vanilla,trie
part eager-25m 100 STEPS=12 TRAIN_SIZE=128 ARMS=vanilla,trie
part graphs-268m 180 STATIC_DECODE=1 HIDDEN=1024 LAYERS=16 HEADS=16 SFT_STEPS=400 SFT_LR=5e-4 \
  STEPS=8 TRAIN_SIZE=64 ARMS=vanilla,trie
# last: the profile (the 25M policy from the cache), its bench cut off by the part's limit
part profile-graphs-25m 120 STATIC_DECODE=1 STEPS=12 TRAIN_SIZE=128 ARMS=vanilla \
  PROFILE_ARMS=vanilla,trie

tar -C "$work" --exclude=cache --exclude=checkpoints -czf "$out/benches.tgz" .
ls -la "$out"
