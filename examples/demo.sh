#!/usr/bin/env bash
# The main job on a checkpoint made here: a CNN saved through nn.DataParallel (every key has `module.`).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${CKPT_DOCTOR_BIN:-.venv/bin}
"$BIN/python" examples/make_example.py example
set -x
"$BIN/ckpt-doctor" inspect example/dataparallel.pth
"$BIN/ckpt-doctor" inspect example/dataparallel.pth --model fixtures/models.py:SmallCNN || true
"$BIN/ckpt-doctor" fix example/dataparallel.pth -o example/clean.safetensors --model fixtures/models.py:SmallCNN --auto --force
"$BIN/ckpt-doctor" verify example/clean.safetensors --model fixtures/models.py:SmallCNN --input-shape 8,3,32,32 --gpus 2 --allow-skip
