"""Snapshots and the fail-closed gate.

* **Bitwise replay**: continuing from a loaded snapshot gives the live session's logits bit for
  bit (target decode and staged chunks, and the drafter over its restored context), for cuts
  before the window fills, at it, one past it and mid-rotation, on four sliding-window
  architectures; a wrapped ring packed at origin 0 does not (negative control).
* **The gate** (hypothesis): ``from_state`` accepts a mutated plane state exactly when the
  state is one sequential appends can produce; each refusal names the layer and the field; the
  reference oracle and the planes refuse each other's state.
* **Fuzzing** (hypothesis): truncated files, flipped bytes, dropped or renamed tensors and
  edited header fields are refused with ``SnapshotError``; the live cache never changes; every
  single-field edit of a snapshot's header is refused even with its checksum recomputed.
"""

import functools
import json
import tempfile
from contextlib import nullcontext
from itertools import cycle
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_lm_cache
from test_dflash_loop import random_drafter

import dflash
from dflash.cache import (
    GrowingKVCache,
    GrowingPlane,
    PlaneMeta,
    PromptCache,
    RingKVCache,
    RingPlane,
    SnapshotError,
    SpeculativeCheckpoint,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    snapshot,
)
from dflash.cache.gate import META_FIELDS, STATE_FIELDS
from dflash.cache.plane import ring_indices, take_rows
from dflash.taps import TargetTaps
from dflash.verify.reference import ReferenceKVCache

ARCHS = ("muse_glimmer", "gemma3_text", "gpt_oss", "cohere2")
WINDOW = 16
CUTS = {"before_fill": 9, "at_fill": 16, "one_past": 17, "mid_rotation": 3 * 16 + 13}
# Prefill-like chunks, single decode steps and staged chunks that cross the wrap.
CHUNKS = (5, 1, 1, 7, 3, 1, 9, 2)


@functools.lru_cache(maxsize=None)
def target(arch: str):
    return tiny_model(arch, seed=1, window=WINDOW)


@functools.lru_cache(maxsize=None)
def drafter_for(arch: str):
    return random_drafter(target(arch), seed=4, block_size=4)


def tokens(count: int, seed: int = 0) -> list:
    return np.random.default_rng(seed).integers(0, 250, count).tolist()


def feed(model, cache, ids: list, drafter=None) -> None:
    """Advance ``cache`` (and its drafter context) over ``ids`` in the CHUNKS pattern."""
    layers = drafter.config.target_layer_ids if drafter is not None else ()
    taps = TargetTaps(model, layers) if drafter is not None else nullcontext()
    with taps:
        done = 0
        for size in cycle(CHUNKS):
            chunk = ids[done : done + size]
            if not chunk:
                break
            model(mx.array(chunk)[None], cache=cache)
            if drafter is not None:
                context = cache.drafter_context
                drafter.append_context(context, taps.pop(), context.offset)
            done += len(chunk)
    mx.eval([c.state for c in cache])


def live_session(arch: str, position: int, with_drafter: bool = False) -> PromptCache:
    drafter = drafter_for(arch) if with_drafter else None
    cache = make_prompt_cache(target(arch), drafter=drafter)
    feed(target(arch), cache, tokens(position), drafter)
    return cache


def bits(array: mx.array) -> np.ndarray:
    """The raw bit patterns of ``array``."""
    return np.array(
        array.view(mx.uint8) if array.dtype != mx.bfloat16 else array.view(mx.uint16)
    )


def assert_bitwise(got: mx.array, want: mx.array) -> None:
    np.testing.assert_array_equal(bits(got), bits(want))


def live_rows_bits(plane):
    """Metadata, and the live rows exactly where they sit physically."""
    if plane.len == 0:
        return plane.meta, None
    rows = ring_indices(plane.origin_physical, 0, plane.len, max(plane.capacity, 1))
    return plane.meta, [
        bits(take_rows(a, rows, plane.head_major)) for a in (plane.keys, plane.values)
    ]


