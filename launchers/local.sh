#!/usr/bin/env bash
# One node: `reshard run` under torchrun, with as many processes as the two layouts use.
#
#   launchers/local.sh --src TRAIN.yaml --dst INFER.yaml [run options]
#   e.g. launchers/local.sh --src layouts/demo/train.yaml --dst layouts/demo/infer.yaml --quiet
#
# The process count is the highest global rank of either layout + 1 (src ranks from 0, dst right after);
# every process runs `python -m reshard_cli run ARGS` as a torchrun worker (ranks beyond the two groups idle).
# `reshard run` alone does the same in-process; this script is the explicit torchrun form.
# Environment: PYTHON (default python3), TORCHRUN_ARGS (extra torchrun options, e.g. "--master-port 29600"),
# OMP_NUM_THREADS (default 1 per worker).
set -euo pipefail

PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # a checkout works without `pip install -e .`
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    [ $# -eq 0 ] && exit 2 || exit 0
fi

# the process count from the layouts (a bad layout is a one-line error, exit 2)
N=$("$PYTHON" -m reshard_cli.transfer.dryrun world-size "$@")

# torchrun == python -m torch.distributed.run; the module form keeps the same interpreter as above
# shellcheck disable=SC2086
set -- --standalone --nproc-per-node "$N" ${TORCHRUN_ARGS:-} -m reshard_cli run "$@"
echo "+ torchrun $*" >&2
exec "$PYTHON" -m torch.distributed.run "$@"
