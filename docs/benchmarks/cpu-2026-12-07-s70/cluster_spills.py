"""Session 70: ptxas's registers and spill bytes of the 8-bit scaled cluster forms,
shipped and with the lean byte decode, each form compiled alone (bfloat16, sm_90).

Run from the repository root: ``PYTHONPATH=.:tests python
docs/benchmarks/cpu-2026-12-07-s70/cluster_spills.py`` (needs nvcc).
"""

import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from support.compilers import NVCC
from support.group_emulator import check_cuda

from benchmarks import matmul_variants
from dflash.metal import tensor_qmm


def main() -> int:
    with matmul_variants.variant(lean_bytes=True):
        lean = dict(tensor_qmm.SCALED_SPECS)
    for label, table in (("shipped", tensor_qmm.SCALED_SPECS), ("lean", lean)):
        for mtiles in (1, 2):
            for group in tensor_qmm.GROUP_SIZES:
                for size in range(2, tensor_qmm.MAX_CLUSTER + 1):
                    spec = tensor_qmm.cluster_spec(table[(2, (8, mtiles), group)], size)
                    with tempfile.TemporaryDirectory() as workdir:
                        result = check_cuda(
                            [spec],
                            Path(workdir),
                            NVCC,
                            dtypes=[mx.bfloat16],
                            flags=("-Xptxas", "-v"),
                        )
                    spills = re.findall(r"(\d+) bytes spill stores", result.log)
                    registers = re.findall(r"Used (\d+) registers", result.log)
                    print(label, spec.base, "ok" if result.ok else "FAILED",
                          "registers", registers[0], "spill bytes", spills[0])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
