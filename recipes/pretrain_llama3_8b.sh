#!/usr/bin/env bash
# Llama-3-8B-shaped pretraining with the FP8 blockwise plugin: TP=8 with sequence parallelism within a
# node of 8 GPUs, PyTorch's fused attention (model.attention=sdpa: cuDNN / flash kernels; Megatron's
# unfused attention would write the [b*heads, 8192, 8192] score matrix to memory at this sequence
# length), the distributed optimizer. More nodes add data parallelism (NNODES, NODE_RANK, MASTER_ADDR
# on each node, or a Slurm allocation of several nodes: see below).
#
#   DATA_PREFIX=/data/corpus_text_document TOKENIZER=/models/Meta-Llama-3-8B recipes/pretrain_llama3_8b.sh \
#       [--dry-run | --check] [OVERRIDES...]
#
# DATA_PREFIX: a Megatron indexed dataset (the .bin/.idx prefix; scripts/prepare_data.py makes one).
# TOKENIZER: the tokenizer the data was made with (a Hugging Face name, a tokenizer.json or a directory
# holding one); it sets the model's vocabulary (unset: the byte tokenizer's 257 ids), and the start-up check
# stops the run, naming data.tokenizer, when the data holds ids outside it. Data tokenized elsewhere without a tokenizer file: TOKENIZER=null VOCAB_SIZE=128256. Extra
# arguments are the launcher's options and Hydra overrides, which win over the recipe's. Outputs go to
# outputs/llama3_8b (checkpoints in outputs/llama3_8b/checkpoints) under the directory you run it from.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$ROOT/scripts/launch_pretrain.sh" ] || ROOT="${SLURM_SUBMIT_DIR:-$PWD}"  # sbatch runs a copy of this file
export LAUNCH_RECIPE="$ROOT/recipes/pretrain_llama3_8b.sh"
exec bash "$ROOT/scripts/launch_pretrain.sh" --gpus 8 \
  model=llama3_8b model.attention=sdpa fp8=blockwise parallel=tp2_sp parallel.tp=8 parallel.use_distributed_optimizer=true \
  data=indexed ${DATA_PREFIX:+"data.path=$DATA_PREFIX"} \
  ${TOKENIZER:+"data.tokenizer=$TOKENIZER"} ${VOCAB_SIZE:+"data.vocab_size=$VOCAB_SIZE"} \
  train.steps=10000 train.micro_batch_size=1 train.global_batch_size=512 train.lr=3e-4 train.min_lr=3e-5 \
  train.warmup_steps=500 checkpoint=periodic checkpoint.dir=outputs/llama3_8b/checkpoints \
  logging.dir=outputs/llama3_8b "$@"
