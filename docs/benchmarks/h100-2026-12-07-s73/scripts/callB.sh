#!/bin/bash
# Session 72: whole 8-bit loops at 32k, today's default (D: our kernels with the lean byte
# decode, mlx's graphs) against kernels off with graphs (O), one process each.
# Usage, from the repository root with loop.sh, gcwrap.py and cur in .sweep/s66/: bash callB.sh
set -u
QUANT=8bit CTX=32768 PER=${PER:-140} bash .sweep/s66/loop.sh "${LOOPS:-D O O D}"
