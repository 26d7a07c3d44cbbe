#!/usr/bin/env bash
# The wheels benchmarks/gpu/run.sh installs on the GPU machine (Python 3.12, x86-64), which has
# torch, transformers, peft, safetensors, tokenizers, numpy, pyarrow, pyyaml, rich, matplotlib
# and filelock but not these: specrl's remaining pure-Python dependencies and pydantic's core.
# The versions are constraints.txt's. Run where pip reaches a registry; the wheels land in .whl/
# (git-ignored, a few MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2
ls -la .whl