def assert_same_planes(got, want) -> None:
    for plane, expected in zip(got, want):
        meta, rows = live_rows_bits(plane)
        want_meta, want_rows = live_rows_bits(expected)
        if isinstance(plane, GrowingPlane):
            # Storage grows in chunks: a restored plane may hold less slack.
            meta = (meta.len, meta.origin_logical, meta.origin_physical)
            want_meta = (
                want_meta.len,
                want_meta.origin_logical,
                want_meta.origin_physical,
            )
        assert meta == want_meta
        if want_rows is not None:
            for g, w in zip(rows, want_rows):
                np.testing.assert_array_equal(g, w)


def saved(cache, tmp_path: Path, name: str = "session.safetensors", **kwargs) -> Path:
    path = tmp_path / name
    save_prompt_cache(path, cache, **kwargs)
    return path


# ---------------------------------------------------------------- bitwise replay


@pytest.mark.parametrize("order", ["decode_then_chunk", "chunk_then_decode"])
@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_loaded_snapshot_continues_with_the_live_logits_bitwise(
    arch, cut, order, tmp_path
):
    model, position = target(arch), CUTS[cut]
    live = live_session(arch, position)
    restored = load_prompt_cache(saved(live, tmp_path), model)
    assert isinstance(restored, PromptCache) and restored is not live
    assert_same_planes(restored, live)
    steps = [[t] for t in tokens(4, seed=7)]
    chunk = [tokens(5, seed=8)]
    plan = steps + chunk + steps[:2] if order == "decode_then_chunk" else chunk + steps
    for ids in plan:
        batch = mx.array(ids)[None]
        assert_bitwise(model(batch, cache=restored), model(batch, cache=live))
    assert_same_planes(restored, live)


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_the_drafter_over_a_restored_context_matches_the_live_one_bitwise(
    arch, cut, tmp_path
):
    model, drafter, position = target(arch), drafter_for(arch), CUTS[cut]
    live = live_session(arch, position, with_drafter=True)
    restored = load_prompt_cache(saved(live, tmp_path), model, drafter=drafter)
    assert restored.drafter_context.offset == live.drafter_context.offset == position
    block = mx.array([[7] + [drafter.config.mask_token_id] * 3])
    assert_bitwise(
        drafter(block, restored.drafter_context), drafter(block, live.drafter_context)
    )
    # Both sessions go on: the restored context grows (and slides) exactly as the live one.
    more = tokens(11, seed=9)
    feed(model, live, more, drafter)
    feed(model, restored, more, drafter)
    assert_bitwise(
        drafter(block, restored.drafter_context), drafter(block, live.drafter_context)
    )
    step = mx.array([[3]])
    assert_bitwise(model(step, cache=restored), model(step, cache=live))


def test_mid_rotation_contexts_really_slide() -> None:
    # The drafter cases above cover a sliding context plane whose live rows do not start at 0.
    live = live_session("muse_glimmer", CUTS["mid_rotation"], with_drafter=True)
    assert any(plane.begin > 0 for plane in live.drafter_context.planes)
    assert all(plane.origin_physical for plane in live if isinstance(plane, RingPlane))


