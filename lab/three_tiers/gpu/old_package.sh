#!/usr/bin/env bash
# Usage (on this machine, before a device call that carries .old): old_package.sh COMMIT: COMMIT's od_moe,
# predictor/ and training/ (od_moe.predictor and od_moe.training: `od_moe/__init__.py` finds them beside it)
# into .old/, without the bundled models (the rows name their model), for before_after.sh's "before".
set -euo pipefail
rm -rf .old && mkdir -p .old
git archive "$1" od_moe predictor training | tar -x -C .old
rm -rf .old/od_moe/models
du -sh .old
