#!/usr/bin/env bash
# Run a guijax recipe on every worker of a Cloud TPU pod slice.
#
#   launch/tpu_pod.sh TPU_NAME ZONE bepa_tpu [--config.key=value ...]
#
# Every worker runs the same command; guijax.launch detects the pod and calls jax.distributed.initialize()
# before touching devices. The repository must already be at $GUIJAX_DIR on every worker (e.g. a shared
# disk or `gcloud compute tpus tpu-vm scp --worker=all`), and the workdir on a path all workers share
# (a GCS bucket mounted with gcsfuse, or NFS) so checkpoints land in one place.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 TPU_NAME ZONE CONFIG [--config.key=value ...]" >&2
  exit 2
fi
TPU_NAME=$1; ZONE=$2; CONFIG=$3; shift 3
GUIJAX_DIR=${GUIJAX_DIR:-~/guijax}
WORKDIR=${WORKDIR:-/mnt/shared/guijax_runs/$CONFIG}
EXTRA=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  set -e
  cd $GUIJAX_DIR
  pip install -q -e '.[tpu]'
  python -m guijax.launch --config=$CONFIG --workdir=$WORKDIR $EXTRA 2>&1 | tee -a /tmp/guijax_\$(hostname).log
"
