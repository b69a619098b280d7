"""Session 55 probe: how often the kept scale copies are made, and whether under a trace."""
import collections
import sys

from dflash.metal import backend, tensor_qmm

counts = collections.Counter()
_orig = tensor_qmm._kept_copy


def logged(kept_copies, sources, group_size, make):
    which = "ileave" if kept_copies is tensor_qmm._INTERLEAVED else "cmajor"
    key = id(sources[0])
    kept = kept_copies.get(key)
    hit = kept is not None and kept[1] == group_size and all(r() is a for r, a in zip(kept[0], sources))
    counts[(which, "hit" if hit else "miss", "traced" if backend.tracing() else "eager")] += 1
    return _orig(kept_copies, sources, group_size, make)


tensor_qmm._kept_copy = logged
from benchmarks import round_profile

sys.argv = ["round_profile"] + sys.argv[1:]
try:
    round_profile.main()
finally:
    for k, v in sorted(counts.items()):
        print("KEPT", k, v)
