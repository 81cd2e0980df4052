#!/usr/bin/env bash
# The main job on a checkpoint made here: a CNN saved through nn.DataParallel (every key has `module.`).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${CKPT_DOCTOR_BIN:-.venv/bin}
"$BIN/python" examples/make_example.py example
set -x
"$BIN/ckpt-doctor" inspect example/dataparallel.pth
