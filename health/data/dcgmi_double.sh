#!/bin/sh
# TEST DOUBLE -- this is NOT NVIDIA's dcgmi. It exists because DCGM cannot run on the CPU test cluster.
# It prints a recorded `dcgmi diag -j` document and exits with a recorded status, so the Slurm end-to-end tests can
# make chosen nodes pass or fail the DCGM check. Installed by moe_launch.health.dcgm_double.install_double() as
#   $MOE_HEALTH_DCGMI_DIR/<node>/dcgmi  next to  recorded.json (the document) and recorded.rc (the exit status).
here=$(dirname "$0")
if [ "$1" != "diag" ]; then
  echo "dcgmi test double: only 'dcgmi diag' is recorded (got: $*)" >&2
  exit 2
fi
cat "$here/recorded.json"
exit "$(cat "$here/recorded.rc" 2>/dev/null || echo 0)"
