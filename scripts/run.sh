#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the most complete example trainer
# available. Extra arguments go to the trainer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup.sh
echo "== running examples/linear_regression"
build/examples/linear_regression "$@"
