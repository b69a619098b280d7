"""The verify kernels installed into a model: routing, reversibility, bit-exact agreement.

With :class:`dflash.kernel_patch.KernelPatch` on, our plain decoding
(``dflash.generate_step``: one query per attention call) and DFlash decoding
(``dflash_generate_step``: verify blocks) give every token the same log-probabilities
bit for bit. Against mlx-lm's own plain decoding (its caches and attention) the
float32 outputs agree; in bfloat16 they part at near-ties (printed with margins).
"""

from __future__ import annotations

import collections
import gc
import io
import re
import sys
import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY_DFLASH2, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step as mlx_generate_step
from test_dflash_loop import random_drafter

from dflash import dflash_generate_step, fused_projections, kernel_patch
from dflash.cache import SpeculativeCheckpoint, make_prompt_cache
from dflash.cache.plane import RingPlane, kv_halves
from dflash.drafter import DraftAttention
from dflash.generation import generate_step
from dflash.kernel_patch import KernelPatch, supports
from dflash.metal import attention, backend, heads
from dflash.metal import norms as rn
from dflash.metal import qmm
from dflash.speculative import speculative_generate_step


def _f32(array: mx.array) -> np.ndarray:
    return np.asarray(array.astype(mx.float32))


def _plain_and_speculative(target, drafter, prompt, tokens: int):
    plain = list(generate_step(prompt, target, max_tokens=tokens))
    spec = list(dflash_generate_step(prompt, target, drafter, max_tokens=tokens))
    return plain, spec


@pytest.mark.parametrize(
    "arch, dtype, block, bits",
    [
        ("muse_glimmer", mx.float32, 8, None),
        ("muse_glimmer", mx.bfloat16, 16, None),
        ("muse_glimmer", mx.bfloat16, 8, 4),
        ("gemma3_text", mx.float32, 5, 8),
        ("qwen3", mx.float16, 8, None),
    ],
)
def test_plain_and_speculative_logits_agree_bitwise(arch, dtype, block, bits) -> None:
    target = tiny_model(arch, seed=1, window=16)
    target.set_dtype(dtype)
    if bits:
        nn.quantize(target, group_size=32, bits=bits)
    drafter = random_drafter(target, seed=11, block_size=block)
    drafter.set_dtype(dtype)
    prompt = mx.random.randint(0, 250, (19,))
    with KernelPatch(target, drafter):
        plain, spec = _plain_and_speculative(target, drafter, prompt, 30)
    assert [int(t) for t, _ in plain] == [int(t) for t, _, _ in spec]
    for index, ((_, want), (_, got, _)) in enumerate(zip(plain, spec)):
        assert np.array_equal(_f32(want), _f32(got)), f"token {index}"


@pytest.mark.parametrize(
    "arch, dtype, bits", [("muse_glimmer", mx.bfloat16, 4), ("qwen3", mx.float16, None)]
)
@pytest.mark.parametrize("blocks", [False, True])
def test_compiled_forwards_give_the_uncompiled_bits(
    monkeypatch, arch, dtype, bits, blocks
):
    """``mx.compile`` replays the bound matmuls' launches (with ``blocks``, whole MLP
    blocks, their activation and product fused): plain and speculative
    log-probabilities are bit for bit those of the uncompiled forwards."""
    target = tiny_model(arch, seed=2, window=16)
    target.set_dtype(dtype)
    if bits:
        nn.quantize(target, group_size=32, bits=bits)
    drafter = random_drafter(target, seed=12, block_size=8)
    drafter.set_dtype(dtype)
    prompt = mx.random.randint(0, 250, (21,), key=mx.random.key(5))
    runs = {}
    for compiled in ("0", "1"):
        monkeypatch.setenv(backend.COMPILE_ENV, compiled)
        monkeypatch.setenv(
            kernel_patch.COMPILED_BLOCKS_ENV, "1" if blocks and compiled == "1" else "0"
        )
        with KernelPatch(target, drafter) as patch:
            assert patch.compile_blocks is (blocks and compiled == "1")
            runs[compiled] = _plain_and_speculative(target, drafter, prompt, 26)
    (plain, spec), (plain_c, spec_c) = runs["0"], runs["1"]
    assert len(plain) == len(plain_c) == 26 and len(spec) == len(spec_c) == 26
    for index, ((_, want), (_, got)) in enumerate(zip(plain, plain_c)):
        assert np.array_equal(_f32(want), _f32(got)), f"plain token {index}"
    for index, ((_, want, _), (_, got, _)) in enumerate(zip(spec, spec_c)):
        assert np.array_equal(_f32(want), _f32(got)), f"speculative token {index}"


def _first_divergence(reference, ours):
    for index, ((want, want_lp), (got, got_lp)) in enumerate(zip(reference, ours)):
        if int(want) != int(got):
            top = np.sort(_f32(want_lp))[::-1]
            return index, float(top[0] - top[1])
    return None, None


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("seed", range(2))
def test_divergences_from_mlx_lm_are_near_ties(dtype, seed) -> None:
    """Our patched plain decoding vs mlx-lm's: equal, or parted at a near-tie."""
    target = tiny_model("muse_glimmer", seed=seed, window=16)
    target.set_dtype(dtype)
    prompt = mx.random.randint(0, 250, (19,))
    reference = list(mlx_generate_step(prompt, target, max_tokens=40))
    with KernelPatch(target):
        ours = list(generate_step(prompt, target, max_tokens=40))
    index, margin = _first_divergence(reference, ours)
    if index is None:
        return
    # A near-tie: mlx-lm's top two log-probabilities within two ulps of the dtype there.
    limit = 1e-4 if dtype == mx.float32 else 2 * 2.0**-8 * 8
    print(
        f"{dtype} seed {seed}: parted from mlx-lm at token {index}, margin {margin:.3g}"
    )
    assert margin <= limit, (index, margin)


@pytest.mark.parametrize("arch", kernel_patch.SUPPORTED_ARCHITECTURES)
def test_patched_forward_matches_mlx_attention(arch) -> None:
    """Prefill, a checkpointed verify block and decode steps: close to mlx's attention."""
    target = tiny_model(arch, seed=2, window=16)
    prompt = mx.random.randint(0, 250, (1, 40))
    block = mx.random.randint(0, 250, (1, 7))
    outs = {}
    for patched in (False, True):
        cache = make_prompt_cache(target)
        patch = KernelPatch(target).install() if patched else None
        try:
            logits = [
                target(prompt[:, :30], cache=cache),
                target(prompt[:, 30:], cache=cache),
            ]
            with SpeculativeCheckpoint.begin(cache, 7) as checkpoint:
                logits.append(target(block, cache=cache))
                checkpoint.commit(3)
            for token in (5, 9, 77):
                logits.append(target(mx.array([[token]]), cache=cache))
        finally:
            if patch is not None:
                patch.uninstall()
        outs[patched] = [_f32(x) for x in logits]
    for want, got in zip(outs[False], outs[True]):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_verify_block_is_read_beside_the_ring(monkeypatch) -> None:
    """A held-back verify block is read from the checkpoint, the ring as before it."""
    seen = []
    original = kernel_patch.small_query_attention

    def spy(queries, plane, block_keys=None, block_values=None, **kwargs):
        seen.append((plane, block_keys, kwargs))
        return original(queries, plane, block_keys, block_values, **kwargs)

    monkeypatch.setattr(kernel_patch, "small_query_attention", spy)
    target = tiny_model("muse_glimmer", seed=3, window=16)
    cache = make_prompt_cache(target)
    with KernelPatch(target):
        target(mx.random.randint(0, 250, (1, 29)), cache=cache)
        seen.clear()
        with SpeculativeCheckpoint.begin(cache, 6) as checkpoint:
            target(mx.random.randint(0, 250, (1, 6)), cache=cache)
            checkpoint.commit(2)
    kinds = [layer.self_attn.layer_type for layer in target.layers]
    assert len(seen) == len(kinds)
    for kind, (plane, block_keys, kwargs) in zip(kinds, seen):
        assert kwargs["query_start"] == 29
        if kind == "sliding_attention":
            # The full 16-row ring, untouched, then the 6 held-back rows (stacked).
            assert (plane.length, plane.origin_logical, block_keys.shape) == (
                16,
                13,
                (2, 1, 2, 6, block_keys.shape[-1]),
            )
            assert plane.stacked
            assert plane.origin_physical == 13 % 16
            assert kwargs["window"] == 16
        else:
            # A growing plane holds the written block (rows past len are its undo).
            assert (plane.length, block_keys) == (35, None)
            assert kwargs["window"] is None