def test_a_wrapped_ring_packed_at_origin_zero_replays_different_logits(tmp_path):
    model = target("muse_glimmer")
    live = live_session("muse_glimmer", CUTS["mid_rotation"])
    path = saved(live, tmp_path)
    restored, packed = load_prompt_cache(path, model), load_prompt_cache(path, model)
    for plane in packed:
        if isinstance(plane, RingPlane) and plane.origin_physical:
            keys, values = plane.logical_rows()
            plane.set_buffers(mx.array(keys), mx.array(values))
            plane.set_meta(
                PlaneMeta(plane.capacity, plane.len, plane.origin_logical, 0)
            )
            with pytest.raises(SnapshotError, match="origin_physical"):
                type(plane).from_state(plane.state)  # the gate refuses a packed ring
    differing = 0
    for token in tokens(12, seed=3):
        step = mx.array([[token]])
        want = model(step, cache=live)
        assert_bitwise(model(step, cache=restored), want)
        differing += not np.array_equal(bits(model(step, cache=packed)), bits(want))
    assert differing >= 6, differing


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 24),
    ring=st.booleans(),
    head_major=st.booleans(),
    chunks=st.lists(st.integers(1, 30), min_size=0, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_install_cut_lays_rows_where_sequential_appends_put_them(
    capacity, ring, head_major, chunks, seed
):
    rng = np.random.default_rng(seed)

    def make():
        if ring:
            return RingPlane(capacity, head_major=head_major)
        return GrowingPlane(head_major=head_major)

    live = make()
    for count in chunks:
        shape = (1, 2, count, 3) if head_major else (1, count, 2, 3)
        rows = mx.array(rng.standard_normal(shape).astype(np.float32))
        live.write(live.offset, rows, rows * 2)
    restored = make()
    if live.len:
        restored.install_cut(live.offset, *live.logical_rows())
    assert restored.offset == live.offset
    assert_same_planes([restored], [live])


# ------------------------------------------------------------ sessions and pairs


def test_a_classic_pair_saves_as_one_list_and_loads_with_both_models(tmp_path):
    model, draft = target("muse_glimmer"), target("gpt_oss")
    pair = make_prompt_cache(model) + make_prompt_cache(draft)
    assert type(pair) is list  # mlx-lm's convention: one flat list, target layers first
    ids = tokens(CUTS["mid_rotation"])
    feed(model, pair[: len(model.layers)], ids)
    feed(draft, pair[len(model.layers) :], ids)
    path = saved(pair, tmp_path)
    restored = load_prompt_cache(path, [model, draft])
    assert type(restored) is list and len(restored) == len(pair)
    assert_same_planes(restored, pair)
    split = len(model.layers)
    for token in tokens(5, seed=2):
        step = mx.array([[token]])
        assert_bitwise(
            model(step, cache=restored[:split]), model(step, cache=pair[:split])
        )
        assert_bitwise(
            draft(step, cache=restored[split:]), draft(step, cache=pair[split:])
        )
    with pytest.raises(SnapshotError, match=r"model=\[target, draft_model\]"):
        load_prompt_cache(path, model)
    with pytest.raises(SnapshotError, match="model 0 layer"):
        load_prompt_cache(path, [draft, model])


def test_a_drafter_context_needs_the_drafter_to_load(tmp_path):
    model, drafter = target("gemma3_text"), drafter_for("gemma3_text")
    live = live_session("gemma3_text", 21, with_drafter=True)
    path = saved(live, tmp_path)
    plain = load_prompt_cache(path, model)  # documented: the target planes only
    assert plain.drafter_context is None
    assert_same_planes(plain, live)
    other = random_drafter(model, seed=4, block_size=4, sliding_window=8)
    with pytest.raises(SnapshotError, match="drafter layer 0: row_limit"):
        load_prompt_cache(path, model, drafter=other)
    bare = saved(live_session("gemma3_text", 21), tmp_path, "bare.safetensors")
    with pytest.raises(SnapshotError, match="carries no drafter context"):
        load_prompt_cache(bare, model, drafter=drafter)


def test_metadata_round_trips_and_a_file_for_another_model_is_refused(tmp_path):
    live = live_session("cohere2", 20)
    path = saved(live, tmp_path, metadata={"model": "tiny-cohere2", "note": "é"})
    _, metadata = load_prompt_cache(path, target("cohere2"), return_metadata=True)
    assert metadata == {"model": "tiny-cohere2", "note": "é"}
    with pytest.raises(SnapshotError, match="layer 0: (kind|window|model_type)"):
        load_prompt_cache(path, tiny_model("cohere2", seed=1, window=8))
    with pytest.raises(SnapshotError, match="layer_count"):
        load_prompt_cache(path, target("muse_glimmer"))


def test_an_empty_session_round_trips(tmp_path):
    model, drafter = target("gpt_oss"), drafter_for("gpt_oss")
    empty = make_prompt_cache(model, drafter=drafter)
    restored = load_prompt_cache(saved(empty, tmp_path), model, drafter=drafter)
    assert [p.offset for p in restored] == [0] * len(empty)
    assert restored.drafter_context.offset == 0
    ids = tokens(20, seed=6)
    feed(model, empty, ids, drafter)
    feed(model, restored, ids, drafter)
    assert_same_planes(restored, empty)
    path = tmp_path / "session.safetensors"
    with pytest.raises(SnapshotError, match="model 0: type"):
        load_prompt_cache(path, "mlx-community/some-model")
    valid = path.read_bytes()
    for edit in (
        lambda header: header["layers"][0].update(batch=1),
        lambda header: header["drafter"].update(batch=1),
    ):
        path.write_bytes(rewritten(mutate_header=edit, data=valid))
        with pytest.raises(SnapshotError, match="batch: must be null"):
            load_prompt_cache(path, model, drafter=drafter)


def test_dflash_exports_the_snapshot_functions():
    assert dflash.save_prompt_cache is save_prompt_cache
    assert dflash.load_prompt_cache is load_prompt_cache


# ---------------------------------------------------------------- mlx-lm's files


def test_mlx_lm_save_keeps_every_field_and_loads_here(tmp_path):
    model = target("gpt_oss")
    live = live_session("gpt_oss", CUTS["mid_rotation"])
    path = tmp_path / "mlx_lm.safetensors"
    mlx_lm_cache.save_prompt_cache(str(path), live, {"model": "m"})
    # mlx-lm's loader looks our class names up in its own module: it cannot build them.
    with pytest.raises(KeyError, match="RingKVCache"):
        mlx_lm_cache.load_prompt_cache(str(path))
    restored, metadata = load_prompt_cache(path, model, return_metadata=True)
    assert metadata == {"model": "m"}
    assert [p.meta for p in restored] == [p.meta for p in live]
    for token in tokens(6, seed=5):
        step = mx.array([[token]])
        assert_bitwise(model(step, cache=restored), model(step, cache=live))


def test_mlx_lm_load_on_a_snapshot_names_our_loader(tmp_path):
    path = saved(live_session("muse_glimmer", 30), tmp_path)
    with pytest.raises(KeyError, match="dflash.cache.load_prompt_cache"):
        mlx_lm_cache.load_prompt_cache(str(path))


# ------------------------------------------------------------------------ gate


def ring_state(**changes):
    """A 16-row ring after 40 rows (wrapped, rotation 8), its state with ``changes``."""
    plane = RingKVCache(16, layer=2)
    rows = mx.ones((1, 2, 40, 4))
    plane.update_and_fetch(rows, rows)
    state = list(plane.state)
    for name, value in changes.items():
        state[STATE_FIELDS.index(name)] = value
    return tuple(state)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(len=99), "len"),
        (dict(origin_physical=40), "origin_physical"),
        (dict(keys=mx.ones((1, 2, 7, 4)), values=mx.ones((1, 2, 7, 4))), "keys"),
        (dict(capacity=20), "capacity"),
        (dict(window=None), "window"),
        (dict(encoding="f32-full-history"), "encoding"),
        (dict(head_major=False), "head_major"),
        (dict(values=mx.ones((1, 2, 16, 4), mx.float16)), "values"),
    ],
)
def test_from_state_refuses_what_appends_cannot_produce(changes, field):
    with pytest.raises(SnapshotError) as error:
        RingKVCache.from_state(ring_state(**changes))
    assert error.value.field == field and error.value.where == "layer 2"


