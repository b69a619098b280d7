"""Sibling projections fused into one small-row matmul: views, values, the input guard."""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash import fused_projections, kernel_patch
from dflash.cache import make_prompt_cache
from dflash.fused_projections import FusedProjections, sibling_sets
from dflash.kernel_patch import KernelPatch
from dflash.metal import backend
from dflash.metal.qmm import small_row_matmul


def _np(array: mx.array) -> np.ndarray:
    return np.asarray(array.astype(mx.float32))


def _linears(widths, depth, bits, group_size, dtype, seed):
    mx.random.seed(seed)
    layers = [nn.Linear(depth, width, bias=False) for width in widths]
    for layer in layers:
        layer.set_dtype(dtype)
    if bits:
        layers = [
            nn.QuantizedLinear.from_linear(layer, group_size=group_size, bits=bits)
            for layer in layers
        ]
    mx.eval([layer.parameters() for layer in layers])
    return layers


def _alone(layer, x: mx.array) -> mx.array:
    """The member's projection through the small-row matmul on its own weights."""
    quantized = isinstance(layer, nn.QuantizedLinear)
    return small_row_matmul(
        x.reshape(-1, x.shape[-1]),
        layer["weight"],
        layer["scales"] if quantized else None,
        layer["biases"] if quantized else None,
        bits=layer.bits if quantized else None,
        group_size=layer.group_size if quantized else None,
    ).reshape(*x.shape[:-1], -1)


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(1, 5).map(lambda w: 32 * w), min_size=2, max_size=4),
    rows=st.integers(1, 20),
    quant=st.sampled_from([(None, None), (4, 32), (8, 64), (4, 128)]),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    form=st.sampled_from(fused_projections.FORMS),
    seed=st.integers(0, 2**16),
)
def test_each_member_gets_its_own_columns(widths, rows, quant, dtype, form, seed):
    """Every member's slice of the stacked output is its own projection (a column
    shift or a wrong member order would move another member's values in), in both
    forms; the mlx form against the member's own mlx-lm forward."""
    bits, group_size = quant
    # K = 256: mlx 0.32.4's CUDA quantized_matmul is wrong when K is one group of 128
    # (8+ rows; docs/benchmarks/h200-2026-12-01-s13), which the mlx form would inherit.
    layers = _linears(widths, 256, bits, group_size, dtype, seed)
    x = mx.random.normal((1, rows, 256)).astype(dtype)
    own = _alone if form == "kernel" else (lambda layer, x: layer(x))
    want = [_np(own(layer, x)) for layer in layers]
    group = FusedProjections(layers, form)
    assert group.bounds[0][0] == 0 and group.bounds[-1][1] == sum(widths)
    for index in reversed(range(len(layers))):  # any member may come first
        got = group.output(index, x, use_kernel=None)
        assert got.shape == (1, rows, widths[index])
        np.testing.assert_allclose(_np(got), want[index], rtol=2e-2, atol=2e-2)
        # The member alone, on its view of the stack, gives the same values as before.
        np.testing.assert_array_equal(_np(own(layers[index], x)), want[index])


def test_an_unknown_form_is_refused() -> None:
    layers = _linears([32, 32], 64, None, None, mx.float32, seed=1)
    with pytest.raises(ValueError, match="form must be one of kernel, mlx"):
        FusedProjections(layers, "cublas")


def test_members_become_views_and_memory_does_not_grow() -> None:
    layers = _linears([512, 512, 256], 512, 4, 64, mx.float32, seed=3)
    before = [{k: np.array(v) for k, v in m.items()} for m in layers]  # copies
    member_bytes = sum(v.nbytes for m in before for v in m.values())
    gc.collect()
    active = mx.get_active_memory()
    group = FusedProjections(layers)
    gc.collect()
    grown = mx.get_active_memory() - active
    assert grown < 0.1 * member_bytes, (grown, member_bytes)
    for layer, values in zip(layers, before):
        for name, value in values.items():
            np.testing.assert_array_equal(np.asarray(layer[name]), value)
    assert group.weight.shape[0] == 512 + 512 + 256


