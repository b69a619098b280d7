#!/bin/bash
# session 35, call 3 (call 2 with its old tree whole): the 4-bit A/B alternated (new = this tree, old = HEAD before the change,
# unpacked from old.tgz), three pairs; then bf16 (kernels off: the default; on: DFLASH_VERIFY_KERNELS=1).
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/old3 && tar xzf .sweep/s35/old.tgz -C /tmp/old3
arm() {  # name tree quant [env...]
  name=$1; tree=$2; quant=$3; shift 3
  env PYTHONPATH=$tree:/tmp/site "$@" timeout 110 python3 .sweep/s35/ab.py $OUT/ab-$name.json $quant $name > $OUT/ab-$name.txt 2>&1
  echo "$name rc=$?"; grep -E "^summary|Error" $OUT/ab-$name.txt | cut -c1-200
}
for i in 1 2 3; do  # call 3: the old tree with its cache and verify packages
  arm old$((i+3)) /tmp/old3 4bit
  arm new$((i+5)) $PWD 4bit
done


cd $OUT && tar czf ab.tgz ab-*.json ab-*.txt && rm ab-*
