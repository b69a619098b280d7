"""Drop-in arguments: mlx-lm 0.32.2's names, order and defaults; its CLI's and server's calls run."""

import ast
import inspect

import mlx.core as mx
import mlx_lm.server as mlx_server
import pytest
from conftest import mlx_lm_generate_module, tiny_model, tiny_tokenizer
from test_dflash_loop import random_drafter

import dflash
from dflash import generation

MLX = mlx_lm_generate_module()
PROMPT = mx.array([5 + (7 * i) % 200 for i in range(19)])


@pytest.fixture(scope="module")
def models():
    target = tiny_model("muse_glimmer", seed=0)
    draft = tiny_model("muse_glimmer", seed=1, num_hidden_layers=3)
    return target, draft, random_drafter(target, seed=2, block_size=4), tiny_tokenizer()


def assert_same_parameters(ours, theirs):
    """Every mlx-lm parameter exists in ours with its position (if positional) and default."""
    mine = inspect.signature(ours).parameters
    names = list(mine)
    for index, (name, param) in enumerate(inspect.signature(theirs).parameters.items()):
        if param.kind is param.VAR_KEYWORD:
            assert any(p.kind is p.VAR_KEYWORD for p in mine.values()), name
            continue
        assert name in mine, f"{ours.__name__} lacks {name}"
        if param.kind is param.POSITIONAL_OR_KEYWORD:
            assert (
                names[index] == name
            ), f"{ours.__name__}: {name} is not argument {index}"
        assert mine[name].kind == param.kind, name
        assert (
            mine[name].default is param.default or mine[name].default == param.default
        ), name


@pytest.mark.parametrize(
    "name",
    ["generate_step", "speculative_generate_step", "stream_generate", "generate"],
)
def test_signatures_keep_mlx_lms_names_order_and_defaults(name):
    assert_same_parameters(getattr(dflash, name), getattr(MLX, name))
    assert getattr(dflash, name) is getattr(generation, name)


def test_dflash_generator_takes_the_speculative_order_with_the_drafter_for_the_draft():
    ours = list(inspect.signature(dflash.dflash_generate_step).parameters)
    theirs = list(inspect.signature(MLX.speculative_generate_step).parameters)
    assert ours[:4] == ["prompt", "model", "drafter", "stream"] and theirs[:4] == [
        "prompt",
        "model",
        "draft_model",
        "stream",
    ]
    assert set(theirs) - {"draft_model", "num_draft_tokens"} <= set(ours)


def keywords_of_call(module, callee):
    """Keyword names of every call to ``callee`` in ``module``'s source."""
    tree = ast.parse(inspect.getsource(module))
    return [
        {k.arg for k in node.keywords}
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == callee
    ]


def value_for(name, models, mode):
    target, draft, drafter, tokenizer = models
    progress = []
    values = {
        "model": target,
        "tokenizer": tokenizer,
        "prompt": PROMPT.tolist(),
        "stream": MLX.generation_stream,
        "max_tokens": 9,
        "verbose": False,
        "sampler": dflash.make_sampler(0.0),
        "logits_processors": [],
        "max_kv_size": None,
        "prefill_step_size": 8,
        "prompt_cache": None,
        "kv_bits": None,
        "kv_group_size": 64,
        "quantized_kv_start": 5000,
        "draft_model": draft if mode == "classic" else None,
        "num_draft_tokens": 3,
        "input_embeddings": None,
        "prompt_progress_callback": lambda done, total: progress.append((done, total)),
    }
    return values[name]


MODES = ["plain", "classic", "dflash"]


@pytest.mark.parametrize("mode", MODES)
def test_mlx_lm_cli_keyword_set_is_accepted(models, mode):
    """``mlx_lm.generate.main`` calls ``generate(model, tokenizer, prompt, **kw)``: ours runs it."""
    (keywords,) = keywords_of_call(MLX, "generate")
    assert keywords >= {
        "max_kv_size",
        "kv_bits",
        "kv_group_size",
        "quantized_kv_start",
        "input_embeddings",
        "num_draft_tokens",
        "draft_model",
    }
    kwargs = {name: value_for(name, models, mode) for name in keywords}
    if mode == "dflash":
        kwargs["drafter"] = models[2]
    target, _, _, tokenizer = models
    text = generation.generate(target, tokenizer, PROMPT.tolist(), **kwargs)
    want = generation.generate(target, tokenizer, PROMPT.tolist(), max_tokens=9)
    assert text == want