def _primitive_counts(*arrays: mx.array) -> dict:
    """How many of each primitive the graph of ``arrays`` holds (from mlx's dot export)."""
    text = io.StringIO()
    mx.export_to_dot(text, *arrays)
    return collections.Counter(re.findall(r'label ="([^"]+)"', text.getvalue()))


def test_kernel_route_reads_planes_and_blocks_as_views() -> None:
    """The keys and values the kernel is given are views of the plane and of the
    held-back block: no gather, which would copy a whole plane half every layer."""
    stacked = mx.zeros((2, 1, 2, 8, 4))
    assert _primitive_counts(stacked[0])["Gather"] == 1  # the control: kv[0] copies
    assert _primitive_counts(*kv_halves(stacked))["Gather"] == 0
    target = tiny_model("muse_glimmer", seed=3, window=16)
    cache = make_prompt_cache(target)
    target(mx.random.randint(0, 250, (1, 29)), cache=cache)
    windows = [
        16 if layer.self_attn.layer_type == "sliding_attention" else None
        for layer in target.layers
    ]
    with SpeculativeCheckpoint.begin(cache, 6) as checkpoint:
        target(mx.random.randint(0, 250, (1, 6)), cache=cache)
        pending = [getattr(plane.guard, "pending", None) for plane in cache]
        mx.eval([plane.kv for plane in cache] + [p for p in pending if p is not None])
        for plane, window in zip(cache, windows):
            source, block_keys, block_values = kernel_patch._key_source(
                plane, None, None, 6, window
            )
            arrays = [source.keys, source.values]
            arrays += [a for a in (block_keys, block_values) if a is not None]
            assert (block_keys is not None) == (window is not None)
            assert _primitive_counts(*arrays)["Gather"] == 0
        checkpoint.commit(2)


def test_prefill_chunks_keep_mlx_attention(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        kernel_patch, "small_query_attention", lambda *a, **k: calls.append(a) or None
    )
    target = tiny_model("muse_glimmer", seed=3, window=16)
    cache = make_prompt_cache(target)
    with KernelPatch(target, max_queries=8):
        target(mx.random.randint(0, 250, (1, 9)), cache=cache)
    assert calls == []


def test_uninstall_restores_classes_and_module() -> None:
    target = tiny_model("muse_glimmer", seed=4, window=16)
    drafter = random_drafter(target, seed=14)
    module = sys.modules[type(target).__module__]
    function = module.scaled_dot_product_attention
    probe = KernelPatch(target, drafter)
    classes = [type(m) for m in probe.attention_modules() + probe.matmul_modules()]
    prompt = mx.random.randint(0, 250, (1, 20))
    before = _f32(target(prompt))
    other = tiny_model("muse_glimmer", seed=5, window=16)
    with KernelPatch(target, drafter) as patch:
        assert patch.installed
        assert module.scaled_dot_product_attention is not function
        with KernelPatch(other):
            pass
        # The other model's uninstall leaves this model's hook in place.
        assert module.scaled_dot_product_attention is not function
        with pytest.raises(RuntimeError, match="already"):
            KernelPatch(target).install()
    assert module.scaled_dot_product_attention is function
    modules = patch.attention_modules() + patch.matmul_modules()
    assert [type(m) for m in modules] == classes
    assert not any("_dflash_route" in vars(m) for m in modules)
    assert not any("_dflash_bound" in vars(m) for m in modules)
    assert np.array_equal(_f32(target(prompt)), before)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 32),
    bits=st.sampled_from([None, 4, 8]),
    group_size=st.sampled_from([32, 64, 128]),
    groups_k=st.integers(1, 3),
    columns=st.integers(1, 40),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_compiled_replay_gives_every_new_input_the_uncompiled_bits(
    rows, bits, group_size, groups_k, columns, dtype, seed
) -> None:
    """A bound matmul is safe to compile: it keeps no per-call state in Python that a
    trace would freeze, so each later input replayed gets the bits a fresh uncompiled
    call gives it (on a GPU, the kernel form with its fresh counters per launch)."""
    depth = group_size * groups_k
    key = mx.random.key(seed)
    weight = mx.random.normal((columns, depth), key=key).astype(dtype)
    scales = biases = None
    if bits:
        weight, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    group = group_size if bits else None
    bound = qmm.bind_matmul(
        (rows, depth), dtype, weight, scales, biases, bits=bits, group_size=group
    )
    compiled = mx.compile(bound)
    for index in range(3):
        x = mx.random.normal((rows, depth), key=mx.random.key(seed + index + 1))
        x = x.astype(dtype)
        assert np.array_equal(_f32(compiled(x)), _f32(bound(x))), f"input {index}"


def test_uninstall_frees_the_compiled_forwards(monkeypatch) -> None:
    """Each generation installs the patch again: the compiled forwards of the last one
    (and mlx's traces of them) must go with it, or a long-lived server grows."""
    monkeypatch.setenv(backend.COMPILE_ENV, "1")
    forwards, compile_bound = [], backend.compile_bound

    def spy(forward):
        forwards.append(weakref.ref(forward))
        return compile_bound(forward)

    monkeypatch.setattr(backend, "compile_bound", spy)
    target = tiny_model("muse_glimmer", seed=14, window=16)
    nn.quantize(target, group_size=32, bits=4)
    with KernelPatch(target, matmul=True):
        list(generate_step(mx.random.randint(0, 250, (9,)), target, max_tokens=3))
    assert len(forwards) > 2 * len(target.layers)
    gc.collect()
    assert [ref for ref in forwards if ref() is not None] == []


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["weight", "bias"])
def test_a_layer_given_new_arrays_is_bound_again(monkeypatch, name, compiled) -> None:
    """A patched layer keeps its bound forward per input geometry only while it holds
    the very arrays it was bound to: replace one and the next call uses the new one
    (a compiled forward, which captured the old one, included)."""
    monkeypatch.setenv(backend.COMPILE_ENV, "1" if compiled else "0")
    target = tiny_model("muse_glimmer", seed=13, window=16)
    layer = target.layers[0].self_attn.o_proj
    if name == "bias":
        layer.bias = mx.zeros((layer.weight.shape[0],))
    x = mx.random.normal((1, 1, layer.weight.shape[1]), key=mx.random.key(3))
    with KernelPatch(target, matmul=True):
        first = layer(x)
        assert np.array_equal(_f32(layer(x)), _f32(first))  # the bound form again
        new = mx.random.normal(layer[name].shape, key=mx.random.key(4))
        setattr(layer, name, new)
        second = layer(x)
    expected = layer(x)  # mlx's own forward with the new array
    np.testing.assert_allclose(_f32(second), _f32(expected), atol=1e-4)
    assert not np.allclose(_f32(second), _f32(first), atol=1e-3)


