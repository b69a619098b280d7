#!/bin/bash
# session 35, call 4: bf16 again, kernels on (DFLASH_VERIFY_KERNELS=1) then off (the default).
set -u
export PYTHONUNBUFFERED=1
arm() {  # name tree quant [env...]
  name=$1; tree=$2; quant=$3; shift 3
  env PYTHONPATH=$tree:/tmp/site "$@" timeout 120 python3 .sweep/s35/ab.py $OUT/ab-$name.json $quant $name > $OUT/ab-$name.txt 2>&1
  echo "$name rc=$?"; grep -E "^summary|Error" $OUT/ab-$name.txt | cut -c1-200
}
arm bf16-kernels2 $PWD bf16 DFLASH_VERIFY_KERNELS=1
arm bf16-default2 $PWD bf16
cd $OUT && tar czf ab.tgz ab-*.json ab-*.txt && rm ab-*
