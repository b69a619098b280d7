#!/bin/bash
# Session 64 call C: the cluster sum's cuda tests (graphs off), then rounds G, C and S (SwiGLU)
# (G + DFLASH_QMM_CLUSTER_SUM=1), alternated, each checked lossless.
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/T
ROOT=$PWD
t0=$(date +%s)
(cd .sweep/s63/cur && MLX_USE_CUDA_GRAPHS=0 PYTHONPATH=$PWD:$PWD/tests:/tmp/site timeout ${TPER:-150} python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_tensor_cluster.py tests/test_gated_mlp.py > $OUT/T/cluster-tests.txt 2>&1)
echo "tests rc=$? $(( $(date +%s)-t0 ))s"; tail -3 $OUT/T/cluster-tests.txt | cut -c1-300
TAG=cr PER=${PER:-140} bash .sweep/s63/rounds.sh "${ARMS:-G:cur C:cur S:cur G:cur C:cur S:cur}"