def test_unpatched_models_keep_mlx_attention(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        kernel_patch, "small_query_attention", lambda *a, **k: calls.append(a)
    )
    patched = tiny_model("muse_glimmer", seed=6, window=16)
    plain = tiny_model("muse_glimmer", seed=7, window=16)
    with KernelPatch(patched, use_kernel=False):
        plain(mx.random.randint(0, 250, (1, 5)), cache=make_prompt_cache(plain))
    assert calls == []


def test_unsupported_architecture_is_refused() -> None:
    target = tiny_model("gpt_oss", seed=0, window=16)
    assert not supports(target)
    with pytest.raises(ValueError, match="gpt_oss"):
        KernelPatch(target)


def test_drafter_attention_matches_its_own() -> None:
    """The drafter's in-place route equals its own forward within float tolerance."""
    target = tiny_model("muse_glimmer", seed=8, window=16)
    drafter = random_drafter(target, seed=18, block_size=8)
    prompt = mx.random.randint(0, 250, (30,))
    runs = {}
    for patched in (False, True):
        patch = KernelPatch(target, drafter).install() if patched else None
        try:
            runs[patched] = [
                _f32(lp)
                for _, lp, _ in dflash_generate_step(
                    prompt, target, drafter, max_tokens=20
                )
            ]
        finally:
            if patch is not None:
                patch.uninstall()
    assert len(runs[True]) == len(runs[False])
    for want, got in zip(runs[False], runs[True]):
        np.testing.assert_allclose(got, want, atol=5e-4, rtol=5e-4)
    assert any(isinstance(m, DraftAttention) for m in drafter.modules())


def test_kernel_route_uses_the_kernel_form(monkeypatch) -> None:
    """``use_kernel`` reaches the attention call (True: the kernel path is taken)."""
    taken = []

    def kernel(*args):
        taken.append(args)
        return attention.reference_attention(*args)

    monkeypatch.setattr(attention, "kernel_attention", kernel)
    monkeypatch.setattr(heads, "kernel_head_prep", heads.reference_head_prep)
    monkeypatch.setattr(rn, "kernel_residual_norm", rn.reference_residual_norm)
    monkeypatch.setattr(attention.backend, "BACKEND", "metal")
    target = tiny_model("muse_glimmer", seed=9, window=16)
    with KernelPatch(target, use_kernel=True, matmul=False):
        taken.clear()  # the install's probe of the gated fold calls it too
        target(mx.random.randint(0, 250, (1, 4)), cache=make_prompt_cache(target))
    assert len(taken) == len(target.layers)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("bits", [None, 4])
def test_matmuls_take_the_small_row_route(monkeypatch, bits, fuse, compiled) -> None:
    """Every Linear / QuantizedLinear of a decode step or verify block; not a prefill.
    Fused, each attention module's q/k/v/gate and each MLP's gate/up are one call over
    the members' stacked columns. A geometry seen before runs its bound form again;
    compiled, without running its Python again (mlx replays the trace)."""
    monkeypatch.setenv(backend.COMPILE_ENV, "1" if compiled else "0")
    calls, binds = [], []
    original = kernel_patch.bind_matmul

    def spy(x_shape, x_dtype, weight, *args, **kwargs):
        binds.append(x_shape[0])
        bound = original(x_shape, x_dtype, weight, *args, **kwargs)

        def run(x, counters=None):
            rows = x.size // x.shape[-1]  # x is (*lead, K), as the layer has it
            calls.append((rows, kwargs["bits"], weight.shape[0]))
            return bound(x, counters)

        run.counters = getattr(bound, "counters", 0)
        return run

    monkeypatch.setattr(kernel_patch, "bind_matmul", spy)
    monkeypatch.setattr(fused_projections, "bind_matmul", spy)
    target = tiny_model("muse_glimmer", seed=12, window=16)
    if bits:
        nn.quantize(target, group_size=32, bits=bits)
    layers = KernelPatch(target).matmul_modules()
    groups = [
        [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
        + [layer.self_attn.gate_proj]
        for layer in target.layers
    ] + [[layer.mlp.gate_proj, layer.mlp.up_proj] for layer in target.layers]
    groups = groups if fuse else []
    members = {id(m) for group in groups for m in group}
    per_forward = [sum(m.weight.shape[0] for m in group) for group in groups]
    per_forward += [m.weight.shape[0] for m in layers if id(m) not in members]
    cache = make_prompt_cache(target)
    with KernelPatch(target, max_queries=16, fuse=fuse) as patch:
        assert len(patch._groups) == (2 * len(target.layers) if fuse else 0)
        target(mx.random.randint(0, 250, (1, 20)), cache=cache)
        assert calls == []
        target(mx.random.randint(0, 250, (1, 16)), cache=cache)
        target(mx.random.randint(0, 250, (1, 1)), cache=cache)
        target(mx.random.randint(0, 250, (1, 1)), cache=cache)
    one_row_runs = 1 if compiled else 2
    want = [(16, bits, n) for n in per_forward] + one_row_runs * [
        (1, bits, n) for n in per_forward
    ]
    assert sorted(calls) == sorted(want)
    assert sorted(binds) == sorted([16, 1] * len(per_forward))


def test_matmul_only_patch_keeps_attention(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        kernel_patch, "small_query_attention", lambda *a, **k: calls.append(a)
    )
    target = tiny_model("gpt_oss", seed=0, window=16)
    with KernelPatch(target, attention=False) as patch:
        out = target(mx.random.randint(0, 250, (1, 3)), cache=make_prompt_cache(target))
        assert patch.installed
    mx.eval(out)
    assert calls == []


def test_generators_install_the_kernels_on_the_env_switch(monkeypatch) -> None:
    """``DFLASH_VERIFY_KERNELS=1``: plain, classic speculative and DFlash decoding each
    patch the target while they run, and give every token the same log-probabilities."""
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, "1")
    target = tiny_model("muse_glimmer", seed=21, window=16)
    drafter = random_drafter(target, seed=22, block_size=6)
    draft_model = tiny_model("muse_glimmer", seed=23, window=16)
    prompt = mx.random.randint(0, 250, (17,))
    runs = {
        "plain": generate_step(prompt, target, max_tokens=20),
        "classic": speculative_generate_step(
            prompt, target, draft_model, num_draft_tokens=3, max_tokens=20
        ),
        "dflash": dflash_generate_step(prompt, target, drafter, max_tokens=20),
    }
    outputs = {}
    for name, steps in runs.items():
        outputs[name] = []
        for step in steps:
            assert kernel_patch.is_patched(target), name
            outputs[name].append(step[1])
        assert not kernel_patch.is_patched(target), name
    plain = outputs.pop("plain")
    assert len(plain) == 20
    for name, logprobs in outputs.items():
        assert len(logprobs) == 20, name
        for index, (want, got) in enumerate(zip(plain, logprobs)):
            assert np.array_equal(_f32(want), _f32(got)), f"{name} token {index}"