@pytest.mark.parametrize("compiled", [False, True])
def test_a_member_fed_another_input_computes_alone(monkeypatch, compiled) -> None:
    """The group serves an input only to members called with that same array.
    Compiled, the product's Python runs once (the trace) and is replayed after."""
    monkeypatch.setenv(backend.COMPILE_ENV, "1" if compiled else "0")
    layers = _linears([64, 96, 32], 64, None, None, mx.float32, seed=5)
    group = FusedProjections(layers)
    x, other = mx.random.normal((1, 3, 64)), mx.random.normal((1, 3, 64))
    calls = []
    real = fused_projections.bind_matmul

    def spy(*args, **kwargs):
        bound = real(*args, **kwargs)
        return lambda rows, counters=None: calls.append(rows.shape) or bound(
            rows, counters
        )

    fused_projections.bind_matmul = spy
    try:
        q = group.output(0, x, None)
        k = group.output(1, other, None)  # another input: computed for it
        v = group.output(2, other, None)  # served from that second launch
        q_again = group.output(0, x, None)  # the first launch was dropped
    finally:
        fused_projections.bind_matmul = real
    assert len(calls) == (1 if compiled else 3)
    np.testing.assert_allclose(_np(q), _np(_alone(layers[0], x)), atol=1e-5)
    np.testing.assert_allclose(_np(k), _np(_alone(layers[1], other)), atol=1e-5)
    np.testing.assert_allclose(_np(v), _np(_alone(layers[2], other)), atol=1e-5)
    np.testing.assert_allclose(_np(q_again), _np(q), atol=0)


def test_only_matching_siblings_are_grouped() -> None:
    class Parent(nn.Module):
        def __init__(self, **children) -> None:
            super().__init__()
            for name, child in children.items():
                setattr(self, name, child)

    dense = lambda width, bias=False: nn.Linear(64, width, bias=bias)  # noqa: E731
    quantized = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
    parents = [
        Parent(q_proj=dense(32), k_proj=dense(16), v_proj=dense(16), o_proj=dense(64)),
        Parent(q_proj=dense(32), k_proj=dense(16, bias=True)),  # a bias: not stacked
        Parent(gate_proj=dense(32), up_proj=quantized),  # mixed kinds
        Parent(gate_proj=dense(32)),  # one member
        Parent(gate_proj=dense(32), up_proj=nn.Linear(48, 32, bias=False)),  # two K
    ]
    found = sibling_sets(parents)
    assert found == [[parents[0].q_proj, parents[0].k_proj, parents[0].v_proj]]


def _glimmer(seed: int, bits, prompt_seed: int, length: int):
    """A tiny Muse Glimmer (quantized with ``bits``), its cache and a prompt."""
    target = tiny_model("muse_glimmer", seed=seed, window=16)
    if bits:
        nn.quantize(target, group_size=32, bits=bits)
    mx.random.seed(prompt_seed)
    return target, make_prompt_cache(target), mx.random.randint(0, 250, (1, length))


@pytest.mark.parametrize("bits", [None, 4])
def test_patched_forward_is_the_same_fused_or_not(bits) -> None:
    """A decode step and a verify block give the same logits with and without fusion
    (reference forms: the fused stack is read column by column)."""
    logits = {}
    for fuse in (False, True):
        target, cache, prompt = _glimmer(21, bits, 4, 20)
        with KernelPatch(target, fuse=fuse) as patch:
            assert bool(patch._groups) == fuse
            target(prompt, cache=cache)
            block = target(prompt[:, :16], cache=cache)
            step = target(prompt[:, :1], cache=cache)
        logits[fuse] = (_np(block), _np(step))
        # Leaving removes the slots; the layers keep working on their views.
        assert all("_dflash_fused" not in m.__dict__ for m in target.modules())
    for unfused, fused in zip(logits[False], logits[True]):
        np.testing.assert_allclose(fused, unfused, rtol=1e-4, atol=1e-4)


