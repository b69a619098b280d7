"""Muse Glimmer's decoder layer as two compiled replays (``dflash.traced_layers``).

What is proven where:

* CPU (CI): the kernel path forced as on CUDA with every launch replaced by a stand-in
  whose outputs depend on every input it is given (its integer scalars exactly, the
  float arrays through their sums), the traced layers give the eager patch's outputs
  at every verify step of a run whose positions move and whose rings wrap (hypothesis
  over accepted counts), so every runtime value reaches the replays as an input; a
  trace that keeps the first step's head-prep integers fails that check (the
  negative control). Each replay takes its own counter region; replacing an array of a
  layer drops its traces; calls the traces do not serve keep the layer's own forward;
  the install takes only layers whose class and probe allow it, and only with compile
  and the kernel path on.
* CUDA (tests marked ``cuda``): with real launches, traced and eager layers give the
  same bits over a run of verify steps, and a DFlash generation keeps its tokens.
"""

from __future__ import annotations

import gc
import re
import weakref
from collections import Counter
from typing import List

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import muse_glimmer

from benchmarks import layer_stack
from dflash import (
    fused_projections,
    kernel_patch,
    prepared_heads,
    residual_layers,
    traced_layers,
)
from dflash.bench.scale_target import BRANCH_SCALE, randomize
from dflash.cache.checkpoint import SpeculativeCheckpoint
from dflash.kernel_patch import KernelPatch
from dflash.metal import attention, backend, groups, heads, norms, prefetch, tensor_qmm

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def _size(shape) -> int:
    size = 1
    for extent in shape:
        size *= extent
    return size


def _read_in_place(spec, inputs, output_shapes) -> list:
    """The elements the head prep and the gated fold read of their inputs: q, k and
    (with the stacked block) v, or the gate, from the offsets their integer scalars
    end with on (a traced layer hands them one fused projection output), and those
    scalars without the offsets; every other launch's inputs as they are. So a stand-in
    mixing what it reads gives the eager layer's outputs exactly when the offsets
    select the eager layer's arrays (the kernels' own reads at offsets are checked,
    emulated, in tests/test_head_prep.py and tests/test_fused_offsets.py)."""

    def taken(array, offset, size):
        return mx.take(array.reshape(-1), offset + mx.arange(size, dtype=mx.int32))

    if spec.base == heads.HEAD_PREP.base:
        q, k, v, q_weight, k_weight, params, fparams = inputs
        stacked = len(output_shapes[1]) == 5
        k_size = _size(output_shapes[1]) // (2 if stacked else 1)
        return [
            taken(q, params[8], _size(output_shapes[0])),
            taken(k, params[9], k_size),
            taken(v, params[10], k_size) if stacked else v,
            q_weight, k_weight, params[:8], fparams,
        ]  # fmt: skip
    if spec.base == attention.FOLD_GATED.base:
        stats, weighted, fold_params, gate = inputs
        gate = taken(gate, fold_params[5], _size(output_shapes[0]))
        return [stats, weighted, fold_params[:5], gate]
    return inputs


def mixing_launch(spec, inputs, output_shapes, output_dtypes, count, dtype):
    """A stand-in launch whose outputs depend on every input, in integers only (so a
    fused trace computes the eager bits): the int32 inputs through their sums, the
    float ones through the sum of their integer parts and how many of their elements
    are positive; each output is that
    number plus the element's index, modulo 97 (bounded, and no two rows alike, so a
    norm after it keeps the difference). The head prep and the gated fold mix what
    they read (:func:`_read_in_place`)."""
    mixed = mx.array(0, mx.int32)
    for array in _read_in_place(spec, inputs, output_shapes):
        if array.dtype == mx.int32:
            mixed = mixed + mx.sum(array) % 61
        elif array.dtype in FLOATS:
            mixed = mixed + mx.sum(array.astype(mx.int32)) % 61
            mixed = mixed + mx.sum((array > 0).astype(mx.int32)) % 61
    outs = []
    for index, (shape, out_dtype) in enumerate(zip(output_shapes, output_dtypes)):
        pattern = mx.arange(_size(shape), dtype=mx.int32).reshape(shape)
        outs.append(((pattern + mixed + index) % 97).astype(out_dtype))
    return outs


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
    """The kernel path taken as on CUDA (with ``mx.compile``), launches mixed."""
    monkeypatch.setattr(groups, "launch_groups", mixing_launch)
    # Replays traced by earlier tests hold the launches of their time, and the step
    # memo the forms of their backend.
    monkeypatch.setattr(groups, "_REPLAYS", {})
    monkeypatch.setattr(traced_layers, "_PRE_CALLS", {})
    monkeypatch.setattr(traced_layers, "_POST_CALLS", {})
    # Traces kept by earlier tests' installs were made with their launches.
    monkeypatch.setattr(kernel_patch, "_trace_epoch", object())
    monkeypatch.delenv(kernel_patch.KEEP_TRACES_ENV, raising=False)
    monkeypatch.setattr(backend, "use_kernel_path", lambda use, auto: use is not False)
    monkeypatch.setattr(backend, "BACKEND", "cuda")
    monkeypatch.setattr(prepared_heads, "gated_fold_matches", lambda dtype, use: True)
    monkeypatch.delenv(backend.COMPILE_ENV, raising=False)
    monkeypatch.delenv(traced_layers.TRACED_LAYERS_ENV, raising=False)
    # The residual norms (on by default in CUDA's traced layers) only where a test asks:
    # the stand-in launches do not compute them.
    monkeypatch.setenv(residual_layers.RESIDUAL_NORMS_ENV, "0")


def _is_traced(layer: nn.Module) -> bool:
    base = getattr(type(layer), kernel_patch._ORIGINAL_CLASS, None)
    return base is not None and type(layer) is kernel_patch._SUBCLASSES.get(
        ("traced", base)
    )


def verify_run(
    model,
    traced: bool,
    accepted: List[int],
    context: int = 40,
    residual_norms: bool = False,
    **patch,
):
    """Verify blocks of 16 rows over planes prefilled with ``context`` rows, each
    committed with its accepted count (so positions move and the rings wrap); the
    outputs of every block (``patch``: more :class:`KernelPatch` keywords)."""
    cache = layer_stack.prefill(model, context)
    blocks = [
        mx.random.normal((1, 16, model.args.hidden_size), key=mx.random.key(i)) * 0.5
        for i in range(len(accepted))
    ]
    outs = []
    with KernelPatch(
        model, traced_layers=traced, residual_norms=residual_norms, **patch
    ):
        assert all(_is_traced(layer) is traced for layer in model.layers)
        for block, count in zip(blocks, accepted):
            checkpoint = SpeculativeCheckpoint.begin(cache, 16)
            out = layer_stack.run_layers(model, block.astype(mx.bfloat16), cache)
            mx.eval(out)
            checkpoint.commit(count)
            outs.append(out)
    return outs, [plane.offset for plane in cache]