def _logprobs_equal(got, want) -> bool:
    return len(got) == len(want) and all(
        np.array_equal(_f32(g), _f32(w)) for g, w in zip(got, want)
    )


@pytest.mark.parametrize("dflash_first", [False, True])
def test_interleaved_generators_keep_the_patch_until_the_last_ends(
    monkeypatch, dflash_first
) -> None:
    """Two generators on one model, stepped in turn: the one that installed the patch
    ends first, and the other still finishes on the same kernels (its log-probabilities
    equal its run alone, bit for bit); the patch goes when both have ended."""
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, "1")
    target = tiny_model("muse_glimmer", seed=31, window=16)
    drafter = random_drafter(target, seed=32, block_size=6)
    short_prompt = mx.random.randint(0, 250, (17,), key=mx.random.key(3))
    long_prompt = mx.random.randint(0, 250, (23,), key=mx.random.key(4))

    def plain():
        return generate_step(short_prompt, target, max_tokens=5)

    def dflash():
        return dflash_generate_step(long_prompt, target, drafter, max_tokens=20)

    alone = {"plain": [s[1] for s in plain()], "dflash": [s[1] for s in dflash()]}
    assert not kernel_patch.is_patched(target)
    first, second = ("dflash", "plain") if dflash_first else ("plain", "dflash")
    makers = {"plain": plain, "dflash": dflash}
    steps = {name: makers[name]() for name in (first, second)}
    got = {name: [next(steps[name])[1]] for name in (first, second)}
    # The first (the installer) runs to its end, then the second.
    got[first] += [s[1] for s in steps[first]]
    assert kernel_patch.is_patched(target)  # the second still holds it
    got[second] += [s[1] for s in steps[second]]
    assert not kernel_patch.is_patched(target)
    assert kernel_patch._HELD_PATCHES == {}
    for name in (first, second):
        assert _logprobs_equal(got[name], alone[name]), name


def test_a_generator_closed_early_releases_its_hold(monkeypatch) -> None:
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, "1")
    target = tiny_model("muse_glimmer", seed=33, window=16)
    prompt = mx.random.randint(0, 250, (12,), key=mx.random.key(5))
    first = generate_step(prompt, target, max_tokens=10)
    second = generate_step(prompt, target, max_tokens=10)
    next(first), next(second)
    first.close()
    assert kernel_patch.is_patched(target)
    second.close()
    assert not kernel_patch.is_patched(target) and kernel_patch._HELD_PATCHES == {}


@pytest.mark.parametrize(
    "env, use_kernel, kernels_env, expected",
    [
        (None, None, True, False),  # CPU: never by default
        ("1", None, True, True),
        ("0", True, True, True),  # an explicit argument wins
        ("0", None, True, False),
        (None, False, True, False),
        ("yes", None, False, True),
    ],
)
def test_wanted_follows_argument_then_env(
    monkeypatch, env, use_kernel, kernels_env, expected
):
    if env is None:
        monkeypatch.delenv(kernel_patch.VERIFY_KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, env)
    monkeypatch.setattr(kernel_patch.backend, "KERNELS_ENABLED", kernels_env)
    monkeypatch.setattr(kernel_patch.backend, "BACKEND", None)
    target = tiny_model("muse_glimmer", seed=23, window=16)
    assert kernel_patch.wanted(target, use_kernel) is expected
    assert not kernel_patch.wanted(tiny_model("gpt_oss", seed=0), True)


def _on_a_cuda_gpu(monkeypatch) -> None:
    monkeypatch.delenv(kernel_patch.VERIFY_KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernel_patch.backend, "BACKEND", "cuda")
    monkeypatch.setattr(kernel_patch.backend, "gpu_is_default", lambda: True)
    monkeypatch.setattr(kernel_patch.backend, "KERNELS_ENABLED", True)


@pytest.mark.parametrize(
    "backend_name, env, wanted",
    [
        ("cuda", None, True),
        ("metal", None, False),
        (None, None, False),
        ("cuda", "0", False),
        (None, "1", True),
        ("metal", "on", True),
    ],
)
def test_compile_follows_env_then_backend(monkeypatch, backend_name, env, wanted):
    monkeypatch.setattr(backend, "BACKEND", backend_name)
    if env is None:
        monkeypatch.delenv(backend.COMPILE_ENV, raising=False)
    else:
        monkeypatch.setenv(backend.COMPILE_ENV, env)
    assert backend.compile_wanted() is wanted
    forward = lambda x: x + 1  # noqa: E731
    compiled = backend.compile_bound(forward)
    assert (compiled is not forward) is wanted
    assert np.array_equal(np.asarray(compiled(mx.arange(3))), [1, 2, 3])


def test_default_table_and_dflash_kernels_switch(monkeypatch) -> None:
    """On a GPU backend the table decides; ``DFLASH_KERNELS=0`` turns the default off."""
    _on_a_cuda_gpu(monkeypatch)
    monkeypatch.setitem(kernel_patch.VERIFY_KERNELS_BY_DEFAULT, "cuda", ("attention",))
    target = tiny_model("muse_glimmer", seed=24, window=16)
    assert kernel_patch.wanted_parts(target) == ("attention",)
    monkeypatch.setattr(kernel_patch.backend, "KERNELS_ENABLED", False)
    assert not kernel_patch.wanted(target)


@pytest.mark.parametrize(
    "arch, bits, group, dtype, parts",
    [
        ("muse_glimmer", 4, 64, None, kernel_patch.VERIFY_KERNEL_PARTS),  # measured
        ("muse_glimmer", 8, 64, None, kernel_patch.VERIFY_KERNEL_PARTS),  # s71
        ("muse_glimmer", 8, 32, None, kernel_patch.VERIFY_KERNEL_PARTS),  # s74
        ("muse_glimmer", 4, 32, None, kernel_patch.VERIFY_KERNEL_PARTS),  # s74
        ("muse_glimmer", 6, 64, None, ()),  # not measured
        ("muse_glimmer", 2, 32, None, ()),  # not measured
        ("muse_glimmer", None, None, None, ()),  # float32
        ("muse_glimmer", None, None, mx.bfloat16, kernel_patch.VERIFY_KERNEL_PARTS),
        ("muse_glimmer", None, None, mx.float16, ()),
        ("qwen3", 4, 64, None, ()),  # not measured
        ("qwen3", None, None, mx.bfloat16, ()),
    ],
)
def test_kernels_default_on_only_where_measured(
    monkeypatch, arch, bits, group, dtype, parts
) -> None:
    """CUDA, Muse Glimmer in 4- or 8-bit groups of 32 / 64 / 128 or dense bf16: plain,
    classic and DFlash decoding alike (the generators ask the same question); nothing
    elsewhere (other bits), switched off, or on Metal.
    """
    _on_a_cuda_gpu(monkeypatch)
    target = tiny_model(arch, seed=27, window=16)
    if dtype is not None:
        target.set_dtype(dtype)
    if bits:
        nn.quantize(target, group_size=group, bits=bits)
        assert kernel_patch.quantized_form(target) == (bits, group)
        assert kernel_patch.dense_dtype(target) is None
    else:
        assert kernel_patch.quantized_form(target) is None
        expected = str(dtype or mx.float32).rsplit(".", 1)[-1]
        assert kernel_patch.dense_dtype(target) == expected
    assert kernel_patch.wanted_parts(target) == parts
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, "0")
    assert kernel_patch.wanted_parts(target) == ()
    monkeypatch.delenv(kernel_patch.VERIFY_KERNELS_ENV)
    monkeypatch.setattr(kernel_patch.backend, "KERNELS_ENABLED", False)
    assert kernel_patch.wanted_parts(target) == ()
    monkeypatch.setattr(kernel_patch.backend, "KERNELS_ENABLED", True)
    monkeypatch.setattr(kernel_patch.backend, "BACKEND", "metal")  # never run there
    assert kernel_patch.wanted_parts(target) == ()


