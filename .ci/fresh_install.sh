#!/usr/bin/env bash
# The README's first command on a fresh virtualenv: `pip install -e .` alone (no extras, nothing carried over
# from the test environment), then the default recipe through every stage at a reduced size. Fails if the
# run exits non-zero or leaves no report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
venv="$(mktemp -d)/venv"
workdir="$(mktemp -d)/run"
python -m venv "$venv"
"$venv/bin/pip" install -q -e .
start=$(date +%s)
(cd "$(dirname "$workdir")" && "$venv/bin/python" -m guijax.launch --workdir="$workdir" \
  --config.sft.steps=4 --config.train.iterations=1 --config.train.ppo_epochs=1 \
  --config.bepa.base_pass_k=1 --config.bepa.level1_rollouts=1 --config.eval.episodes_per_task=1 \
  --config.compilation_cache_dir=)
test -s "$workdir/report.md" || { echo "fresh install: the default recipe wrote no report.md in $workdir"; exit 1; }
echo "fresh install: the default recipe ran every stage in $(( $(date +%s) - start ))s and wrote $workdir/report.md"
