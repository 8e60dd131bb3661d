#!/usr/bin/env bash
# Pretrain a GPT with FP8 blockwise linears on your own text: tokenize text and JSONL files into a
# Megatron indexed dataset (scripts/prepare_data.py), then train on it (scripts/launch_pretrain.sh).
#
#   TEXT="notes/ books.jsonl" TOKENIZER=gpt2 recipes/pretrain_own_text.sh [HYDRA_OVERRIDES...]
#
# TEXT: files and directories (plain text: a document per file; JSONL: a document per line, its
#   "text" field). TOKENIZER: a Hugging Face hub name, a tokenizer.json or a directory holding one
#   (pip install 'primus-fp8-plugin[data]'), or byte (default). DATA_PREFIX: where the .bin/.idx go
#   (default outputs/own_text/corpus); they are made again when TEXT or TOKENIZER change.
# PYTHON: the interpreter (default: the checkout's .venv, else python3); GPUS: processes (default all).
# The overrides after the defaults below win, e.g. model=tiny train.steps=100. Outputs and checkpoints go to
# outputs/own_text; running it again resumes that run (a changed setting stops it at start-up, naming the field).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
: "${TEXT:?set TEXT to the text files, JSONL files or directories to train on}"
TOKENIZER="${TOKENIZER:-byte}"
DATA_PREFIX="${DATA_PREFIX:-outputs/own_text/corpus}"

made_from="tokenizer=$TOKENIZER text=$TEXT"
if [ ! -f "$DATA_PREFIX.idx" ] || [ "$(cat "$DATA_PREFIX.made_from" 2>/dev/null)" != "$made_from" ]; then
  # shellcheck disable=SC2086  # TEXT is a list of paths
  "$PYTHON" "$ROOT/scripts/prepare_data.py" --tokenizer "$TOKENIZER" --out "$DATA_PREFIX" $TEXT
  echo "$made_from" > "$DATA_PREFIX.made_from"
fi

exec "$ROOT/scripts/launch_pretrain.sh" ${GPUS:+--gpus "$GPUS"} \
  model=gpt_125m model.attention=sdpa fp8=blockwise data=indexed data.path="$(realpath "$DATA_PREFIX")" \
  data.tokenizer="$TOKENIZER" train.steps=2000 train.micro_batch_size=8 train.lr=6e-4 train.min_lr=6e-5 \
  train.eval_interval=200 checkpoint=periodic logging.dir=outputs/own_text "$@"