@pytest.mark.parametrize("bits", [4, 8])
def test_groups_of_128_take_the_kernels_by_default(bits) -> None:
    """Session 74 measured groups of 128 (too wide for the tiny models' 64 columns, so
    asked of the table by form)."""
    form, glimmer = ("affine", bits, 128), "muse_glimmer"
    assert kernel_patch.default_parts(glimmer, form, "cuda") == (
        kernel_patch.VERIFY_KERNEL_PARTS
    )
    assert kernel_patch.default_parts(glimmer, form, "metal") == ()
    assert kernel_patch.default_parts("qwen3", form, "cuda") == ()


def test_dense_dtype_wants_every_projection_dense_in_one_dtype(monkeypatch) -> None:
    """A bf16 target with one projection in another dtype, or one quantized, has no
    dense form, so the bf16 default does not apply to it."""
    _on_a_cuda_gpu(monkeypatch)
    target = tiny_model("muse_glimmer", seed=29, window=16)
    target.set_dtype(mx.bfloat16)
    assert kernel_patch.dense_dtype(target) == "bfloat16"
    assert kernel_patch.projection_form(target) == ("dense", "bfloat16")
    target.layers[0].mlp.down_proj.set_dtype(mx.float16)
    assert kernel_patch.dense_dtype(target) is None
    assert kernel_patch.wanted_parts(target) == ()
    partly = tiny_model("muse_glimmer", seed=29, window=16)
    partly.set_dtype(mx.bfloat16)
    nn.quantize(partly, 64, 4, class_predicate=lambda path, m: "layers.0.mlp" in path)
    assert kernel_patch.dense_dtype(partly) is None
    assert kernel_patch.quantized_form(partly) is None
    assert kernel_patch.projection_form(partly) is None
    assert kernel_patch.wanted_parts(partly) == ()


def test_quantized_form_wants_every_projection_in_one_form() -> None:
    target = tiny_model("muse_glimmer", seed=28, window=16)
    nn.quantize(target, group_size=64, bits=4)
    assert kernel_patch.quantized_form(target) == (4, 64)
    assert kernel_patch.projection_form(target) == ("affine", 4, 64)
    # One dense MLP left (as a class predicate can leave it): no form.
    mixed = tiny_model("muse_glimmer", seed=28, window=16)
    nn.quantize(
        mixed,
        64,
        4,
        class_predicate=lambda path, m: isinstance(m, (nn.Linear, nn.Embedding))
        and "layers.0.mlp" not in path,
    )
    assert kernel_patch.quantized_form(mixed) is None
    # Two quantized forms: no form.
    two = tiny_model("muse_glimmer", seed=28, window=16)
    nn.quantize(
        two,
        64,
        8,
        class_predicate=lambda path, m: isinstance(m, nn.Linear)
        and "layers.1." in path,
    )
    nn.quantize(two, 64, 4, class_predicate=lambda path, m: type(m) is nn.Linear)
    assert kernel_patch.quantized_form(two) is None


@pytest.mark.parametrize("form", ["4bit", "bf16"])
def test_verify_kernels_installs_the_measured_default_with_or_without_a_drafter(
    monkeypatch, form
) -> None:
    """Plain decoding (no drafter) and DFlash decoding get the same parts by default, the
    drafter patched with the target when there is one, for both measured forms."""
    _on_a_cuda_gpu(monkeypatch)
    installed = []

    class Recorder:
        def __init__(self, model, drafter, **parts) -> None:
            installed.append((drafter, parts))

        def install(self):
            return self

        def uninstall(self) -> None:
            pass

    monkeypatch.setattr(kernel_patch, "KernelPatch", Recorder)
    target = tiny_model("muse_glimmer", seed=29, window=16)
    if form == "4bit":
        nn.quantize(target, group_size=64, bits=4)
    else:
        target.set_dtype(mx.bfloat16)
    drafter = random_drafter(target, seed=12, block_size=8)
    for with_drafter in (None, drafter):
        with kernel_patch.verify_kernels(target, with_drafter) as patch:
            assert isinstance(patch, Recorder)
    every = dict(use_kernel=None, attention=True, matmul=True, projections=True)
    assert installed == [(None, every), (drafter, every)]
    # A target outside the rule (dense float32, float16) gets nothing, either way.
    for dtype in (mx.float32, mx.float16):
        other = tiny_model("muse_glimmer", seed=29, window=16)
        other.set_dtype(dtype)
        for with_drafter in (None, drafter):
            with kernel_patch.verify_kernels(other, with_drafter) as patch:
                assert patch is None
    assert len(installed) == 2


@pytest.mark.parametrize(
    "env, parts",
    [
        ("attention", ("attention",)),
        ("matmul", ("matmul",)),
        ("matmul, attention", ("attention", "matmul")),
        ("projections,attention", ("attention", "projections")),
        ("on", ("attention", "matmul", "projections")),
        ("off", ()),
    ],
)
def test_env_picks_the_parts(monkeypatch, env, parts) -> None:
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, env)
    target = tiny_model("muse_glimmer", seed=26, window=16)
    assert kernel_patch.wanted_parts(target) == parts
    with kernel_patch.verify_kernels(target) as patch:
        assert (patch is not None) is bool(parts)
        if patch is not None:
            assert (patch.attention, patch.matmul) == (
                "attention" in parts,
                "matmul" in parts,
            )
            # The matmul part fuses with our kernel; projections alone with mlx's.
            assert patch.projections == (parts == ("attention", "projections"))
            forms = {group.form for group in patch._groups}
            fused = patch.projections or patch.matmul
            assert forms == (
                set() if not fused else {"mlx"} if patch.projections else {"kernel"}
            )


def test_env_with_an_unknown_part_raises(monkeypatch) -> None:
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, "attention,qmm")
    target = tiny_model("muse_glimmer", seed=27, window=16)
    with pytest.raises(ValueError, match="DFLASH_VERIFY_KERNELS='attention,qmm'"):
        kernel_patch.wanted_parts(target)


def test_verify_kernels_leaves_a_patched_model_alone() -> None:
    target = tiny_model("muse_glimmer", seed=25, window=16)
    with KernelPatch(target) as outer:
        with kernel_patch.verify_kernels(target, use_kernel=True) as inner:
            assert inner is None and outer.installed
        assert kernel_patch.is_patched(target)
    assert not kernel_patch.is_patched(target)