@pytest.fixture(scope="module")
def tiny_stack():
    return layer_stack.build_layers("tiny", "4bit", 4)


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        assert mx.array_equal(g, w).item(), f"block {index} differs"


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # patches only
)
@given(accepted=st.lists(st.integers(1, 16), min_size=3, max_size=6))
def test_traced_layers_give_the_eager_outputs_at_every_step(
    tiny_stack, kernel_path_on_cpu, accepted
):
    want, offsets = verify_run(tiny_stack, False, accepted)
    got, traced_offsets = verify_run(tiny_stack, True, accepted)
    assert traced_offsets == offsets == [40 + sum(accepted)] * 4
    _assert_same(got, want)


def test_a_trace_that_keeps_its_first_integers_is_caught(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """The negative control: head-prep integers captured at the first step (a stale
    RoPE position) make the check above fail."""
    accepted = [16, 5, 9]
    want, _ = verify_run(tiny_stack, False, accepted)
    first = {}
    real = heads.head_prep_ints

    def stale(q_shape, k_heads, prep, stacked, **offsets):
        key = (q_shape, k_heads, prep.rope_base)  # a sliding layer's, a full one's
        return first.setdefault(key, real(q_shape, k_heads, prep, stacked, **offsets))

    monkeypatch.setattr(heads, "head_prep_ints", stale)
    got, _ = verify_run(tiny_stack, True, accepted)
    assert mx.array_equal(got[0], want[0]).item()
    assert not all(mx.array_equal(g, w).item() for g, w in zip(got[1:], want[1:]))


def _counted(monkeypatch, module, name: str) -> list:
    """Record the calls of ``module.name`` (its keyword arguments)."""
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_steps_layers_of_one_kind_share_the_hosts_work(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """The step memo: the first layer of each attention kind works out the head prep
    and the plan of a step, the other layers of its kind look them up (the outputs
    stay the eager ones: the test above)."""
    plans = _counted(monkeypatch, attention, "make_plan")
    preps = _counted(monkeypatch, traced_layers, "prep_of")
    accepted = [16, 5, 9]
    verify_run(tiny_stack, True, accepted)
    kinds = {
        traced_layers._attention_kind(layer.self_attn) for layer in tiny_stack.layers
    }
    assert len(tiny_stack.layers) > len(kinds) >= 2
    assert len(preps) == len(accepted) * len(kinds)
    assert len(plans) == len(accepted) * len(kinds)
    starts = sorted({call["query_start"] for call in plans})
    assert starts == [40, 56, 61]  # each step's own position


def test_layers_of_another_kind_do_not_share_the_memo(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """The negative side: a layer whose attention scale differs from its kind's (the
    float scalars its attention reads) gets its own entry, so the traced outputs stay
    the eager ones; keying the memo without the scale makes them differ. (The stand-in
    launch sees a float through its integer part: the scale moves by 3.)"""
    attn = tiny_stack.layers[1].self_attn
    monkeypatch.setattr(attn, "scale", attn.scale + 3.0)
    accepted = [16, 5]
    want, _ = verify_run(tiny_stack, False, accepted)
    got, _ = verify_run(tiny_stack, True, accepted)
    _assert_same(got, want)
    real_kind = traced_layers._attention_kind
    monkeypatch.setattr(traced_layers, "_attention_kind", lambda a: real_kind(a)[:-1])
    monkeypatch.setattr(traced_layers, "_POST_CALLS", {})
    # Traces kept by earlier tests' installs were made with their launches.
    monkeypatch.setattr(kernel_patch, "_trace_epoch", object())
    monkeypatch.delenv(kernel_patch.KEEP_TRACES_ENV, raising=False)
    monkeypatch.setattr(traced_layers, "_KINDS", {})
    got, _ = verify_run(tiny_stack, True, accepted)
    assert not all(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_a_refused_plan_is_not_memoised_and_ids_are_never_reused():
    table = {}
    with pytest.raises(ValueError):
        traced_layers._memo(table, ("k",), lambda: (_ for _ in ()).throw(ValueError()))
    assert table == {}
    assert traced_layers._memo(table, ("k",), lambda: 7) == 7
    assert traced_layers._memo(table, ("k",), lambda: 8) == 7
    numbers = {}
    first = traced_layers._interned(numbers, ("a",), 2)
    second = traced_layers._interned(numbers, ("b",), 2)
    assert traced_layers._interned(numbers, ("a",), 2) == first
    third = traced_layers._interned(numbers, ("c",), 2)  # clears the table
    again = traced_layers._interned(numbers, ("a",), 2)
    assert len({first, second, third, again}) == 4


def test_each_replay_takes_its_own_counters(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    regions = []
    real = groups.CounterPool.take_located

    def take_located(pool, count):
        fill, start, region = real(pool, count)
        regions.append((fill, start, count))
        return fill, start, region

    monkeypatch.setattr(groups.CounterPool, "take_located", take_located)
    verify_run(tiny_stack, True, [16, 16, 16])
    # The tiny stack's launches take none: its replays cut no region.
    assert not regions
    # K >= 256 (the tensor-core matmuls' merged K split) takes them.
    verify_run(wide_heads_stack(2), True, [16, 16, 16], context=48)
    assert regions, "the matmuls took no counters"
    seen = set()
    for fill, start, count in regions:
        cells = {(fill, start + i) for i in range(count)}
        assert not cells & seen, "two launches were handed one counter"
        seen |= cells


def test_counter_feed_cuts_regions_in_order_and_refuses_overruns():
    feed = groups.CounterFeed(mx.arange(10, dtype=mx.int32))
    with groups.counter_feed(feed):
        first = groups.launch_counters(3)
        second = groups.launch_counters(4)
        assert groups.launch_counters(0).shape == (1,)  # the shared placeholder
        with pytest.raises(RuntimeError, match="counter feed of 10"):
            groups.launch_counters(4)
        assert feed.taken == 7  # the refused call took nothing
        assert groups.launch_counters(3).tolist() == [7, 8, 9]
    assert first.tolist() == [0, 1, 2] and second.tolist() == [3, 4, 5, 6]
    counting = groups.CounterFeed()
    with groups.counter_feed(counting):
        assert groups.launch_counters(5).tolist() == [0] * 5
    assert counting.taken == 5
    assert groups._FEED.get() is None


def test_replacing_an_array_drops_the_traces(tiny_stack, kernel_path_on_cpu):
    cache = layer_stack.prefill(tiny_stack, 40)
    block = (mx.random.normal((1, 16, 64)) * 0.5).astype(mx.bfloat16)
    layer = tiny_stack.layers[0]
    with KernelPatch(tiny_stack, traced_layers=True):
        outs = []
        for step in range(3):
            if step == 2:  # an equal-valued new array: new traces, the same bits
                norm = layer.post_attention_layernorm
                norm.weight = mx.array(norm.weight)
            checkpoint = SpeculativeCheckpoint.begin(cache, 16)
            outs.append(layer_stack.run_layers(tiny_stack, block, cache))
            mx.eval(outs[-1])
            if step == 1:
                kept = layer.__dict__[kernel_patch._TRACES]
                assert kept.holds()
            checkpoint.rollback()
        assert layer.__dict__[kernel_patch._TRACES] is not kept
    assert kernel_patch._TRACES not in layer.__dict__  # dropped with the patch
    _assert_same(outs[1:], outs[:2])


def _traces_of(model) -> list:
    return [layer.__dict__.get(kernel_patch._TRACES) for layer in model.layers]


def _kept_of(model) -> list:
    return [layer.__dict__.get(kernel_patch._KEPT_TRACES) for layer in model.layers]


def _replay_counter(monkeypatch) -> list:
    """Record every replay :mod:`dflash.traced_layers` makes (each a new trace)."""
    made = []
    real = traced_layers._Replay.__init__

    def counted(self, function):
        made.append(function)
        real(self, function)

    monkeypatch.setattr(traced_layers._Replay, "__init__", counted)
    return made


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # patches only
)
@given(accepted=st.lists(st.integers(1, 16), min_size=2, max_size=4))
def test_the_next_install_takes_back_the_traces_and_keeps_the_bits(
    tiny_stack, kernel_path_on_cpu, monkeypatch, accepted
):
    """Each generation installs the patch again: the traces the last install made are
    taken back (no new trace, the same replays) and still give the eager outputs at
    every step of a run whose positions move and rings wrap."""
    kernel_patch.forget_traces(tiny_stack)
    want, _ = verify_run(tiny_stack, False, accepted)
    first, _ = verify_run(tiny_stack, True, accepted)
    kept = [entry[1] for entry in _kept_of(tiny_stack)]
    assert all(traces is not None and traces.pre for traces in kept)
    made = _replay_counter(monkeypatch)
    again, _ = verify_run(tiny_stack, True, accepted[::-1] + [3])
    assert made == []  # other positions, the same geometries: no trace made
    assert all(k is entry[1] for k, entry in zip(kept, _kept_of(tiny_stack)))
    want_again, _ = verify_run(tiny_stack, False, accepted[::-1] + [3])
    _assert_same(first, want)
    _assert_same(again, want_again)


def test_kept_traces_are_taken_only_under_the_same_options(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """Another switch, another part of the patch, :func:`forget_traces` or an array the
    layer no longer holds: the kept traces are dropped and new ones made; with
    ``DFLASH_KEEP_TRACES=0`` an uninstall keeps none."""
    layer = tiny_stack.layers[1]

    def run_and_keep():
        verify_run(tiny_stack, True, [4, 16])
        return _kept_of(tiny_stack)

    def taken_after(change) -> bool:
        before = run_and_keep()
        change()
        with KernelPatch(tiny_stack, traced_layers=True):
            now = _traces_of(tiny_stack)
        return all(n is b[1] for n, b in zip(now, before))

    assert taken_after(lambda: None)
    assert not taken_after(lambda: monkeypatch.setenv("DFLASH_SOMETHING", "1"))
    assert not taken_after(kernel_patch.forget_traces)
    norm = layer.post_attention_layernorm
    assert not taken_after(lambda: setattr(norm, "weight", mx.array(norm.weight)))
    before = run_and_keep()
    with KernelPatch(tiny_stack, traced_layers=False):
        pass  # layers it does not trace keep what they kept
    assert _kept_of(tiny_stack) == before
    with KernelPatch(tiny_stack, traced_layers=True, residual_norms=True):
        assert _traces_of(tiny_stack) == [None] * len(tiny_stack.layers)
    assert _kept_of(tiny_stack) == [None] * len(tiny_stack.layers)
    run_and_keep()
    kernel_patch.forget_traces(tiny_stack)
    assert _kept_of(tiny_stack) == [None] * len(tiny_stack.layers)
    monkeypatch.setenv(kernel_patch.KEEP_TRACES_ENV, "0")
    assert run_and_keep() == [None] * len(tiny_stack.layers)
    monkeypatch.setenv(kernel_patch.KEEP_TRACES_ENV, "sometimes")
    with pytest.raises(ValueError, match=kernel_patch.KEEP_TRACES_ENV):
        KernelPatch(tiny_stack, traced_layers=True).install()
    assert not any(_is_traced(layer) for layer in tiny_stack.layers)


def test_kept_traces_go_with_their_model(kernel_path_on_cpu):
    """Kept traces live on their layer: dropping the model frees it (no table of the
    module keeps a layer, its arrays or its compiled replays alive)."""
    model = layer_stack.build_layers("tiny", "4bit", 2)
    verify_run(model, True, [5, 16])
    assert all(kept is not None for kept in _kept_of(model))
    layer = weakref.ref(model.layers[0])
    del model
    gc.collect()
    assert layer() is None


def test_a_kept_trace_replays_the_launches_it_captured(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """The negative control: kept traces are replayed, not re-made. A launch changed
    between installs (which no option names) still gives the old launch's outputs
    through the kept traces; after :func:`forget_traces` the new one's."""
    accepted = [16, 7]
    old, _ = verify_run(tiny_stack, True, accepted)

    def shifted(spec, inputs, output_shapes, output_dtypes, count, dtype):
        outs = mixing_launch(spec, inputs, output_shapes, output_dtypes, count, dtype)
        return [((out.astype(mx.int32) + 5) % 97).astype(out.dtype) for out in outs]

    monkeypatch.setattr(groups, "launch_groups", shifted)
    monkeypatch.setattr(groups, "_REPLAYS", {})
    stale, _ = verify_run(tiny_stack, True, accepted)
    _assert_same(stale, old)
    kernel_patch.forget_traces()
    fresh, _ = verify_run(tiny_stack, True, accepted)
    want, _ = verify_run(tiny_stack, False, accepted)
    _assert_same(fresh, want)
    assert not any(mx.array_equal(f, o).item() for f, o in zip(fresh, old))


def test_calls_the_traces_do_not_serve_keep_the_layers_forward(
    tiny_stack, kernel_path_on_cpu
):
    h = (mx.random.normal((1, 40, 64)) * 0.5).astype(mx.bfloat16)
    want = {}
    for traced in (False, True):
        with KernelPatch(tiny_stack, traced_layers=traced):
            cache = layer_stack.prefill(tiny_stack, 8)
            long = layer_stack.run_layers(tiny_stack, h, cache)  # 40 rows: a prefill
            none = tiny_stack.layers[0](h[:, :4], "causal", None)  # no cache
            mx.eval(long, none)
            assert all(
                kernel_patch._TRACES not in layer.__dict__
                for layer in tiny_stack.layers
            )
            want.setdefault("long", long)
            want.setdefault("none", none)
            assert mx.array_equal(long, want["long"]).item()
            assert mx.array_equal(none, want["none"]).item()


def test_the_install_needs_compile_the_kernel_path_and_the_class(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    with KernelPatch(tiny_stack, traced_layers=True):
        assert all(_is_traced(layer) for layer in tiny_stack.layers)
    assert not any(_is_traced(layer) for layer in tiny_stack.layers)
    with KernelPatch(tiny_stack, traced_layers=True, head_prep=False):
        assert not any(_is_traced(layer) for layer in tiny_stack.layers)
    with KernelPatch(tiny_stack, traced_layers=True, gate_epilogue=False):
        assert not any(_is_traced(layer) for layer in tiny_stack.layers)
    monkeypatch.setenv(backend.COMPILE_ENV, "0")
    with KernelPatch(tiny_stack, traced_layers=True):
        assert not any(_is_traced(layer) for layer in tiny_stack.layers)


def test_layers_the_kernels_do_not_take_are_left_eager(tiny_stack, kernel_path_on_cpu):
    layer = tiny_stack.layers[0]
    assert traced_layers.kernels_take(layer, 256)
    assert not traced_layers.kernels_take(layer, 512)  # past the attention's chunk
    gate = layer.self_attn.gate_proj
    saved = gate.scales
    try:
        gate.scales = saved.astype(mx.float16)  # a gate in another dtype: no gated fold
        assert not traced_layers.kernels_take(layer, 256)
        with KernelPatch(tiny_stack, traced_layers=True):
            assert not _is_traced(layer)
            assert all(_is_traced(other) for other in tiny_stack.layers[1:])
    finally:
        gate.scales = saved


def test_on_by_default_and_a_bad_switch_is_refused(monkeypatch):
    monkeypatch.delenv(traced_layers.TRACED_LAYERS_ENV, raising=False)
    assert traced_layers.traced_layers_wanted()
    assert not traced_layers.traced_layers_wanted(False)
    monkeypatch.setenv(traced_layers.TRACED_LAYERS_ENV, "0")
    assert not traced_layers.traced_layers_wanted()
    assert traced_layers.traced_layers_wanted(True)
    monkeypatch.setenv(traced_layers.TRACED_LAYERS_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_TRACED_LAYERS"):
        traced_layers.traced_layers_wanted()


def test_on_the_cpu_backend_nothing_is_traced(tiny_stack, monkeypatch):
    monkeypatch.delenv(backend.COMPILE_ENV, raising=False)
    monkeypatch.setattr(backend, "BACKEND", None)
    with KernelPatch(tiny_stack, traced_layers=True):
        assert not any(_is_traced(layer) for layer in tiny_stack.layers)


class SwappedResidualLayer(nn.Module):
    """A Glimmer-shaped layer whose forward is not Glimmer's (the probe must refuse it)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for name in ("self_attn", "mlp") + traced_layers.NORMS:
            setattr(self, name, getattr(layer, name))

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)  # no post norm
        return h + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(h))
        )


def test_the_probe_takes_glimmers_layer_and_refuses_another_forward():
    model = tiny_model("muse_glimmer", seed=3, window=16)
    layer = model.layers[0]
    assert traced_layers.serves(layer)
    assert traced_layers.forward_matches(layer, type(layer))
    other = SwappedResidualLayer(layer)
    assert not traced_layers.serves(other)  # not the re-stated class
    assert not traced_layers.forward_matches(other, type(other))


@pytest.mark.parametrize("module", [traced_layers, residual_layers])
def test_a_probe_verdict_does_not_carry_over_to_another_geometry(module, monkeypatch):
    """A False verdict found on one model's layers (on CUDA: a small head width whose
    bits mlx's kernels do not repeat) must not keep another model's layers eager."""
    monkeypatch.setattr(module, "_VERDICTS", {})
    model = tiny_model("muse_glimmer", seed=3, window=16)
    model.set_dtype(mx.bfloat16)  # the wide stack's dtype: only the geometry differs
    small = model.layers[0]
    wide = wide_heads_stack(1).layers[0]
    base = type(small)
    original = base.__call__
    monkeypatch.setattr(
        base, "__call__", lambda self, x, mask=None, cache=None: original(self, x) * 2
    )
    assert not module.forward_matches(small, base)
    monkeypatch.setattr(base, "__call__", original)
    assert module.forward_matches(wide, base)
    assert not module.forward_matches(small, base)  # its own verdict is kept
    assert residual_layers.layer_geometry(small) != residual_layers.layer_geometry(wide)
    twin = tiny_model("muse_glimmer", seed=4, window=16)
    twin.set_dtype(mx.bfloat16)
    assert residual_layers.layer_geometry(small) == residual_layers.layer_geometry(
        twin.layers[0]
    )


def norm_standing_launch(model, slip: float = 0.0):
    """A stand-in launch that computes the residual norm as its reference does (mlx's
    norms and adds, so a hand-off gives the next layer's own input norm) and mixes
    every other launch; ``slip`` is added to the next norm's rows (a negative
    control).

    A trace cannot read its scalars, so the epsilons are ``model``'s: a post-norm's
    for the branch, a pre-norm's for the next norm (Glimmer's layers share them).
    """
    layer = model.layers[0]
    eps = layer.post_attention_layernorm.eps
    next_eps = layer.pre_feedforward_layernorm.eps
    assert next_eps == layer.input_layernorm.eps

    def launch(spec, inputs, output_shapes, output_dtypes, count, dtype):
        if spec.base not in ("residual_norm", "residual_norm_l2"):
            return mixing_launch(
                spec, inputs, output_shapes, output_dtypes, count, dtype
            )
        branch, residual, weight, next_weight = inputs[:4]
        if tuple(output_shapes[1]) != tuple(branch.shape):  # no next norm
            h, _ = norms.reference_residual_norm(branch, residual, weight, eps)
            return [h, mx.zeros(output_shapes[1], output_dtypes[1])]
        h, normed = norms.reference_residual_norm(
            branch, residual, weight, eps, next_weight, next_eps
        )
        return [h, normed + slip]

    return launch


def test_traced_residual_norms_give_the_eager_residual_layers_outputs(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """With the residual norms on, a traced layer's post-attention trace launches the
    two residual norms a layer (the eager residual layers' launches, same outputs), the
    last also taking the next layer's input norm, which that layer then does not
    compute."""
    launched = []
    standing = norm_standing_launch(tiny_stack)
    monkeypatch.setenv(prefetch.PREFETCH_ENV, "0")  # launches counted by name

    def counting(spec, *rest):
        launched.append(spec.base)
        return standing(spec, *rest)

    monkeypatch.setattr(groups, "launch_groups", counting)
    accepted = [16, 4, 11]
    want, offsets = verify_run(tiny_stack, False, accepted, residual_norms=True)
    eager = launched.count("residual_norm")
    launched.clear()
    input_norms = _count_input_norms(tiny_stack, monkeypatch)
    got, traced_offsets = verify_run(tiny_stack, True, accepted, residual_norms=True)
    assert traced_offsets == offsets
    _assert_same(got, want)
    # Eagerly the two launches (with and without the next norm) are built once a
    # geometry, traced once a layer's trace: later calls replay them.
    assert eager == 2
    assert launched.count("residual_norm") == 2 * len(tiny_stack.layers)
    # Only the first layer's traces normed their own input (the others were handed it).
    assert set(input_norms) == {0}
    # The stand-in computes mlx's ops, so the traces without the residual norms agree.
    launched.clear()
    plain, _ = verify_run(tiny_stack, True, accepted)
    assert "residual_norm" not in launched
    _assert_same(plain, got)


def test_the_post_norm_asks_the_mlps_first_weights_into_the_l2_changing_nothing(
    kernel_path_on_cpu, monkeypatch
):
    """With the residual norms on CUDA, each traced layer's first residual norm (the
    one before its MLP) carries the prefetch CTAs over its MLP's fused gate / up from
    its first trace on: the grid grows by the fetchers, the inputs end with the very
    weights the MLP's launch streams, its scales repack as words and the ranges. The
    outputs equal those without it; ``DFLASH_L2_PREFETCH=0`` and uninstall remove it.
    (A stack whose K takes the tensor-core form, which the prefetch plans from.)"""
    model = wide_heads_stack(2)
    standing = norm_standing_launch(model)
    carried = []

    def recording(spec, inputs, shapes, dtypes, count, dtype):
        if spec.base == "residual_norm_l2":
            rows = inputs[0].size // inputs[0].shape[-1]
            # The launch is traced (launch_replayed): its inputs are stand-ins here.
            _, words, params = inputs[-3:]
            carried.append((count, rows, words.dtype, params.size))
        return standing(spec, inputs, shapes, dtypes, count, dtype)

    monkeypatch.setattr(groups, "launch_groups", recording)
    accepted = [16, 4, 11]
    monkeypatch.setenv(prefetch.PREFETCH_ENV, "0")
    want, _ = verify_run(model, True, accepted, residual_norms=True)
    assert carried == []
    monkeypatch.delenv(prefetch.PREFETCH_ENV)
    layers = model.layers
    with KernelPatch(model, traced_layers=True, residual_norms=True):
        linked = [layer.__dict__[traced_layers.MLP_GROUP] for layer in layers]
    assert [megabytes for _, megabytes in linked] == [prefetch.DEFAULT_MEGABYTES] * 2
    assert all(g.members[0] is l.mlp.gate_proj for (g, _), l in zip(linked, layers))
    assert all(traced_layers.MLP_GROUP not in vars(layer) for layer in layers)
    planned = []
    mlp_prefetch = traced_layers.mlp_prefetch

    def recorded(layer, x, use_kernel):
        plan = mlp_prefetch(layer, x, use_kernel)
        planned.append((layer.__dict__[traced_layers.MLP_GROUP][0], plan))
        return plan

    monkeypatch.setattr(traced_layers, "mlp_prefetch", recorded)
    got, _ = verify_run(model, True, accepted, residual_norms=True)
    _assert_same(got, want)
    # At every call: the weights the MLP's own launch streams, and its scales repack.
    assert len(planned) == len(layers) * len(accepted)
    for group, plan in planned:
        assert plan.weight is group.weight is group.reads[0]
        assert plan.scales.nbytes == group.reads[1].nbytes
    assert len({id(group.weight) for group, _ in planned}) == len(layers)
    # Kept across installs: a second run plans nothing new and takes back the traces
    # the first kept (no launch traced again).
    first_plans = {id(plan) for _, plan in planned}
    planned.clear()
    traced_before = len(carried)
    again, _ = verify_run(model, True, accepted, residual_norms=True)
    _assert_same(again, want)
    assert {id(plan) for _, plan in planned} == first_plans
    assert len(carried) == traced_before
    kernel_patch.forget_traces(model)
    assert all(traced_layers.L2_PLAN not in vars(layer) for layer in layers)
    ranges = prefetch.HEAD_WORDS + 2 * prefetch.RANGE_WORDS
    assert carried
    for count, rows, words, size in carried:
        assert count == rows + prefetch.FETCHERS
        assert words == mx.uint32 and size == ranges
    # Dense (bf16) MLPs are not linked: measured on 4-bit weights only.
    dense = layer_stack.build_layers("tiny", "bf16", 1)
    with KernelPatch(dense, traced_layers=True, residual_norms=True) as patch:
        assert patch.route.residual_norms
        assert traced_layers.MLP_GROUP not in vars(dense.layers[0])


def _count_input_norms(model, monkeypatch) -> List[int]:
    """The layers whose pre-attention trace norms its own input, by index (once a
    trace made from now on)."""
    calls: List[int] = []
    index = {id(layer): i for i, layer in enumerate(model.layers)}
    pre_attention = traced_layers._pre_attention

    def counted(layer, prep, handed, *rest):
        if not handed:
            calls.append(index[id(layer)])
        return pre_attention(layer, prep, handed, *rest)

    monkeypatch.setattr(traced_layers, "_pre_attention", counted)
    return calls


def test_a_slipped_hand_off_shows_in_the_outputs(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """Negative control: the next layers compute from the rows handed to them (a slip
    in them changes every block's outputs)."""
    monkeypatch.setattr(groups, "launch_groups", norm_standing_launch(tiny_stack))
    accepted = [16, 4, 11]
    want, _ = verify_run(tiny_stack, True, accepted, residual_norms=True)
    handed = traced_layers._handed

    def slipped(layer, x):
        rows = handed(layer, x)
        return None if rows is None else rows + 1.0

    monkeypatch.setattr(traced_layers, "_handed", slipped)
    got, _ = verify_run(tiny_stack, True, accepted, residual_norms=True)
    assert not any(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_a_hand_off_is_taken_only_by_its_layer_for_that_very_output(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """The rows go to the linked successor and only for the array its predecessor
    returned; any other call clears them. Links join consecutive traced layers while the
    residual norms are on, and go at uninstall."""
    monkeypatch.setattr(groups, "launch_groups", norm_standing_launch(tiny_stack))
    first, second = tiny_stack.layers[:2]
    output, normed = mx.zeros((1, 2, 8)), mx.ones((1, 2, 8))
    for layer, given, taken in (
        (second, output, True),
        (second, mx.zeros((1, 2, 8)), False),
        (first, output, False),
    ):
        traced_layers._HANDOFF.value = (output, normed, second)
        handed = traced_layers._handed(layer, given)
        assert (handed is normed) is taken
        assert traced_layers._HANDOFF.value is None
    assert traced_layers._handed(second, output) is None
    layers = tiny_stack.layers
    with KernelPatch(tiny_stack, traced_layers=True, residual_norms=True):
        successors = [traced_layers.successor_norm(layer) for layer in layers]
        assert successors[:-1] == [layer.input_layernorm for layer in layers[1:]]
        assert successors[-1] is None
        # Held by the instance, not as a child module.
        assert traced_layers.SUCCESSOR not in layers[0]
    assert all(traced_layers.SUCCESSOR not in vars(layer) for layer in layers)
    with KernelPatch(tiny_stack, traced_layers=True, residual_norms=False):
        assert all(traced_layers.successor_norm(layer) is None for layer in layers)


def _is_residual(layer: nn.Module) -> bool:
    base = getattr(type(layer), kernel_patch._ORIGINAL_CLASS, None)
    return base is not None and type(layer) is kernel_patch._SUBCLASSES.get(
        ("residual", base)
    )


def test_cudas_traced_layers_take_the_residual_norms_unless_told(
    tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """On CUDA with no switch the traced layers run the residual norms (and hand off)
    while eager layers keep mlx's ops; the argument and the switch turn them off, and
    other backends keep them off."""
    monkeypatch.delenv(residual_layers.RESIDUAL_NORMS_ENV)
    with KernelPatch(tiny_stack, traced_layers=True) as patch:
        assert patch.route.residual_norms
        assert traced_layers.successor_norm(tiny_stack.layers[0]) is not None
    with KernelPatch(tiny_stack, traced_layers=False):
        assert not any(map(_is_residual, tiny_stack.layers))
        assert not any(map(_is_traced, tiny_stack.layers))
    with KernelPatch(tiny_stack, traced_layers=False, residual_norms=True):
        assert all(map(_is_residual, tiny_stack.layers))
    with KernelPatch(tiny_stack, traced_layers=True, residual_norms=False) as patch:
        assert not patch.route.residual_norms
    monkeypatch.setenv(residual_layers.RESIDUAL_NORMS_ENV, "0")
    with KernelPatch(tiny_stack, traced_layers=True) as patch:
        assert not patch.route.residual_norms
    monkeypatch.delenv(residual_layers.RESIDUAL_NORMS_ENV)
    monkeypatch.setattr(backend, "BACKEND", "metal")
    assert not residual_layers.residual_norms_wanted(traced=True)


# --------------------------------------------------------------------- CUDA


def wide_heads_stack(layers: int, seed: int = 0):
    """A small Muse Glimmer stack with Glimmer's head width (128: the prepared
    attention's probe takes it on CUDA), 4-bit, window 32."""
    args = muse_glimmer.ModelArgs(
        hidden_size=256, num_hidden_layers=layers, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=512,
        sliding_window=32,
    )  # fmt: skip
    model = muse_glimmer.Model(args)
    randomize(model, seed, mx.bfloat16, branch_scale=BRANCH_SCALE)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.cuda
@cuda
@settings(max_examples=4, deadline=None)
@given(accepted=st.lists(st.integers(1, 16), min_size=4, max_size=8))
def test_cuda_traced_layers_give_the_eager_bits(accepted):
    model = wide_heads_stack(4)
    want, offsets = verify_run(model, False, accepted, context=100)
    got, traced_offsets = verify_run(model, True, accepted, context=100)
    assert traced_offsets == offsets
    _assert_same(got, want)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("width", ["wide_heads", "glimmer"])
def test_cuda_layers_over_stacked_planes_give_the_halves_bits(width):
    """Traced layers with the planes and blocks bound stacked give the eager layers'
    bits with their halves bound apart (rings wrapping, blocks partly accepted)."""
    if width == "glimmer":
        model, context = layer_stack.build_layers("full", "4bit", 2), 2100
    else:
        model, context = wide_heads_stack(4), 100
    accepted = [16, 3, 16, 7, 1, 12]
    want, offsets = verify_run(model, False, accepted, context, stacked_kv=False)
    got, stacked_offsets = verify_run(model, True, accepted, context, stacked_kv=True)
    assert stacked_offsets == offsets
    _assert_same(got, want)


@pytest.mark.cuda
@cuda
def test_cuda_traced_layers_give_the_eager_bits_at_glimmers_width():
    model = layer_stack.build_layers("full", "4bit", 2)
    accepted = [16, 3, 16, 7, 1]
    want, _ = verify_run(model, False, accepted, context=2100)
    got, _ = verify_run(model, True, accepted, context=2100)
    _assert_same(got, want)


@pytest.mark.cuda
@cuda
def test_cuda_traced_residual_norms_give_the_traced_bits_at_glimmers_width():
    """The residual norms give mlx's norms' and adds' bits, so a traced layer with them
    gives the traced layer's bits without them."""
    model = layer_stack.build_layers("full", "4bit", 2)
    accepted = [16, 3, 16, 7, 1]
    want, _ = verify_run(model, True, accepted, context=2100)
    got, _ = verify_run(model, True, accepted, context=2100, residual_norms=True)
    _assert_same(got, want)


@pytest.mark.cuda
@cuda
def test_cuda_l2_prefetch_keeps_the_bits_at_glimmers_width(monkeypatch):
    """The post norms' prefetch CTAs (on by default) change no bit of any block, and
    each layer's MLP was linked for them."""
    model = layer_stack.build_layers("full", "4bit", 2)
    accepted = [16, 3, 16, 7, 1]
    monkeypatch.setenv(prefetch.PREFETCH_ENV, "0")
    want, _ = verify_run(model, True, accepted, context=2100, residual_norms=True)
    monkeypatch.setenv(prefetch.PREFETCH_ENV, "16")
    planned = []
    mlp_prefetch = traced_layers.mlp_prefetch

    def recorded(layer, x, use_kernel):
        plan = mlp_prefetch(layer, x, use_kernel)
        planned.append(plan)
        return plan

    monkeypatch.setattr(traced_layers, "mlp_prefetch", recorded)
    got, _ = verify_run(model, True, accepted, context=2100, residual_norms=True)
    _assert_same(got, want)
    assert len(planned) == 2 * len(accepted) and all(planned)
    assert all(plan.megabytes == 16 for plan in planned)


def standing_launch(spec, inputs, output_shapes, output_dtypes, count, dtype):
    """A stand-in launch that adds no views: zeros of the declared shapes, made to
    depend on every input (so the graph keeps what feeds the launch)."""
    outs = [mx.zeros(shape, dt) for shape, dt in zip(output_shapes, output_dtypes)]
    return mx.depends(outs, [array for array in inputs if isinstance(array, mx.array)])


VIEWS = ("Reshape", "Slice", "Transpose", "Squeeze", "Split")


def _replay_primitives(monkeypatch, tmp_path, model) -> dict:
    """The primitives of the last pre- and post-attention replays of a verify run,
    by name (each replay's inputs evaluated first, so its graph is its own)."""
    counted = {}
    real = traced_layers._Replay.__call__

    def call(replay, *inputs):
        mx.eval(*inputs)
        out = real(replay, *inputs)
        if replay.compiled is not None:
            outs = list(out) if isinstance(out, tuple) else [out]
            dot = tmp_path / "replay.dot"
            mx.export_to_dot(str(dot), *outs)
            labels = re.findall(r'label ="([A-Za-z_0-9]+)"', dot.read_text())
            counted["pre" if len(inputs) == 2 else "post"] = Counter(labels)
        return out

    monkeypatch.setattr(traced_layers._Replay, "__call__", call)
    verify_run(model, True, [16, 5, 16], context=48)
    return counted


def test_the_replays_hold_only_the_views_the_members_need(
    kernel_path_on_cpu, monkeypatch, tmp_path
):
    """Every view in a trace is an array each replay builds and mlx's encode visits.
    With the tensor-core matmuls (K >= 256, as on CUDA) the traces hold one view per
    fused member (q / k / v / gate before the attention, the MLP's gate / up after
    it) and at most one split of the counters region; no reshape (the head prep takes
    the projections with their heads merged, the fold stores them merged, the
    matmuls take and give their inputs' leading shape), no transpose, and no slice
    inside (a lone counters region is the replay's input itself). Session 34 counted
    13 and 25 reshapes and 2 transposes; session 60, 7 and 2 reshapes and 4-6 and 2-5
    slices."""
    monkeypatch.setattr(groups, "launch_groups", standing_launch)
    counted = _replay_primitives(monkeypatch, tmp_path, wide_heads_stack(2))
    pre, post = counted["pre"], counted["post"]
    # q / k / v / gate are read in place in the fused output: no view of them.
    assert pre["AsStrided"] == 0 and post["AsStrided"] == 2, (pre, post)
    for view in ("Reshape", "Transpose", "Squeeze"):
        assert pre[view] == post[view] == 0, (view, dict(pre), dict(post))
    # The counters region a replay is given comes from the pool, outside the trace
    # (where the pool cut it ahead: at most one slice and one split among the
    # replay's inputs); inside, the launches' regions are one split of it, or it.
    assert pre["Slice"] <= 1 and post["Slice"] <= 1, (pre, post)
    assert pre["Split"] <= 1 + 1 and post["Split"] <= 1 + 1, (pre, post)
    assert pre["Depends"] == 2 and post["Depends"] == 5  # the launches


def test_without_the_member_major_store_the_replays_take_the_members_views(
    kernel_path_on_cpu, monkeypatch, tmp_path
):
    """Where the fused launch stores the plain layout (``DFLASH_QMM_MEMBER_MAJOR=0``)
    nothing is read in place: the pre-attention trace takes the four members' views
    (one node each) as before, and the same launches."""
    monkeypatch.setenv(tensor_qmm.MEMBER_MAJOR_ENV, "0")
    monkeypatch.setattr(groups, "launch_groups", standing_launch)
    counted = _replay_primitives(monkeypatch, tmp_path, wide_heads_stack(2))
    pre, post = counted["pre"], counted["post"]
    assert pre["Split"] >= 1 and pre["AsStrided"] == 0, (pre, post)  # mx.split
    assert pre["Depends"] == 2 and post["Depends"] == 5


# ------------------------------------------------------- the members read in place


@pytest.fixture(scope="module")
def wide_stack():
    """Two layers whose q / k / v / gate take the member-major tensor-core launch."""
    return wide_heads_stack(2)


def _in_place_calls(monkeypatch) -> list:
    """Record the ``offsets`` each head prep launch is given (None: the members)."""
    calls = []
    real = heads.launch_head_prep

    def recorded(*args, **kwargs):
        calls.append(kwargs.get("offsets"))
        return real(*args, **kwargs)

    monkeypatch.setattr(heads, "launch_head_prep", recorded)
    return calls


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # patches only
)
@given(accepted=st.lists(st.integers(1, 16), min_size=3, max_size=5))
def test_traced_layers_reading_the_fused_output_in_place_give_the_eager_outputs(
    wide_stack, kernel_path_on_cpu, monkeypatch, accepted
):
    """With the tensor-core matmuls (member-major fused q / k / v / gate), the traces
    hand the head prep and the gated fold the fused output with the members' offsets,
    and give the eager layers' outputs (whose launches take the members' views) at
    every step: the stand-in mixes what each launch reads at its offsets."""
    # Each install traces anew (kept traces would not launch the head prep again).
    monkeypatch.setenv(kernel_patch.KEEP_TRACES_ENV, "0")
    want, offsets = verify_run(wide_stack, False, accepted, context=48)
    calls = _in_place_calls(monkeypatch)
    used = []
    real_traces = traced_layers._traces

    def recorded_traces(layer, slot):
        used.append(real_traces(layer, slot))
        return used[-1]

    monkeypatch.setattr(traced_layers, "_traces", recorded_traces)
    got, traced_offsets = verify_run(wide_stack, True, accepted, context=48)
    assert traced_offsets == offsets
    _assert_same(got, want)
    rows, q_width, kv_width = 16, 4 * 128, 2 * 128
    member = (0, rows * q_width, rows * (q_width + kv_width))
    # Each layer's pre trace (its first, eager call and its trace) reads in place.
    assert len(calls) >= len(wide_stack.layers), calls
    assert all(call == member for call in calls), calls
    fused = member + (rows * (q_width + 2 * kv_width),)
    for traces in used:
        assert set(traces.fused.values()) == {fused}
        assert all(key[-1] == fused for key in traces.pre), traces.pre.keys()


# The prepared form (the head prep in the fused launch, DFLASH_QMM_PREPARED_HEADS=1).
# wide_heads_stack's attention: 4 query and 2 KV heads of 128, batch 1.
_WIDE = {"q": 4 * 128, "kv": 2 * 128, "heads": (4, 2), "dim": 128}


def _prepared_mixing(misplaced: bool = False):
    """A stand-in for the prepared launch: the plain launch's stand-in, then the head
    prep's stand-in over its output at the member offsets, laid out as the prepared
    launch stores them (queries, then the stacked block, then the gate); every other
    launch as :func:`mixing_launch`. ``misplaced``: the gate stored where the block
    belongs and the block after it (a negative control: the same sizes). Returns the
    launch and the list of spec bases it saw."""
    seen = []

    def launch(spec, inputs, output_shapes, output_dtypes, count, dtype):
        seen.append(spec.base)
        if not spec.base.endswith(tensor_qmm.PREPARED_SUFFIX):
            return mixing_launch(
                spec, inputs, output_shapes, output_dtypes, count, dtype
            )
        extra = len(tensor_qmm.PREPARED_INPUTS)
        ints, fparams, q_weight, k_weight = inputs[-extra:]
        y, partial = mixing_launch(
            spec, inputs[:-extra], output_shapes, output_dtypes, count, dtype
        )
        width = 2 * _WIDE["q"] + 2 * _WIDE["kv"]
        seq = y.size // width
        q_heads, kv_heads = _WIDE["heads"]
        queries, block = mixing_launch(
            heads.HEAD_PREP,
            [y, y, y, q_weight, k_weight, ints, fparams],
            [(1, seq, q_heads, _WIDE["dim"]), (2, 1, kv_heads, seq, _WIDE["dim"])],
            [dtype, dtype],
            0,
            dtype,
        )
        gate_at = seq * (_WIDE["q"] + 2 * _WIDE["kv"])
        flat = [queries.reshape(-1), block.reshape(-1), y[gate_at:]]
        if misplaced:
            flat = [flat[0], flat[2], flat[1]]
        return [mx.concatenate(flat), partial]

    return launch, seen


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # patches only
)
@given(accepted=st.lists(st.integers(1, 16), min_size=3, max_size=5))
def test_the_prepared_launchs_views_give_the_eager_outputs(
    wide_stack, kernel_path_on_cpu, monkeypatch, accepted
):
    """With the prepared form on, the traces take the queries and the stacked block as
    views of the one fused launch's output (no head prep launch) and the gate from
    its offset, and give the eager layers' outputs at every step (the prepared
    kernel's own arithmetic is emulated in tests/test_prepared_qkv.py)."""
    monkeypatch.setenv(kernel_patch.KEEP_TRACES_ENV, "0")
    launch, seen = _prepared_mixing()
    monkeypatch.setattr(groups, "launch_groups", launch)
    want, offsets = verify_run(wide_stack, False, accepted, context=48)
    seen.clear()
    monkeypatch.setenv(tensor_qmm.PREPARED_HEADS_ENV, "1")
    got, traced_offsets = verify_run(wide_stack, True, accepted, context=48)
    assert traced_offsets == offsets
    _assert_same(got, want)
    prepared = [base for base in seen if base.endswith(tensor_qmm.PREPARED_SUFFIX)]
    # Each layer's pre trace: one prepared launch (its eager first call, its trace).
    assert len(prepared) >= len(wide_stack.layers), seen
    assert heads.HEAD_PREP.base not in seen[seen.index(prepared[0]) :], seen


def test_a_prepared_output_with_block_and_gate_misplaced_shows_in_the_outputs(
    wide_stack, kernel_path_on_cpu, monkeypatch
):
    monkeypatch.setenv(kernel_patch.KEEP_TRACES_ENV, "0")
    accepted = [16, 5, 9]
    want, _ = verify_run(wide_stack, False, accepted, context=48)
    launch, seen = _prepared_mixing(misplaced=True)
    monkeypatch.setattr(groups, "launch_groups", launch)
    monkeypatch.setenv(tensor_qmm.PREPARED_HEADS_ENV, "1")
    got, _ = verify_run(wide_stack, True, accepted, context=48)
    assert any(base.endswith(tensor_qmm.PREPARED_SUFFIX) for base in seen)
    assert not any(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_where_the_prepared_form_does_not_serve_the_head_prep_launch_stays(
    wide_stack, kernel_path_on_cpu, monkeypatch
):
    """A matmul form without a prepared form (8-bit, two m-tiles: see
    ``tensor_qmm.prepared_serves``) keeps the head prep launch, and the outputs."""
    monkeypatch.setenv(kernel_patch.KEEP_TRACES_ENV, "0")
    accepted = [16, 5, 9]
    launch, seen = _prepared_mixing()
    monkeypatch.setattr(groups, "launch_groups", launch)
    want, _ = verify_run(wide_stack, False, accepted, context=48)
    seen.clear()
    monkeypatch.setenv(tensor_qmm.PREPARED_HEADS_ENV, "1")

    def unserved(spec):
        raise ValueError(f"{spec.base} has no prepared-heads form")

    # (Not through prepared_serves and a cache clear: specs are compared by identity,
    # and later tests hold the memoised prepared forms.)
    monkeypatch.setattr(tensor_qmm, "prepared_spec", unserved)
    got, _ = verify_run(wide_stack, True, accepted, context=48)
    _assert_same(got, want)
    assert not any(base.endswith(tensor_qmm.PREPARED_SUFFIX) for base in seen)
    assert heads.HEAD_PREP.base in seen


def test_the_prepared_form_is_off_by_default_and_a_bad_switch_is_refused(
    monkeypatch,
) -> None:
    monkeypatch.delenv(tensor_qmm.PREPARED_HEADS_ENV, raising=False)
    assert tensor_qmm.prepared_heads() is False
    monkeypatch.setenv(tensor_qmm.PREPARED_HEADS_ENV, "sometimes")
    with pytest.raises(ValueError, match=tensor_qmm.PREPARED_HEADS_ENV):
        tensor_qmm.prepared_heads()


@pytest.mark.parametrize("slip", ["queries_read_the_gate", "gate_reads_the_queries"])
def test_a_wrong_offset_read_in_place_shows_in_the_outputs(
    wide_stack, kernel_path_on_cpu, monkeypatch, slip
):
    """Negative controls: the head prep told to read the queries where the gate lies,
    or the fold the gate where the queries lie (both in bounds, both the right size),
    change the outputs."""
    accepted = [16, 5, 9]
    want, _ = verify_run(wide_stack, False, accepted, context=48)
    if slip == "queries_read_the_gate":
        real_ints = heads.head_prep_ints

        def slipped_ints(q_shape, k_heads, prep, stacked, offsets=heads.NO_OFFSETS):
            if offsets != heads.NO_OFFSETS:
                q, k, v = offsets
                offsets = (2 * v - k, k, v)  # the gate's block
            return real_ints(q_shape, k_heads, prep, stacked, offsets)

        monkeypatch.setattr(heads, "head_prep_ints", slipped_ints)
    else:
        real_form = attention.kernel_form

        def slipped_form(plan, dtype, gated, gate_offset=0):
            return real_form(plan, dtype, gated, 0)  # the queries' block

        monkeypatch.setattr(attention, "kernel_form", slipped_form)
    got, _ = verify_run(wide_stack, True, accepted, context=48)
    assert not any(mx.array_equal(g, w).item() for g, w in zip(got, want))


def test_the_fused_output_is_read_in_place_only_for_its_one_set_in_order(
    wide_stack, tiny_stack, kernel_path_on_cpu, monkeypatch
):
    """``fused_offsets``: the four members of one member-major set in q / k / v /
    gate order, each still served by it, each as wide as its heads, the projections'
    input of the stack's dtype; None otherwise (the trace then takes the members'
    views)."""
    x = mx.zeros((1, 16, wide_stack.args.hidden_size), mx.bfloat16)
    with KernelPatch(wide_stack, traced_layers=True) as patch:
        layer = wide_stack.layers[0]
        use = patch.route.use_kernel
        assert traced_layers.fused_offsets(layer, x, False, use) == (
            0, 8192, 12288, 16384
        )  # fmt: skip
        # An input of another dtype than the stack's: the members run alone.
        wide = x.astype(mx.float32)
        assert traced_layers.fused_offsets(layer, wide, True, use) is None
        # Not the four in order: the set's members reordered.
        group = layer.self_attn.q_proj.__dict__[fused_projections.MEMBER_SLOT].group
        monkeypatch.setattr(group, "members", group.members[::-1])
        assert traced_layers.fused_offsets(layer, x, False, use) is None
        monkeypatch.undo()
    # A member given a new array since it was stacked: no longer served by the set.
    with KernelPatch(wide_stack, traced_layers=True) as patch:
        layer = wide_stack.layers[1]
        use = patch.route.use_kernel
        attn = layer.self_attn
        kept = attn.k_proj.weight
        attn.k_proj.weight = mx.array(kept)
        try:
            assert traced_layers.fused_offsets(layer, x, False, use) is None
        finally:
            attn.k_proj.weight = kept
    # The tiny stack's fused launch (K < 256) stores the plain layout.
    tiny = mx.zeros((1, 16, tiny_stack.args.hidden_size), mx.bfloat16)
    with KernelPatch(tiny_stack, traced_layers=True) as patch:
        layer = tiny_stack.layers[0]
        assert traced_layers.fused_offsets(layer, tiny, False, None) is None


def test_each_fused_member_holds_its_slot_under_the_name_the_traced_layers_read(
    tiny_stack,
) -> None:
    with KernelPatch(tiny_stack, traced_layers=True):
        attn = tiny_stack.layers[0].self_attn
        for index, name in enumerate(traced_layers.FUSED_MEMBERS):
            slot = getattr(attn, name).__dict__[fused_projections.MEMBER_SLOT]
            assert slot.index == index and slot.group.members[index] is getattr(
                attn, name
            )
    assert fused_projections.MEMBER_SLOT not in attn.q_proj.__dict__


def test_forget_traces_drops_the_chunk_major_copies_of_the_models_arrays() -> None:
    """``forget_traces(model)`` drops the chunk-major scales and biases kept for the
    model's own arrays (the bind's repacks, :func:`tensor_qmm.chunk_major`), and no
    others."""
    layer = nn.QuantizedLinear(512, 16, bias=False, group_size=64, bits=4)
    model = nn.Sequential(layer)
    other = mx.ones((2, 8))
    for values in (layer.scales, layer.biases, other):
        tensor_qmm.chunk_major(values, 64)
    kernel_patch.forget_traces(model)
    assert id(layer.scales) not in tensor_qmm._CHUNK_MAJOR
    assert id(layer.biases) not in tensor_qmm._CHUNK_MAJOR
    assert id(other) in tensor_qmm._CHUNK_MAJOR
    tensor_qmm.forget_chunk_major([other])
