#!/usr/bin/env bash
# Llama-3-8B-shaped pretraining with the FP8 blockwise plugin: TP=8 with sequence parallelism on one
# node of 8 GPUs (add nodes for data parallelism: sbatch -N <nodes> this script). Point data.path at
# a Megatron indexed dataset tokenized for your vocabulary.
exec "$(dirname "$0")/../scripts/launch_pretrain.sh" --gpus 8 \
  model=llama3_8b fp8=blockwise parallel=tp2_sp parallel.tp=8 parallel.use_distributed_optimizer=true \
  data=indexed data.path="${DATA_PREFIX:?set DATA_PREFIX to a Megatron .bin/.idx prefix}" \
  train.steps=10000 train.micro_batch_size=1 train.global_batch_size=512 train.lr=3e-4 train.min_lr=3e-5 \
  train.warmup_steps=500 checkpoint=periodic checkpoint.dir=outputs/llama3_8b/checkpoints \
  logging.dir=outputs/llama3_8b "$@"
