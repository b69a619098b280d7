"""Session 55 probe: where the interleaved arm's copy_g_nd<bf16, 2, 8> kernels sit in a round's kernel sequence."""
import sys

from benchmarks import common, round_profile

captures = []
_orig = round_profile.cupti_trace


def saving(run):
    kernels, api = _orig(run)
    captures.append(kernels)
    return kernels, api


round_profile.cupti_trace = saving
sys.argv = ["round_profile"] + sys.argv[1:]
try:
    round_profile.main()
finally:
    needle = "copy_g_nd<__nv_bfloat16, __nv_bfloat16, int, 2, 8>"
    for i, kernels in enumerate(captures):
        names = [n for n, _, _ in kernels]
        hits = [j for j, n in enumerate(names) if needle in n]
        q4 = sum("tensor_q4" in n for n in names)
        print(f"CAPTURE {i}: {len(names)} kernels, {q4} q4, {len(hits)} copies; first at {hits[:6]}")
        for j in hits[:3]:
            for k in range(max(0, j - 4), min(len(names), j + 4)):
                d = kernels[k][2]
                print(f"   {'>>' if k == j else '  '} {k} {d:.1f}us {names[k][:150]}")