def test_the_oracle_and_the_planes_refuse_each_others_state():
    oracle = ReferenceKVCache(16)
    rows = mx.ones((1, 2, 40, 4))
    oracle.update_and_fetch(rows, rows)
    assert ReferenceKVCache.from_state(oracle.state).offset == 40
    with pytest.raises(SnapshotError, match="encoding: 'f32-full-history'"):
        RingKVCache.from_state(oracle.state)
    with pytest.raises(SnapshotError, match="encoding: 'dflash-plane-v1'"):
        ReferenceKVCache.from_state(ring_state())
    with pytest.raises(SnapshotError, match="state: has 2 fields"):
        RingKVCache.from_state(oracle.state[:2])  # mlx-lm's old (keys, values) form


def test_setters_refuse_before_any_change_and_under_a_checkpoint():
    plane = RingKVCache.from_state(ring_state())
    before = (plane.meta, bits(plane.keys))
    with pytest.raises(SnapshotError, match="origin_physical"):
        plane.state = ring_state(origin_physical=3)
    bad_meta = list(plane.meta_state)
    bad_meta[META_FIELDS.index("len")] = "5"
    with pytest.raises(SnapshotError, match="layer 2: len"):
        plane.meta_state = bad_meta
    with pytest.raises(SnapshotError, match="not a canonical integer"):
        plane.meta_state = [" 16" if t == "16" else t for t in plane.meta_state]
    assert plane.meta == before[0]
    np.testing.assert_array_equal(bits(plane.keys), before[1])
    plane.meta_state = plane.meta_state  # a consistent one is accepted
    with SpeculativeCheckpoint.begin([plane], 2):
        with pytest.raises(SnapshotError, match="checkpoint is open"):
            plane.state = ring_state()
    again = RingKVCache.from_state(plane.state, plane.meta_state)
    assert again.meta == plane.meta
    with pytest.raises(SnapshotError, match="meta_state vs state"):
        RingKVCache.from_state(plane.state, bad_meta)