def test_env_switch_turns_fusion_off(monkeypatch) -> None:
    target = tiny_model("muse_glimmer", seed=2, window=16)
    monkeypatch.setenv(fused_projections.FUSED_ENV, "0")
    assert not KernelPatch(target).fuse
    monkeypatch.setenv(fused_projections.FUSED_ENV, "1")
    assert KernelPatch(target).fuse
    monkeypatch.delenv(fused_projections.FUSED_ENV)
    assert KernelPatch(target).fuse


def test_a_second_patch_reuses_the_stack_until_a_weight_changes() -> None:
    layers = _linears([64, 32], 64, 4, 32, mx.float32, seed=8)
    first = FusedProjections(layers)
    again = FusedProjections(layers)
    assert again.weight is first.weight and again.scales is first.scales
    x = mx.random.normal((2, 64))
    np.testing.assert_array_equal(
        _np(again.output(1, x, None)), _np(first.output(1, x, None))
    )
    # A member given new weights (a load, an update) gets a fresh stack with them.
    replacement = _linears([32], 64, 4, 32, mx.float32, seed=9)[0]
    layers[1].update(dict(replacement.items()))
    fresh = FusedProjections(layers)
    assert fresh.weight is not first.weight
    np.testing.assert_allclose(
        _np(fresh.output(1, x, None)), _np(_alone(replacement, x)), atol=1e-5
    )


def test_a_dropped_model_drops_its_stacks() -> None:
    layers = _linears([64, 32], 64, None, None, mx.float32, seed=10)
    FusedProjections(layers)
    key = id(layers[0])
    assert key in fused_projections._STACKS
    del layers
    gc.collect()
    assert key not in fused_projections._STACKS


@pytest.mark.parametrize("part", ["matmul", "projections"])
def test_a_failed_stack_leaves_nothing_installed(monkeypatch, part) -> None:
    """Install is all or nothing: a stack that cannot be built undoes every swap."""
    target = tiny_model("muse_glimmer", seed=6, window=16)
    classes = {id(m): type(m) for m in target.modules()}
    built = []

    class Failing(FusedProjections):
        def __init__(self, members, form, *options):
            if built:
                raise MemoryError("no room for the stack")
            built.append(members)
            super().__init__(members, form, *options)

    monkeypatch.setattr(kernel_patch, "FusedProjections", Failing)
    matmul = part == "matmul"
    patch = KernelPatch(target, fuse=True, matmul=matmul, projections=not matmul)
    with pytest.raises(MemoryError, match="no room"):
        patch.install()
    assert not patch.installed and built
    assert {id(m): type(m) for m in target.modules()} == classes
    assert all("_dflash_fused" not in m.__dict__ for m in target.modules())
    assert not kernel_patch.is_patched(target)