@pytest.mark.parametrize("mode", MODES)
def test_mlx_lm_server_keyword_set_is_accepted(models, mode):
    """``mlx_lm.server`` calls ``stream_generate(**kw)`` with a prompt cache: ours runs it."""
    (keywords,) = keywords_of_call(mlx_server, "stream_generate")
    assert "prompt_progress_callback" in keywords and "stream" in keywords
    target, draft, drafter, _ = models
    kwargs = {name: value_for(name, models, mode) for name in keywords}
    cache = dflash.make_prompt_cache(
        target, drafter=drafter if mode == "dflash" else None
    )
    if mode == "classic":
        cache = cache + dflash.make_prompt_cache(draft)
    kwargs["prompt_cache"] = cache
    if mode == "dflash":
        kwargs["drafter"] = drafter
    tokens = [r.token for r in dflash.stream_generate(**kwargs)]
    want = [
        r.token for r in dflash.stream_generate(target, models[3], PROMPT, max_tokens=9)
    ]
    assert tokens == want


def generator(mode, models, **kwargs):
    target, draft, drafter, _ = models
    if mode == "plain":
        return dflash.generate_step(PROMPT, target, **kwargs)
    if mode == "classic":
        return dflash.speculative_generate_step(PROMPT, target, draft, **kwargs)
    return dflash.dflash_generate_step(PROMPT, target, drafter, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_prompt_progress_is_reported_as_mlx_lm_reports_it(models, mode):
    want, got = [], []
    steps = MLX.generate_step(
        PROMPT,
        models[0],
        max_tokens=3,
        prefill_step_size=8,
        prompt_progress_callback=lambda *a: want.append(a),
    )
    list(steps)
    list(
        generator(
            mode,
            models,
            max_tokens=3,
            prefill_step_size=8,
            prompt_progress_callback=lambda *a: got.append(a),
        )
    )
    assert want == [(0, 19), (8, 19), (16, 19), (18, 19), (19, 19)]
    assert got == want


@pytest.mark.parametrize("mode", MODES)
def test_the_stream_argument_is_used(models, mode, monkeypatch):
    entered, original = [], mx.stream

    def recording(stream):
        entered.append(stream)
        return original(stream)

    monkeypatch.setattr(mx, "stream", recording)
    stream = mx.new_stream(mx.default_device())
    target, draft, drafter, _ = models
    other = {"plain": (), "classic": (draft,), "dflash": (drafter,)}[mode]
    gen = {
        "plain": dflash.generate_step,
        "classic": dflash.speculative_generate_step,
        "dflash": dflash.dflash_generate_step,
    }[mode]
    list(gen(PROMPT, target, *other, stream, max_tokens=2))  # positional, as in mlx-lm
    assert stream in entered


def test_plain_generation_fills_stats(models):
    target, _, _, tokenizer = models
    stats = dflash.GenerationStats(4)
    responses = list(
        dflash.stream_generate(target, tokenizer, PROMPT, max_tokens=7, stats=stats)
    )
    assert len(responses) == 7
    assert (stats.block_size, stats.rounds, stats.accepted, stats.tau) == (
        1,
        7,
        [0] * 7,
        1.0,
    )
    assert stats.histogram == [7] and stats.position_acceptance == []


@pytest.mark.parametrize("mode", MODES)
def test_quantized_kv_cache_is_refused_by_name(models, mode):
    with pytest.raises(ValueError, match="kv_bits=4 is not supported"):
        next(generator(mode, models, kv_bits=4))


@pytest.mark.parametrize("mode", MODES)
def test_max_kv_size_below_a_window_is_refused_and_above_is_a_no_op(models, mode):
    with pytest.raises(
        ValueError, match="max_kv_size=8 is smaller than the model's sliding window 16"
    ):
        next(generator(mode, models, max_kv_size=8))
    want = [step[0] for step in generator(mode, models, max_tokens=6)]
    for size in (16, 4096):
        assert [
            step[0] for step in generator(mode, models, max_tokens=6, max_kv_size=size)
        ] == want


def test_max_kv_size_that_would_evict_context_is_refused():
    qwen = tiny_model("qwen3", seed=0)
    with pytest.raises(
        ValueError, match="max_kv_size=4096 is not supported for this model"
    ):
        next(dflash.generate_step(PROMPT, qwen, max_kv_size=4096))


@pytest.mark.parametrize("mode", ["classic", "dflash"])
def test_input_embeddings_are_refused_with_speculative_decoding(models, mode):
    target, draft, drafter, tokenizer = models
    extra = {"draft_model": draft} if mode == "classic" else {"drafter": drafter}
    with pytest.raises(ValueError, match="does not support input embeddings"):
        next(
            dflash.stream_generate(
                target, tokenizer, PROMPT, input_embeddings=mx.zeros((19, 64)), **extra
            )
        )
