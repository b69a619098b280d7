"""Session 14: the default rule on the real CUDA backend (tiny 4-bit group-64 Glimmer)."""
import json
import sys

sys.path.insert(0, "tests")
import mlx.core as mx
import mlx.nn as nn
from conftest import tiny_model
from mlx_lm.generate import generate_step as mlx_generate_step
from test_dflash_loop import random_drafter

from dflash import dflash_generate_step, kernel_patch

target = tiny_model("muse_glimmer", seed=3, window=16)
target.set_dtype(mx.bfloat16)
nn.quantize(target, group_size=64, bits=4)
drafter = random_drafter(target, seed=5, block_size=16)
drafter.set_dtype(mx.bfloat16)
report = {
    "backend_cuda": mx.cuda.is_available(),
    "quantized_form": kernel_patch.quantized_form(target),
    "plain_parts": kernel_patch.wanted_parts(target),
    "dflash_parts": kernel_patch.wanted_parts(target, speculative=True),
}
seen = []
original = kernel_patch.KernelPatch.install


def spy(self):
    seen.append((self.attention, self.matmul, self.projections))
    return original(self)


kernel_patch.KernelPatch.install = spy
prompt = mx.random.randint(0, 250, (40,))
ours = [int(t) for t, _, _ in dflash_generate_step(prompt, target, drafter, max_tokens=64)]
theirs = [int(t) for t, _ in mlx_generate_step(prompt, target, max_tokens=64)]
report.update(
    installed=seen,
    patched_after=kernel_patch.is_patched(target),
    tokens=len(ours),
    equal_to_mlx_lm=ours == theirs,
    first_difference=next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None),
)
print(json.dumps(report))
