#!/bin/bash
set -u
mkdir -p $OUT
NEW=$PWD
git worktree add -q /tmp/old 959fd8d 2>&1 | tail -1
for tree in $NEW /tmp/old; do echo "== $tree"; (cd $tree && PYTHONPATH=$tree:/tmp/site timeout 100 python3 $NEW/.sweep/fused_probe.py 2>&1 | tail -12); done