def consistent(kind: str, meta: dict, keys) -> bool:
    """DESIGN §3 (Snapshots), written out: could sequential appends leave a plane so?"""

    def natural(value, low=0):
        return type(value) is int and value >= low

    counts = ("capacity", "len", "origin_logical", "origin_physical")
    if not all(natural(meta[name]) for name in counts):
        return False
    limit, layer = meta["max_context"], meta["layer"]
    if not (limit is None or natural(limit, 1)) or not (
        layer is None or natural(layer)
    ):
        return False
    if meta["head_major"] is not True:
        return False
    capacity, rows = meta["capacity"], meta["len"]
    position = meta["origin_logical"] + rows
    if limit is not None and position > limit:
        return False
    if kind == "ring":
        window = meta["window"]
        if not natural(window, 1):
            return False
        want = window if limit is None else min(window, limit)
        ok = (
            capacity == want
            and rows == min(position, capacity)
            and meta["origin_physical"] == meta["origin_logical"] % capacity
        )
    else:
        ok = (
            meta["window"] is None
            and meta["origin_logical"] == meta["origin_physical"] == 0
            and rows <= capacity
            and (limit is None or capacity <= limit)
        )
    if keys is None:
        return ok and rows == 0 and (kind == "ring" or capacity == 0)
    return ok and keys.shape[2] == capacity


FIELD_VALUES = st.one_of(
    st.integers(-2, 300), st.none(), st.booleans(), st.sampled_from(["16", "x", 1.0])
)


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(["ring", "growing"]),
    window=st.integers(1, 20),
    limit=st.one_of(st.none(), st.integers(1, 600)),
    written=st.integers(0, 70),
    field=st.sampled_from(META_FIELDS),
    value=FIELD_VALUES,
)
def test_the_gate_accepts_a_mutated_state_iff_appends_could_produce_it(
    kind, window, limit, written, field, value
):
    if limit is not None:
        written = min(written, limit)
    cls = RingKVCache if kind == "ring" else GrowingKVCache
    plane = (
        RingKVCache(window, limit, layer=1)
        if kind == "ring"
        else GrowingKVCache(limit, layer=1)
    )
    if written:
        rows = mx.ones((1, 2, written, 4))
        plane.update_and_fetch(rows, rows)
    assert consistent(kind, dict(zip(META_FIELDS, plane.state[3:])), plane.state[0])
    state = list(plane.state)
    state[STATE_FIELDS.index(field)] = value
    meta = dict(zip(META_FIELDS, state[3:]))
    if consistent(kind, meta, state[0]):
        assert cls.from_state(tuple(state)).meta == PlaneMeta(
            meta["capacity"],
            meta["len"],
            meta["origin_logical"],
            meta["origin_physical"],
        )
    else:
        with pytest.raises(SnapshotError) as error:
            cls.from_state(tuple(state))
        assert error.value.field in STATE_FIELDS and error.value.where.startswith(
            "layer"
        )


