#!/bin/bash
# Call 1 (with the install): the node cuts timed (cur 18.25 against old 23.75 nodes a
# verify layer, graphs off), alternated; the first process also compiles the kernels.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
TAG=c1r PER=${PER:-200} bash .sweep/s63/rounds.sh "${ARMS:-G:cur G:old G:cur G:old G:cur}"
