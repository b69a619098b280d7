"""Every kernel operation's bit-exactness cases, without pytest or hypothesis.

``python -m tests.support.selfcheck --cases 400`` (from the repository root) runs
random geometries of every operation plus the full Muse Glimmer geometry through
:func:`.kernel_cases.check_case` and prints ``N passed, M failed``: the same
proof as the ``cuda`` tests, for a GPU host that has mlx and numpy only. Without
a GPU backend it checks the references alone.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import numpy as np

from dflash.metal import kernel_backend

from .kernel_cases import DTYPES, OPS, SHADOW_OPS, Case, check_case, glimmer_cases


def random_case(rng: np.random.Generator, op: str, max_capacity: int = 64) -> Case:
    """A random valid case of ``op`` (C 1..max, S 1..C, B 1..2, H 1..3, D 1..8)."""
    capacity = int(rng.integers(1, max_capacity + 1))
    count = int(rng.integers(1, capacity + 1))
    length = int(rng.integers(0, capacity + 1))
    if op in SHADOW_OPS:
        count = int(rng.integers(0 if length else 1, capacity + 1))
    return Case(
        op=op,
        dtype=str(rng.choice(list(DTYPES))),
        head_major=bool(rng.integers(0, 2)),
        batch=int(rng.integers(1, 3)),
        heads=int(rng.integers(1, 4)),
        capacity=capacity,
        dim=int(rng.integers(1, 9)),
        count=count,
        start=int(rng.integers(0, capacity)),
        length=length,
        planes=int(rng.integers(1, 6)),
        scattered=bool(rng.integers(0, 2)),
        seed=int(rng.integers(0, 2**31)),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run random cases of every op; print ``N passed, M failed``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="random cases per op")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    forms = ["reference"] + (["kernel"] if kernel_backend() else [])
    print(f"backend: {kernel_backend() or 'none (reference only)'}; forms: {forms}")
    cases = [random_case(rng, op) for op in OPS for _ in range(args.cases)]
    cases += glimmer_cases()
    passed = failed = 0
    for case in cases:
        for form in forms:
            problem = check_case(case, form)
            if problem is None:
                passed += 1
            else:
                failed += 1
                print(f"FAIL {form} {case}: {problem}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