# --------------------------------------------------------------------- saving


def test_save_refuses_what_it_cannot_restore(tmp_path):
    live = live_session("muse_glimmer", 20)
    with SpeculativeCheckpoint.begin(live, 2):
        with pytest.raises(SnapshotError, match="layer 0: checkpoint"):
            save_prompt_cache(tmp_path / "a", live)
    with pytest.raises(SnapshotError, match="cache 0: type"):
        save_prompt_cache(tmp_path / "b", [mlx_lm_cache.KVCache()])
    with pytest.raises(SnapshotError, match="cache 0: type"):
        save_prompt_cache(tmp_path / "c", [ReferenceKVCache(16)])
    with pytest.raises(SnapshotError, match="metadata"):
        save_prompt_cache(tmp_path / "d", live, metadata={"n": 3})
    live.drafter_context = drafter_for("muse_glimmer").make_context()
    with pytest.raises(SnapshotError, match="drafter: offset: is 0, expected 20"):
        save_prompt_cache(tmp_path / "d", live)  # a session is at one position
    live.drafter_context = None
    live[3].trim(1)  # one growing plane behind the others
    with pytest.raises(SnapshotError, match="layer 3: position"):
        save_prompt_cache(tmp_path / "e", live)
    with pytest.raises(SnapshotError, match="file"):
        save_prompt_cache(tmp_path / "missing" / "f", live_session("muse_glimmer", 3))
    assert not any(tmp_path.iterdir())  # nothing written, no temporary left behind


# -------------------------------------------------------------------- fuzzing


@functools.lru_cache(maxsize=None)
def fuzz_case():
    """A small session (wrapped rings, a drafter context) and its snapshot's bytes."""
    live = live_session("muse_glimmer", 21, with_drafter=True)
    folder = Path(tempfile.mkdtemp())
    path = saved(live, folder)
    return live, path.read_bytes(), folder


def load_variant(data: bytes):
    live, _, folder = fuzz_case()
    before = [live_rows_bits(p) for p in live]
    path = folder / "variant.safetensors"
    path.write_bytes(data)
    try:
        with pytest.raises(SnapshotError):
            load_prompt_cache(
                path, target("muse_glimmer"), drafter=drafter_for("muse_glimmer")
            )
    finally:
        for plane, (meta, rows) in zip(live, before):
            got_meta, got_rows = live_rows_bits(plane)
            assert got_meta == meta
            for g, w in zip(got_rows or [], rows or []):
                np.testing.assert_array_equal(g, w)


def stored_snapshot(data=None):
    """A snapshot (default: the fuzz one) as parsed (metadata, tensors)."""
    folder = fuzz_case()[2]
    source = folder / "source.safetensors"
    source.write_bytes(fuzz_case()[1] if data is None else data)
    return snapshot._read(source)


def rewritten(
    mutate_header=None, mutate_tensors=None, checksum=True, data=None
) -> bytes:
    """A snapshot (default: the fuzz one) with its header / tensors edited, the checksum
    recomputed or not."""
    folder = fuzz_case()[2]
    stored = stored_snapshot(data)
    user = {k[2:]: v for k, v in stored.metadata.items() if k.startswith("0.")}
    header = json.loads(stored.metadata["1.1"])
    tensors = dict(stored.tensors)
    if mutate_header:
        mutate_header(header)
    if mutate_tensors:
        mutate_tensors(tensors)
    if checksum:
        body = {k: v for k, v in header.items() if k != "checksum"}
        header["checksum"] = snapshot._digest(body, user, tensors)
    metadata = dict(stored.metadata, **{"1.1": snapshot._canonical(header)})
    out = folder / "rewritten.safetensors"
    snapshot._write(out, metadata, tensors)
    return out.read_bytes()


