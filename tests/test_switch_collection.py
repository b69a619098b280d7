"""The matmul's test modules collect under each scale-layout switch.

The ``cuda`` tests of an opt-in form are run on the GPU by setting its switch for the
whole process (``DFLASH_QMM_INTERLEAVED_SCALES=1 pytest -m cuda ...``). Session 55's
first such run found tests/test_tensor_qmm.py failing at import under the switch (a
module-level table built under the shipped default took the switched layout), so
none of its ``cuda`` tests ran. This runs the collection here, on the CPU, under each
switch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash.metal import tensor_qmm

MODULES = ("tests/test_tensor_qmm.py", "tests/test_tensor_direct.py")
SWITCHES = {
    "interleaved": {tensor_qmm.INTERLEAVED_SCALES_ENV: "1"},
    "unit": {tensor_qmm.UNIT_SCALES_ENV: "1"},
    "row-major": {tensor_qmm.CHUNK_MAJOR_SCALES_ENV: "0"},
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_the_matmul_test_modules_collect_under_each_scale_layout_switch(
    switch: str,
) -> None:
    environment = {
        k: v for k, v in os.environ.items() if not k.startswith("DFLASH_QMM_")
    }
    environment.update(SWITCHES[switch])
    environment["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["--collect-only", *MODULES],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.splitlines()[-1]
