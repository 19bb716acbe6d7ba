#!/usr/bin/env bash
# Plots trainer runs from their --metrics files into a PNG (scripts/plot_metrics.py, whose
# --help lists its arguments), installing matplotlib from Debian first when it is missing.
#   scripts/plot_metrics.sh out.png run.jsonl[=label] ... [--smooth N] [--title T] [--val label=value ...]
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh" "$@"
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/install_packages.sh"
install_packages python3-matplotlib
exec /usr/bin/python3 "$(dirname "${BASH_SOURCE[0]}")/plot_metrics.py" "$@"