@pytest.mark.parametrize("bits", [None, 4])
def test_projections_part_keeps_mlx_lm_logits_and_prefill(bits) -> None:
    """The projections part (mlx's matmul over each stacked set) gives a decode step
    and a verify block mlx-lm's own logits, and leaves prefill chunks unfused."""
    logits = {}
    for projections in (False, True):
        target, cache, prompt = _glimmer(23, bits, 5, 40)
        patch = KernelPatch(target, attention=False, matmul=False, projections=True)
        calls = []
        real = fused_projections.FusedProjections._mlx_product
        fused_projections.FusedProjections._mlx_product = lambda self, x, rows: (
            calls.append(x.shape[-2]) or real(self, x, rows)
        )
        try:
            with (
                patch
                if projections
                else KernelPatch(target, attention=False, matmul=False)
            ):
                assert kernel_patch.is_patched(target) == projections
                target(prompt, cache=cache)  # 40 rows: a prefill chunk, unfused
                block = target(prompt[:, :16], cache=cache)
                step = target(prompt[:, :1], cache=cache)
        finally:
            fused_projections.FusedProjections._mlx_product = real
        layers = len(target.layers)
        # Two sets a layer (attention, MLP), each once per call of 16 and 1 rows.
        assert calls == ([16] * 2 * layers + [1] * 2 * layers if projections else [])
        logits[projections] = (_np(block), _np(step))
        assert not kernel_patch.is_patched(target)
        assert all("_dflash_fused" not in m.__dict__ for m in target.modules())
    for unfused, fused in zip(logits[False], logits[True]):
        np.testing.assert_allclose(fused, unfused, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("part", ["matmul", "projections"])
def test_a_member_given_a_new_weight_is_not_served_by_the_stale_stack(part) -> None:
    """Replacing a fused member's weight while the patch is installed: the member then
    computes with its new weight (the stack still holds the old one), its siblings keep
    theirs."""
    target = tiny_model("muse_glimmer", seed=13, window=16)
    attn = target.layers[0].self_attn
    x = mx.random.normal((1, 2, attn.q_proj.weight.shape[1]), key=mx.random.key(4))
    options = (
        dict(matmul=True) if part == "matmul" else dict(matmul=False, projections=True)
    )
    with KernelPatch(target, **options):
        before = attn.q_proj(x)
        k_before = attn.k_proj(x)
        attn.q_proj.weight = attn.q_proj.weight * 2
        after = attn.q_proj(x)
        k_after = attn.k_proj(x)
        want = x @ attn.q_proj.weight.T
    np.testing.assert_allclose(
        np.asarray(after), np.asarray(want), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(after), 2 * np.asarray(before), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(k_after), np.asarray(k_before))


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(1, 4).map(lambda w: 32 * w), min_size=2, max_size=4),
    first=st.integers(0, 3),
    rows=st.integers(1, 20),
    quant=st.sampled_from([(None, None), (4, 32), (8, 64)]),
    form=st.sampled_from(fused_projections.FORMS),
    tails=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_tails_set_reads_only_the_rows_from_its_calling_member_on(
    widths, first, rows, quant, form, tails, seed
):
    """With ``tails``, a member called with a new input launches over its own and the
    later members' stacked rows only (the earlier members' weights are not read), the
    later members are served from that launch, and an earlier member called with the
    same input launches again; without, one launch covers the whole stack and serves
    the earlier members too. Every member gets exactly its own columns."""
    first = first % len(widths)
    bits, group_size = quant
    layers = _linears(widths, 128, bits, group_size, mx.float32, seed)
    x = mx.random.normal((1, rows, 128))
    own = _alone if form == "kernel" else (lambda layer, x: layer(x))
    want = [_np(own(layer, x)) for layer in layers]
    group = FusedProjections(layers, form, tails=tails)
    launches = []
    real_rows = group._rows_from

    def spy(start):
        found = real_rows(start)
        launches.append(found.weight.shape[0])
        return found

    group._rows_from = spy
    got = {first: group.output(first, x, use_kernel=None)}
    for index in range(first + 1, len(layers)):
        got[index] = group.output(index, x, use_kernel=None)
    assert launches == [sum(widths[first:]) if tails else sum(widths)]
    # Nothing waits once the launched members are taken; unfused, the earlier ones do.
    assert (group._source is None) == (tails or first == 0)
    if first > 0:
        got[first - 1] = group.output(first - 1, x, use_kernel=None)
        assert launches[1:] == ([sum(widths[first - 1 :])] if tails else [])
    for index, out in got.items():
        assert out.shape == (1, rows, widths[index])
        np.testing.assert_allclose(_np(out), want[index], rtol=1e-4, atol=1e-4)


def test_a_tail_of_the_stack_is_a_view_not_a_copy() -> None:
    """The rows a tails launch reads (members 1 on) are a view of the stack: memory does
    not grow by their bytes, and they hold the stack's values."""
    layers = _linears([512, 512, 256], 512, 4, 64, mx.float32, seed=9)
    group = FusedProjections(layers, tails=True)
    gc.collect()
    active = mx.get_active_memory()
    rows = group._rows_from(1)
    gc.collect()
    tail_bytes = sum(a.nbytes for a in rows.arrays())
    assert mx.get_active_memory() - active < 0.1 * tail_bytes, tail_bytes
    assert rows.splits == [512]
    for name, array in zip(("weight", "scales", "biases"), rows.arrays()):
        np.testing.assert_array_equal(
            np.asarray(array), np.asarray(group.__dict__[name][512:])
        )
