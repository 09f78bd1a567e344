#!/usr/bin/env bash
# The wheels a GPU machine of the device tool needs for `python -m bench` (it reaches no package index). Its image
# has torch, triton, accelerate, peft, tokenizers, huggingface-hub, numpy, pandas and pyarrow; it lacks pydantic,
# datasets, TRL and Liger, and its transformers is older than ours. Run here, in the repository root; the wheels
# land in .whl/ (git-ignored through .git/info/exclude), TRL 1.12 (PPO's contender) in .whl/ppo/ so that one
# `pip install .whl/*.whl` installs a single TRL. docs/benchmarks.md, "Users' shapes on a GPU", has the command there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && touch .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
pin() { grep -i -m1 "^$1==" constraints.txt; }
download() {
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
download -d .whl \
  "$(pin pydantic)" "$(pin pydantic_core)" "$(pin annotated-types)" "$(pin typing-inspection)" \
  "$(pin datasets)" "$(pin dill)" "$(pin multiprocess)" "$(pin xxhash)" "$(pin transformers)" "$(pin trl)" \
  "liger-kernel==0.8.5"
download -d .whl/ppo trl==1.12.0
du -sh .whl
