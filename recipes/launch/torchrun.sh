#!/usr/bin/env bash
# Run a recipe (RECIPE, default recipes/pretrain_gpt.py) under torchrun so that the job recovers by itself when a
# process dies.
#
# When any process fails (killed, out of memory, a crash, a lost node), torchrun stops the others and starts all
# of them again, up to MAX_RESTARTS times. Every attempt runs the same command, and the pretraining recipe resumes
# from the newest complete checkpoint in <save_dir>/checkpoints (--ckpt_path last, its default too; checkpoints are
# written every checkpoint.every_n_train_steps steps): a restart loses at most the steps since that checkpoint. The
# fine-tuning recipe writes no periodic checkpoints (enable_checkpointing: false): a restart fine-tunes anew.
#
# Usage (from the repository root; arguments after the script go to the recipe's `fit`, in LightningCLI syntax):
#   recipes/launch/torchrun.sh                                         # one node, 4 processes, the yaml layout
#   NPROC_PER_NODE=2 recipes/launch/torchrun.sh --trainer.strategy.tp 1 --trainer.strategy.pp 1 --trainer.max_steps 100
#   # two nodes: the same line on each, RDZV_ENDPOINT a host:port that every node reaches (the first node's)
#   NNODES=2 RDZV_ENDPOINT=node0:29400 NPROC_PER_NODE=8 recipes/launch/torchrun.sh --trainer.accelerator gpu \
#     --trainer.strategy.tp 8
#   # the fine-tuning recipe, with a cluster config (its devices and nodes must be NPROC_PER_NODE and NNODES)
#   RECIPE=recipes/finetune_hf.py NPROC_PER_NODE=8 recipes/launch/torchrun.sh \
#     --config recipes/configs/llama3_8b_1x8_h100.yaml --pretrained /ckpt/Meta-Llama-3-8B
#
# --trainer.devices and --trainer.num_nodes come last, after the arguments (a --config among them included), so
# that they always match the processes torchrun starts.
#
# Environment: RECIPE (recipes/pretrain_gpt.py), NPROC_PER_NODE (4), NNODES (1), MAX_RESTARTS (3), RDZV_ENDPOINT
# (needed when NNODES > 1), RDZV_ID (a name shared by the nodes of one job; default the SLURM job id, else the
# recipe's name), PYTHON (python).
set -euo pipefail

RECIPE=${RECIPE:-recipes/pretrain_gpt.py}
NPROC_PER_NODE=${NPROC_PER_NODE:-4}
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-3}
PYTHON=${PYTHON:-python}
# Checked here: torchrun would otherwise start every process, each failing on the missing file, MAX_RESTARTS times.
[[ -f "$RECIPE" ]] || { echo "RECIPE=$RECIPE: no such file (run from the repository root)" >&2; exit 2; }

if [[ "$NNODES" == 1 ]]; then
  # One node: torchrun starts its own rendezvous on a free local port.
  rendezvous=(--standalone)
else
  : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port (reachable from every node) when NNODES > 1}"
  # c10d rendezvous: the nodes meet at RDZV_ENDPOINT; after a failure the restarted nodes meet there again.
  rendezvous=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-$(basename "$RECIPE" .py)}}")
fi

# Several processes share a node's cores: one OpenMP thread each unless the caller chose otherwise.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" "${rendezvous[@]}" \
  "$RECIPE" fit --ckpt_path last "$@" --trainer.devices "$NPROC_PER_NODE" --trainer.num_nodes "$NNODES"
