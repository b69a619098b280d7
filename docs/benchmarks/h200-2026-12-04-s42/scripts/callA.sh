#!/bin/bash
# session 42, call A: the cluster probe (mlx's launch and __cluster_dims__, DSMEM).
set -u
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
mkdir -p $OUT
timeout 120 python3 .sweep/s42/probe.py 2>&1 | tail -30
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
