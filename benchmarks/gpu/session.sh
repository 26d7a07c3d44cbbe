#!/usr/bin/env bash
# One lent GPU's checks of the static-shape decode path, in one call of the device tool (under
# 10 minutes): the tests marked gpu (CUDA graphs against the eager loop, with and without
# drafts), then benchmarks/gpu/run.sh with rollout.static_decode (CUDA graphs) on the default 25M
# policy and on the 268M policy, arms vanilla, trie and tree (the trie arm's tails and the tree arm
# decode with tree drafts, as graphs since c54416f; at 315af38 the tree arm, which never verifies,
# was the fastest graph arm at 25M; the 268M part took 168 s with two arms); then both
# sizes' arms vanilla and trie without graphs (eager-25m, eager-268m; the policies from the
# cache; on an H200 at 680f630 the first three took 370 s with the tests, eager-268m alone 165 s
# with its policy built). PARTS picks the parts, in order (default "graphs-25m graphs-268m
# eager-25m eager-268m"); profile-graphs-25m profiles a plain and a reuse step of each arm with
# graphs (benchmarks/profile_steps.py; the bench after it is cut off); lookup-25m runs
# the 25M arms vanilla and trie with graphs and prompt lookup drafts
# (rollout.spec.tree.prompt_lookup=3: off by default, measured no faster on the CPU,
# docs/trees.md). ARMS sets every part's arms (the profile's, after a vanilla bench);
# GPU_TESTS=0 skips the tests. Each part has its own time limit, so one that fails or runs long
# leaves the others, and none runs past BUDGET_S seconds from the start (default 560: the
# tarball is written inside a 600 s device call); what comes back is OUT's logs and one tarball
# of the benches (bench.json, bench.png, metrics, profiles and logs; no weights or checkpoints).
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
[ "${GPU_TESTS:-1}" = 0 ] || PYTHONPATH="/tmp/specrl-site:$PWD" timeout 90 "$python" -m pytest -p no:cacheprovider \
  --numprocesses=0 -q -rs -o addopts= -m gpu tests/engines/test_static_decode.py 2>&1 \
  | tee "$out/gpu-tests.log"

part() {  # part NAME SECONDS VAR=VALUE...: run.sh into $work/NAME, its output in $out/NAME.log
  local name=$1 seconds=$2 left=$((${BUDGET_S:-560} - SECONDS))
  shift 2
  if [ "$left" -lt "$seconds" ]; then seconds=$left; fi
  if [ "$seconds" -lt 30 ]; then
    echo "$name: skipped, ${left} s left of BUDGET_S" | tee -a "$out/parts.txt"
    return
  fi
  env SPECRL_CACHE="$work/cache" PROFILE_ARMS= "$@" timeout "$seconds" \
    benchmarks/gpu/run.sh "${dry[@]}" "$work/$name" 2>&1 | tee "$out/$name.log"
  echo "$name: exit ${PIPESTATUS[0]}" | tee -a "$out/parts.txt"
}
for name in ${PARTS:-graphs-25m graphs-268m eager-25m eager-268m}; do
  case $name in
    graphs-25m) part "$name" 220 STATIC_DECODE=1 STEPS=12 TRAIN_SIZE=128 ARMS=${ARMS:-vanilla,trie,tree} ;;
    eager-25m) part "$name" 130 STEPS=12 TRAIN_SIZE=128 ARMS=${ARMS:-vanilla,trie} ;;
    lookup-25m) part "$name" 150 STATIC_DECODE=1 STEPS=12 TRAIN_SIZE=128 ARMS=${ARMS:-vanilla,trie} \
      EXTRA=rollout.spec.tree.prompt_lookup=3 ;;
    graphs-268m) part "$name" 230 STATIC_DECODE=1 HIDDEN=1024 LAYERS=16 HEADS=16 SFT_STEPS=400 \
      SFT_LR=5e-4 STEPS=8 TRAIN_SIZE=64 ARMS=${ARMS:-vanilla,trie,tree} ;;
    eager-268m) part "$name" 200 HIDDEN=1024 LAYERS=16 HEADS=16 SFT_STEPS=400 SFT_LR=5e-4 \
      STEPS=8 TRAIN_SIZE=64 ARMS=${ARMS:-vanilla,trie} ;;
    # the profile; the bench after it is cut off by the part's limit
    profile-graphs-25m) part "$name" 150 STATIC_DECODE=1 STEPS=12 TRAIN_SIZE=128 ARMS=vanilla \
      PROFILE_ARMS=${ARMS:-vanilla,trie} ;;
    *) echo "unknown part $name" >&2 ;;
  esac
done

tar -C "$work" --exclude=cache --exclude=checkpoints -czf "$out/benches.tgz" .
ls -la "$out"
