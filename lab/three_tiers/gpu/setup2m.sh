#!/usr/bin/env bash
# Call 2 (carries .whl/b): MLX into /tmp/site, the Qwen3-30B-A3B shape and the bundled model at real widths
# built into /tmp/rs, then `memory.sh q30 32 32` (od-moe generate within its budget, a cgroup at it).
set -uo pipefail
source lab/three_tiers/gpu/install_and_build.sh qwen3-30b-a3b bundled-real-widths
lab/three_tiers/gpu/memory.sh q30 32 32
