"""Where a traced verify layer's build goes on this host (session 24 diag).

``timed_layer_forward`` is ``dflash.traced_layers.layer_forward`` as of commit e3a4a99
with a clock between its steps (a diagnostic copy: it does not follow later edits).
"""
import cProfile, pstats, sys, time, io
from collections import defaultdict
from functools import partial
import mlx.core as mx
from benchmarks import layer_stack
from dflash import traced_layers as tl
from dflash.metal import attention, groups, heads
from dflash.cache.plane import RingPlane

T = defaultdict(float)

def timed_layer_forward(layer, x, cache, chunk, key_source, slot):
    c = time.perf_counter
    t0 = c()
    traces = tl._traces(layer, slot)
    attn = layer.self_attn
    batch, length, _ = x.shape
    prep = tl.prep_of(attn, cache.offset)
    q_shape = (batch, length, attn.n_heads, attn.head_dim)
    prep_ints = heads.head_prep_ints(q_shape, attn.n_kv_heads, prep, True)
    pre = tl._replay(traces.pre, (x.shape, x.dtype), lambda: partial(tl._pre_attention, layer, prep))
    t1 = c(); T["a_holds_prep_ints"] += t1 - t0
    queries, block, gate = pre(x, prep_ints)
    t2 = c(); T["b_pre_replay"] += t2 - t1
    fetched = cache.update_and_fetch_block(block, fetch=False)
    keys, values = (None, None) if fetched is None else fetched
    window = cache.window if isinstance(cache, RingPlane) else None
    t3 = c(); T["c_update_block"] += t3 - t2
    plane, block_keys, block_values = key_source(cache, keys, values, length, window)
    t4 = c(); T["d_key_source"] += t4 - t3
    plan = attention.make_plan(queries.transpose(0, 2, 1, 3), plane, block_keys, block_values,
        window=window, causal=True, query_start=cache.offset - length, chunk=chunk)
    t5 = c(); T["e_make_plan"] += t5 - t4
    form = attention.kernel_form(plan, queries.dtype, gated=True)
    t6 = c(); T["f_kernel_form"] += t6 - t5
    bound = attention.bound_arrays(plan, plane, block_keys, block_values)
    floats = groups.float_params(float(attn.scale), 0.0)
    launch = form.launch
    geometry = (form.spec, launch.chunk_shapes, launch.chunk_groups, launch.out_shape)
    geometry += (launch.fold_groups, form.dtype, x.shape, x.dtype)
    geometry += tuple((array.shape, array.dtype) for array in bound)
    post = tl._replay(traces.post, geometry, lambda: partial(tl._post_attention, layer, form))
    t7 = c(); T["g_bound_floats_key"] += t7 - t6
    out = post(x, queries, gate, *bound, launch.ints, floats, launch.fold_ints)
    T["h_post_replay"] += c() - t7
    return out

def main():
    layers = 8
    model = layer_stack.build_layers("full", "4bit", layers)
    cache = layer_stack.prefill(model, 4096)
    keys = mx.random.split(mx.random.key(1), 4)
    inputs = [(mx.random.normal((1, 16, model.args.hidden_size), key=k) * 0.5).astype(mx.bfloat16) for k in keys]
    mx.eval(inputs)
    gen = layer_stack.arm_context(model, "ours-traced", attention=True)
    gen.__enter__()
    fwd = layer_stack.verify_forward_of(model, cache)
    for _ in range(3):
        mx.eval(fwd(inputs[0]))
    # timed phases, pipelined as layer_stack does
    orig = tl.layer_forward
    tl.layer_forward = timed_layer_forward
    import dflash.kernel_patch as kp
    kp.traced_layers_module.layer_forward = timed_layer_forward
    n = 32
    for rep in range(3):
        T.clear()
        b = e = 0.0
        for i in range(n):
            t0 = time.perf_counter(); out = fwd(inputs[i % 4]); t1 = time.perf_counter()
            mx.async_eval(out); t2 = time.perf_counter()
            b += t1 - t0; e += t2 - t1
        mx.eval(out)
        per = 1e6 / n / layers
        print(f"rep {rep}: build {b*per:.1f} encode {e*per:.1f} us/layer; phases:",
              {k: round(v * per, 1) for k, v in sorted(T.items())}, flush=True)
    kp.traced_layers_module.layer_forward = orig
    tl.layer_forward = orig
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        out = fwd(inputs[i % 4]); mx.async_eval(out)
    mx.eval(out)
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40); print(s.getvalue())
    gen.__exit__(None, None, None)

main()