@pytest.mark.parametrize(
    "env, compile_env, wanted",
    [("1", "0", True), ("0", "1", False), (None, "1", False), (None, "0", False)],
)
def test_compiled_blocks_follow_their_switch_then_compile(
    monkeypatch, env, compile_env, wanted
):
    monkeypatch.setenv(backend.COMPILE_ENV, compile_env)
    if env is None:
        monkeypatch.delenv(kernel_patch.COMPILED_BLOCKS_ENV, raising=False)
    else:
        monkeypatch.setenv(kernel_patch.COMPILED_BLOCKS_ENV, env)
    assert kernel_patch.compiled_blocks_wanted() is wanted
    target = tiny_model("muse_glimmer", seed=30, window=16)
    with KernelPatch(target) as patch:
        assert patch.compile_blocks is wanted
        swapped = [
            hasattr(type(layer.mlp), kernel_patch._ORIGINAL_CLASS)
            for layer in target.layers
        ]
        assert swapped == [wanted] * len(target.layers)
    with KernelPatch(target, matmul=False) as patch:
        assert not patch.compile_blocks


def test_an_mlp_block_runs_its_python_once_per_geometry_and_is_traced_again_for_new_arrays(
    monkeypatch,
):
    """A compiled block replays its trace; a replaced projection weight is traced again
    (a stale trace would keep the old weight); uninstalling restores the class and drops
    the compiled forwards (and with them mlx's traces)."""
    monkeypatch.setenv(kernel_patch.COMPILED_BLOCKS_ENV, "1")
    monkeypatch.setenv(backend.COMPILE_ENV, "0")  # only the blocks' compiles counted
    target = tiny_model("muse_glimmer", seed=31, window=16)
    drafter = random_drafter(target, seed=32, block_size=8)
    base = type(target.layers[0].mlp)
    own_forward, shapes = base.__call__, []

    def counted(self, x):
        shapes.append(x.shape)
        return own_forward(self, x)

    monkeypatch.setattr(base, "__call__", counted)
    compiled, compile = [], mx.compile

    def spy(function, *args, **kwargs):
        compiled.append(weakref.ref(function))
        return compile(function, *args, **kwargs)

    monkeypatch.setattr(kernel_patch.mx, "compile", spy)
    mlp = target.layers[0].mlp
    x = mx.random.normal((1, 3, mlp.down_proj.weight.shape[0]), key=mx.random.key(3))
    # The drafter's MLPs on the small-row kernel, so they are blocks too.
    with KernelPatch(target, drafter, drafter_dense=True) as patch:
        blocks = patch.mlp_blocks(patch.matmul_modules())
        drafter_mlps = [
            m for m in drafter.modules() if type(m).__name__.endswith("DraftMLP")
        ]
        assert (
            len(blocks) == len(target.layers) + len(drafter_mlps) > len(target.layers)
        )
        first = [mlp(x) for _ in range(3)]
        assert shapes == [x.shape]
        assert all(np.array_equal(_f32(first[0]), _f32(out)) for out in first)
        np.testing.assert_array_equal(_f32(first[0]), _f32(own_forward(mlp, x)))
        mlp.down_proj.weight = mlp.down_proj.weight * 2
        again = mlp(x)
        assert shapes == [x.shape, x.shape]
        np.testing.assert_array_equal(_f32(again), _f32(own_forward(mlp, x)))
        assert not np.array_equal(_f32(again), _f32(first[0]))
        long = mx.zeros(
            (1, 40, x.shape[-1])
        )  # a prefill chunk keeps the module's forward
        mlp(long)
        mlp(long)
        assert shapes[2:] == [long.shape, long.shape]
    assert type(mlp) is base and kernel_patch._BOUND not in mlp.__dict__
    assert len(compiled) == 2
    gc.collect()
    assert [ref for ref in compiled if ref() is not None] == []