def test_the_fuzz_snapshot_itself_loads():
    _, data, folder = fuzz_case()
    path = folder / "valid.safetensors"
    path.write_bytes(rewritten())  # a rewrite with nothing changed is still valid
    assert path.read_bytes() == data
    load_prompt_cache(path, target("muse_glimmer"), drafter=drafter_for("muse_glimmer"))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_a_truncated_snapshot_is_refused(data):
    full = fuzz_case()[1]
    load_variant(full[: data.draw(st.integers(0, len(full) - 1))])


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_a_flipped_byte_anywhere_is_refused(data):
    full = bytearray(fuzz_case()[1])
    offset = data.draw(st.integers(0, len(full) - 1))
    full[offset] ^= data.draw(st.integers(1, 255))
    load_variant(bytes(full))


@settings(max_examples=40, deadline=None)
@given(st.data(), st.booleans(), st.booleans())
def test_a_dropped_or_renamed_tensor_is_refused(data, rename, checksum):
    names = sorted(stored_snapshot().tensors)
    name = data.draw(st.sampled_from(names))

    def edit(tensors):
        tensor = tensors.pop(name)
        if rename:
            tensors[
                data.draw(
                    st.sampled_from(["layers.99.keys", name + "x", "drafter.0.key"])
                )
            ] = tensor

    load_variant(rewritten(mutate_tensors=edit, checksum=checksum))


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 100),
    st.text(max_size=4),
    st.just([]),
    st.just({}),
)


@settings(max_examples=120, deadline=None)
@given(st.data(), JSON_VALUES)
def test_an_edited_header_field_is_refused_by_the_checksum(data, value):
    def edit(header):
        record = header
        if data.draw(st.booleans()):
            record = header["layers"][
                data.draw(st.integers(0, len(header["layers"]) - 1))
            ]
        key = data.draw(st.sampled_from(sorted(record)))
        # A change, whatever the drawn value (``[x]`` never equals ``x``).
        record[key] = value if record[key] != value else [value]

    load_variant(rewritten(mutate_header=edit, checksum=False))


def mutations(value):
    """Values that differ from ``value`` (type and content)."""
    if isinstance(value, bool):
        return [not value, None, 0]
    if isinstance(value, int):
        numbers = sorted({value + 1, value - 1, -1, 0} - {value})
        # float(value) and a bool compare equal to some ints: the gate compares types too.
        return numbers + [None, str(value), value + 0.5, float(value), value == 1]
    if isinstance(value, str):
        return [value + "x", "", None, 1]
    if value is None:
        return [0, 1, "x", [], False]
    if isinstance(value, list):
        return [value[:-1], None, 0]
    return [None, 0]


def header_mutations():
    """Every single-field edit of the fuzz snapshot's header: (path, value)."""
    header = json.loads(stored_snapshot().metadata["1.1"])
    edits = []
    for key, value in header.items():
        if key not in ("layers", "checksum"):
            edits += [((key,), v) for v in mutations(value)]
    for index in (0, 3):  # a ring and a growing plane
        for key, value in header["layers"][index].items():
            edits += [(("layers", index, key), v) for v in mutations(value)]
    drafter = header["drafter"]
    for key, value in drafter.items():
        if key != "layers":
            edits += [(("drafter", key), v) for v in mutations(value)]
    for index in range(len(drafter["layers"])):
        for key, value in drafter["layers"][index].items():
            edits += [(("drafter", "layers", index, key), v) for v in mutations(value)]
    edits += [(("layers",), header["layers"][:-1]), (("drafter", "layers"), [])]
    return edits


def test_the_gate_refuses_every_single_field_edit_even_with_a_fresh_checksum():
    edits = header_mutations()
    assert len(edits) > 150
    for path, value in edits:

        def edit(header, path=path, value=value):
            record = header
            for key in path[:-1]:
                record = record[key]
            record[path[-1]] = value

        try:
            load_variant(rewritten(mutate_header=edit))
        except BaseException as error:
            raise AssertionError(f"edit {path} = {value!r} was not refused") from error
