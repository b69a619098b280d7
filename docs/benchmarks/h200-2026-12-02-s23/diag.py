import sys; sys.path.insert(0, "tests")
import mlx.core as mx
from benchmarks import layer_stack
from dflash import kernel_patch, prepared_heads, traced_layers
from dflash.kernel_patch import KernelPatch
from dflash.metal import backend, heads
model = layer_stack.build_layers("tiny", "4bit", 2)
p = KernelPatch(model, traced_layers=True)
print("wanted", p.traced_layers, "route", p.route)
print("compile", backend.compile_wanted(), "kernel path", backend.use_kernel_path(p.route.use_kernel, True), backend.gpu_is_default(), backend.BACKEND)
layer = model.layers[0]
print("serves", traced_layers.serves(layer), type(layer).__module__, type(layer).__name__)
print("fm", traced_layers.forward_matches(layer, type(layer)))
attn = layer.self_attn
print("prep serves", prepared_heads.serves(attn), prepared_heads.forward_matches(attn, type(attn)))
print("ks", heads.kernel_serves(attn.head_dim, prepared_heads.activation_dtype(attn)))
print("gated", prepared_heads.gated_fold_matches(prepared_heads.activation_dtype(attn), None))
with p:
    print("installed", [type(l).__name__ for l in model.layers], p.route)