def test_a_bad_drafter_dense_switch_fails_closed(monkeypatch) -> None:
    """``DFLASH_DRAFTER_DENSE_KERNEL`` set to a word that is not a switch value is an
    error naming it, not a silent default; an argument overrides the variable."""
    monkeypatch.setenv(kernel_patch.DRAFTER_DENSE_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_DRAFTER_DENSE_KERNEL"):
        kernel_patch.drafter_dense_wanted()
    assert kernel_patch.drafter_dense_wanted(True) is True
    monkeypatch.delenv(kernel_patch.DRAFTER_DENSE_ENV)
    assert kernel_patch.drafter_dense_wanted() is False


@pytest.mark.parametrize("qkv", [False, True])
@pytest.mark.parametrize(
    "setting", ["arg-off", "env-off", "default", "arg-on", "env-on"]
)
def test_drafter_dense_projections_can_keep_mlx_matmul(monkeypatch, setting, qkv):
    """Off (the default since session 47), the drafter's unquantized projections keep
    mlx's matmul while the target's (which need batch invariance) and any quantized
    drafter layer stay routed: each MLP's gate / up (and with ``drafter_qkv`` each
    attention's q / k / v, a tails set) become one mlx matmul over their stack, the rest
    keep their class. On, they take the small-row kernel. The DFlash output is the
    target's greedy output either way."""
    monkeypatch.delenv(kernel_patch.DRAFTER_DENSE_ENV, raising=False)
    if setting.startswith("env-"):
        monkeypatch.setenv(
            kernel_patch.DRAFTER_DENSE_ENV, "0" if "off" in setting else "1"
        )
    target = tiny_model("muse_glimmer", seed=21, window=16)
    drafter = random_drafter(target, seed=22, block_size=8)
    dense = [m for m in drafter.modules() if type(m) is nn.Linear]
    assert dense
    given = {"arg-off": False, "arg-on": True}.get(setting)
    patch = KernelPatch(target, drafter, drafter_dense=given, drafter_qkv=qkv)
    routed = {id(m) for m in patch.matmul_modules()}
    shared = {id(m) for m in target.modules() if isinstance(m, nn.Linear)}
    assert shared and shared <= routed
    kept = setting.endswith("-on")
    assert all((id(m) in routed) == kept for m in dense if id(m) not in shared)
    stacked = [] if kept else [m for s, _ in patch.drafter_mlx_sets([]) for m in s]
    layers = drafter.layers
    want_stacked = [
        m for layer in layers for m in (layer.mlp.gate_proj, layer.mlp.up_proj)
    ]
    if qkv:
        attention = [layer.self_attn for layer in layers]
        want_stacked += [m for a in attention for m in (a.q_proj, a.k_proj, a.v_proj)]
    assert {id(m) for m in stacked} == (
        set() if kept else {id(m) for m in want_stacked}
    )
    prompt = mx.random.randint(0, 250, (24,))
    want = [int(t) for t, *_ in mlx_generate_step(prompt, target, max_tokens=12)]
    with patch:
        for module in dense:
            plain = type(module) is nn.Linear
            assert plain == (not kept and id(module) not in {id(m) for m in stacked})
        mlx_groups = [g for g in patch._groups if g.form == "mlx"]
        assert sorted(len(g.members) for g in mlx_groups) == sorted(
            len(s) for s, _ in patch.drafter_mlx_sets([])
        )
        assert sum(g.tails for g in mlx_groups) == (
            0 if kept or not qkv else len(layers)
        )
        got = [
            int(t)
            for t, *_ in dflash_generate_step(prompt, target, drafter, max_tokens=12)
        ]
    assert got == want


def _drafter_case(seed: int, bits) -> tuple:
    """A tiny target, its random drafter (quantized with ``bits``; q / k norm weights
    random, unlike each other and 1) and 60 rows of random tapped features."""
    target = tiny_model("muse_glimmer", seed=seed, window=16)
    drafter = random_drafter(target, seed=seed + 1, block_size=8)
    for index, layer in enumerate(drafter.layers):
        for offset, norm in enumerate((layer.self_attn.q_norm, layer.self_attn.k_norm)):
            key = mx.random.key(100 * seed + 2 * index + offset)
            norm.weight = 1 + mx.random.uniform(-0.5, 0.5, norm.weight.shape, key=key)
    if bits:
        nn.quantize(drafter, group_size=32, bits=bits)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    taps = mx.random.normal((1, 60, width), key=mx.random.key(seed + 2))
    return target, drafter, taps


def _served_prefill_rows(drafter) -> list:
    """Per draft layer that projects them through the patch, the rows of the 40-row
    append :func:`_draft_after_appends` starts with: what the layer's plane keeps (a
    sliding plane's last rows); a call of more than the route's 32 rows keeps mlx's
    ops."""
    limits = [plane.row_limit for plane in drafter.make_context().planes]
    needed = 40 if None in limits else min(40, max(limits))
    kept = [needed if limit is None else min(needed, limit) for limit in limits]
    served = [rows for rows in kept if rows <= 32]
    assert served and len(served) < len(kept)  # the tiny drafter has both kinds
    return served


def _draft_after_appends(
    target, drafter, taps, patch_options, sizes=(40, 5, 5, 5, 5)
) -> tuple:
    """The drafter's context planes and block hidden states after appends of ``sizes``
    rows of ``taps`` (by default a long one, a prefill keeping mlx's matmul where more
    than 32 rows are projected, then rounds of short ones served by the patch), each
    followed by a block."""
    width = drafter.config.block_size
    block = mx.array([[7] + [drafter.config.mask_token_id] * (width - 1)])
    context = drafter.make_context()
    hidden = []
    with KernelPatch(target, drafter, **patch_options) as patch:
        start = 0
        for size in sizes:
            drafter.append_context(context, taps[:, start : start + size], start)
            hidden.append(drafter.hidden_states(block, context))
            start += size
        groups = list(patch._groups)
    planes = [(_f32(p.keys[..., p.begin : p.end, :]), p.end) for p in context.planes]
    return [_f32(h) for h in hidden], planes, groups


@pytest.mark.parametrize("bits", [None, 4])
def test_drafter_qkv_stacks_launch_once_a_block_and_once_a_context_append(
    monkeypatch, bits
) -> None:
    """With ``drafter_qkv``, each draft attention's q / k / v share one stack: a block
    is one launch over all three, a committed context's k / v one launch over their
    rows alone (q's weight is not read), and the planes and hidden states equal the
    unstacked patch's (a one-row shift of the context's keys would not)."""
    target, drafter, taps = _drafter_case(31, bits)
    unstacked = _draft_after_appends(target, drafter, taps, {"drafter_qkv": False})
    launches = []
    real = fused_projections.FusedProjections._project

    def spy(self, x, use_kernel, first=0):
        if self.tails:
            launches.append(
                (first, x.shape[-2], self._rows_from(first).weight.shape[0])
            )
        return real(self, x, use_kernel, first)

    monkeypatch.setattr(fused_projections.FusedProjections, "_project", spy)
    stacked = _draft_after_appends(target, drafter, taps, {"drafter_qkv": True})
    attention = [m for m in drafter.modules() if isinstance(m, DraftAttention)]
    tails = [g for g in stacked[2] if g.tails]
    assert [g.members for g in tails] == [
        [m.q_proj, m.k_proj, m.v_proj] for m in attention
    ]
    assert not any(g.tails for g in unstacked[2])
    q_rows = attention[0].q_proj.weight.shape[0]
    kv_rows = 2 * attention[0].k_proj.weight.shape[0]
    block = drafter.config.block_size
    layers = len(attention)
    prefill = [(1, rows, kv_rows) for rows in _served_prefill_rows(drafter)]
    # Then a round: every layer's context k / v over 5 rows, then the block's q / k / v.
    rounds = [(1, 5, kv_rows)] * layers + [(0, block, q_rows + kv_rows)] * layers
    assert launches == prefill + [(0, block, q_rows + kv_rows)] * layers + rounds * 4
    for (got, got_end), (want, want_end) in zip(stacked[1], unstacked[1]):
        assert got_end == want_end
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(stacked[0], unstacked[0]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


DRAFTER_OPTIONS = [
    {"drafter_qkv": True},
    {"drafter_head_prep": True},
    {"drafter_qkv": True, "drafter_head_prep": True},
]


@pytest.mark.parametrize("kind", ["assistant", "dflash2"])
@pytest.mark.parametrize("options", DRAFTER_OPTIONS)
def test_drafter_options_keep_dflash_decoding_lossless(options, kind) -> None:
    """DFlash decoding with the drafter's stacked q / k / v or its heads prepared in one
    launch is the target's greedy output, with the log-probabilities of the patch
    without them (both drafter architectures)."""
    target = tiny_model("muse_glimmer", seed=36, window=16)
    extra = TINY_DFLASH2 if kind == "dflash2" else {}
    drafter = random_drafter(target, seed=37, block_size=8, **extra)
    assert any(isinstance(m, DraftAttention) for m in drafter.modules())
    prompt = mx.random.randint(0, 250, (30,), key=mx.random.key(38))
    want = [int(t) for t, *_ in mlx_generate_step(prompt, target, max_tokens=24)]
    runs = {}
    for asked_for in (False, True):
        asked = options if asked_for else {name: False for name in options}
        with KernelPatch(target, drafter, **asked) as patch:
            assert any(g.tails for g in patch._groups) == (
                asked_for and "drafter_qkv" in options
            )
            assert patch.route.draft_head_prep == (
                asked_for and "drafter_head_prep" in options
            )
            runs[asked_for] = [
                (int(t), _f32(lp))
                for t, lp, _ in dflash_generate_step(
                    prompt, target, drafter, max_tokens=24
                )
            ]
    assert [t for t, _ in runs[True]] == want == [t for t, _ in runs[False]]
    for (_, got), (_, expected) in zip(runs[True], runs[False]):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [None, 4])
def test_drafter_head_prep_is_one_launch_a_block_and_a_context_append_with_own_bits(
    monkeypatch, bits
) -> None:
    """With ``drafter_head_prep``, a draft attention's block prepares its queries and
    keys in one ``head_prep`` call, and a context append its keys in one; the planes
    and hidden states keep the drafter's own bits (the reference form is mlx's ops in
    the drafter's order)."""
    target, drafter, taps = _drafter_case(39, bits)
    own = _draft_after_appends(target, drafter, taps, {"drafter_head_prep": False})
    calls = []
    real = heads.head_prep

    def spy(queries, keys, **kwargs):
        calls.append((queries.shape[1], queries.shape[2], keys is queries))
        return real(queries, keys, **kwargs)

    monkeypatch.setattr(heads, "head_prep", spy)
    prepared = _draft_after_appends(target, drafter, taps, {"drafter_head_prep": True})
    layers = len(drafter.layers)
    config, block = drafter.config, drafter.config.block_size
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    # The 40-row append's served rows, then rounds of 5 rows and a block: a context
    # call passes its keys as both heads.
    prefill = [(rows, kv_heads, True) for rows in _served_prefill_rows(drafter)]
    blocks = [(block, q_heads, False)] * layers
    rounds = [(5, kv_heads, True)] * layers + blocks
    assert calls == prefill + blocks + rounds * 4
    for (got, got_end), (want, want_end) in zip(prepared[1], own[1]):
        assert got_end == want_end
        np.testing.assert_array_equal(got, want)
    for got, want in zip(prepared[0], own[0]):
        np.testing.assert_array_equal(got, want)


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_drafter_options_keep_the_planes_and_drafts_over_any_appends(sizes) -> None:
    """Over any sequence of context appends (one row to prefill-sized, across the
    sliding plane's limit): with head prep alone the planes and block hidden states
    are the drafter's own bits; with the stacked q / k / v too, its values."""
    target, drafter, _ = _drafter_case(47, None)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    taps = mx.random.normal((1, sum(sizes), width), key=mx.random.key(48))
    runs = [
        _draft_after_appends(target, drafter, taps, options, sizes)
        for options in (
            {"drafter_qkv": False, "drafter_head_prep": False},
            {"drafter_qkv": False, "drafter_head_prep": True},
            {"drafter_qkv": True, "drafter_head_prep": True},
        )
    ]
    own, prepared, both = runs
    for (want, end), (got, got_end), (close, close_end) in zip(
        own[1], prepared[1], both[1]
    ):
        assert end == got_end == close_end
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(close, want, rtol=1e-4, atol=1e-4)
    for want, got, close in zip(own[0], prepared[0], both[0]):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(close, want, rtol=1e-4, atol=1e-4)


def test_drafter_head_prep_keeps_the_own_ops_where_it_does_not_serve(
    monkeypatch,
) -> None:
    """A prefill-sized context call, a RoPE that is not mlx's default form, or a norm
    weight in another dtype than the heads keep the drafter's own ops."""
    target = tiny_model("muse_glimmer", seed=42, window=16)
    drafter = random_drafter(target, seed=43, block_size=8)
    calls = []
    monkeypatch.setattr(heads, "head_prep", lambda *a, **k: calls.append(a))
    attention = drafter.layers[0].self_attn
    dim, kv = attention.head_dim, attention.n_kv_heads
    keys = mx.random.normal((1, 40, kv, dim), key=mx.random.key(44))
    with KernelPatch(target, drafter, drafter_head_prep=True, max_queries=32):
        own = type(attention).__mro__[1].rotate
        for case_keys, rope in (
            (keys, drafter._rope),  # 40 rows: more than the route serves
            (keys[:, :5], nn.RoPE(dim, traditional=True, base=10000.0)),
            (keys[:, :5].astype(mx.bfloat16), drafter._rope),  # f32 norm weights
        ):
            _, got = attention.rotate(None, case_keys, rope, 3)
            _, want = own(attention, None, case_keys, rope, 3)
            np.testing.assert_array_equal(_f32(got), _f32(want))
    assert calls == []


def test_drafter_switches_are_off_by_default_and_read_from_the_environment(
    monkeypatch,
) -> None:
    """Both opt-in (not measured on a GPU yet): ``DFLASH_DRAFTER_FUSED_QKV`` and
    ``DFLASH_DRAFTER_HEAD_PREP`` turn them on, the argument wins, a value that is no
    switch is refused by name, and head prep needs the head-prep part."""
    target = tiny_model("muse_glimmer", seed=45, window=16)
    drafter = random_drafter(target, seed=46, block_size=8)
    for name in (kernel_patch.DRAFTER_QKV_ENV, kernel_patch.DRAFTER_HEAD_PREP_ENV):
        monkeypatch.delenv(name, raising=False)
    patch = KernelPatch(target, drafter)
    assert not patch.drafter_qkv and not patch.route.draft_head_prep
    assert patch.drafter_qkv_parents() == []
    monkeypatch.setenv(kernel_patch.DRAFTER_QKV_ENV, "1")
    monkeypatch.setenv(kernel_patch.DRAFTER_HEAD_PREP_ENV, "1")
    patch = KernelPatch(target, drafter)
    assert patch.drafter_qkv and patch.route.draft_head_prep
    assert len(patch.drafter_qkv_parents()) == len(drafter.layers)
    assert KernelPatch(target).drafter_qkv_parents() == []  # no drafter
    assert not KernelPatch(target, drafter, head_prep=False).route.draft_head_prep
    patch = KernelPatch(target, drafter, drafter_qkv=False, drafter_head_prep=False)
    assert not patch.drafter_qkv and not patch.route.draft_head_prep
    for name in (kernel_patch.DRAFTER_QKV_ENV, kernel_patch.DRAFTER_HEAD_PREP_ENV):
        monkeypatch.setenv(name, "maybe")
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
            KernelPatch(target, drafter)
        monkeypatch.delenv(name)


def test_stacked_planes_are_on_by_default_and_read_from_the_environment(
    monkeypatch,
) -> None:
    """``DFLASH_STACKED_KV`` (on since session 66) picks the route's stacked key
    source, ``0`` the halves', the argument wins, a value that is no switch is
    refused by name, and kept traces tell the two routes apart."""
    target = tiny_model("muse_glimmer", seed=45, window=16)
    monkeypatch.delenv(kernel_patch.STACKED_KV_ENV, raising=False)
    on = KernelPatch(target)
    assert on.route.stacked_kv
    assert on.route.key_source is kernel_patch._stacked_key_source
    monkeypatch.setenv(kernel_patch.STACKED_KV_ENV, "0")
    off = KernelPatch(target)
    assert not off.route.stacked_kv
    assert off.route.key_source is kernel_patch._key_source
    assert on.trace_options() != off.trace_options()
    assert KernelPatch(target, stacked_kv=True).route.stacked_kv
    monkeypatch.setenv(kernel_patch.STACKED_KV_ENV, "maybe")
    with pytest.raises(
        ValueError, match=f"{kernel_patch.STACKED_KV_ENV} must be 0 or 1"
    ):
        KernelPatch(target)


def test_the_stacked_key_source_hands_the_buffers_whole() -> None:
    """Inside a checkpoint a held-back block and the ring come as the stacked
    buffers themselves (no views); the plain source hands their halves."""
    target = tiny_model("muse_glimmer", seed=47, window=16)
    cache = make_prompt_cache(target)
    target(mx.random.randint(0, 250, (1, 30), key=mx.random.key(3)), cache)
    ring = next(plane for plane in cache if isinstance(plane, RingPlane))
    checkpoint = SpeculativeCheckpoint.begin(cache, 4)
    target(mx.random.randint(0, 250, (1, 4), key=mx.random.key(4)), cache)
    plane, block_keys, block_values = kernel_patch._stacked_key_source(
        ring, None, None, 4, ring.window
    )
    assert plane.keys is ring.kv and plane.values is ring.kv and plane.stacked
    assert block_keys is ring.guard.pending and block_values is ring.guard.pending
    halves, keys, values = kernel_patch._key_source(ring, None, None, 4, ring.window)
    assert not halves.stacked and keys.ndim == 4 and values.ndim == 4
    for got, want in zip(plane.halves(), halves.halves()):
        assert mx.array_equal(got, want).item()
    assert mx.array_equal(block_keys[0], keys).item()
    assert mx.array_equal(block_values[1], values).item()
    checkpoint.rollback()
