"""dflash-bench: modes side by side, τ and losslessness, the scale mode, the peer; failures."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import (
    greedy_reference,
    save_target,
    tiny_model,
    tiny_tokenizer,
    top2_margin,
)
from hypothesis import given
from hypothesis import strategies as st
from test_dflash_loop import OracleDrafter, random_drafter

from dflash import bench, demo
from dflash.bench import plots, runs, scale, scale_target
from dflash.bench.replay import ReplayDrafter
from dflash.loader import save_drafter

BLOCK = 6
PROMPTS = [
    "w5 w6 w7 w8 w9 w22 w23 w24",  # (w1x would split on the special token w1)
    "w30 w31 w32 w33 w34 w35 w36 w37 w38 w39 w40 w41 w42 w43 w44 w45 w46 w47 w48 w49",
]
FAST = dict(passes=1, split_reps=0)
REPO = Path(__file__).resolve().parents[1]
# The public dflash 0.1.0 (e.g. pip install --no-deps --target DIR dflash==0.1.0).
PEER_SRC = Path(os.environ.get("DFLASH_PEER_SRC", "/work/peer/src"))


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("muse_glimmer", seed=0, window=16)
    return target, tiny_tokenizer(), random_drafter(target, block_size=BLOCK)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pair):
    """A demo-layout folder (target/, drafter/, draft/) plus a prompts file."""
    root = tmp_path_factory.mktemp("bench")
    target, _, drafter = pair
    save_target(target, root / "target")
    save_target(tiny_model("muse_glimmer", seed=5, window=16), root / "draft")
    save_drafter(drafter, str(root / "drafter"))
    write_prompts(
        root / "prompts.jsonl", [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)]
    )
    return root


def write_prompts(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def encode(text):
    return mx.array(tiny_tokenizer().encode(text), mx.uint32)


def test_run_bench_equals_the_reference(pair):
    target, tokenizer, drafter = pair
    report = bench.run_bench(target, tokenizer, drafter, PROMPTS, max_tokens=24, **FAST)
    assert report["divergence_count"] == 0 and report["divergences"] == []
    assert report["prompts"] == 2 and report["block_size"] == BLOCK
    assert report["generated_tokens"] == report["reference_tokens"] == 48
    assert report["tau"] >= 1.0
    assert sum(report["histogram"]) == report["rounds"]
    assert len(report["histogram"]) == BLOCK
    assert len(report["position_acceptance"]) == BLOCK - 1
    assert report["mean_prompt_tokens"] == (8 + 20) / 2
    assert report["mode_order"] == ["plain", "dflash"]
    plain, dflash = report["modes"]["plain"], report["modes"]["dflash"]
    assert plain["divergence_count"] == 0 and "speedup" not in plain
    assert dflash["tokens_per_s"]["median"] > 0
    assert dflash["speedup"]["ratio_of_medians"] == pytest.approx(
        dflash["tokens_per_s"]["median"] / plain["tokens_per_s"]["median"]
    )
    assert report["prompt_token_ids"][1] == encode(PROMPTS[1]).tolist()
    json.dumps(report)  # serialisable as is


def test_a_drafter_that_is_always_right_gives_full_acceptance(pair):
    target, tokenizer, _ = pair
    prompt = encode(PROMPTS[1])
    sequence = prompt.tolist() + greedy_reference(target, prompt, 30)
    oracle = OracleDrafter(sequence, BLOCK, (1, 4, 7))
    report = bench.run_bench(
        target, tokenizer, oracle, PROMPTS[1:], max_tokens=24, passes=1, split_reps=0
    )
    assert report["divergence_count"] == 0
    assert report["rounds"] == 24 // BLOCK and report["tau"] == BLOCK
    assert report["histogram"][-1] == report["rounds"]
    assert report["position_acceptance"] == [1.0] * (BLOCK - 1)


def corrupt_long_prompt(monkeypatch, edit):
    """Make DFlash yield ``edit(tokens)`` on the second (longer) prompt only."""
    real = runs.dflash_generate_step

    def wrapped(prompt, *args, **kwargs):
        steps = list(real(prompt, *args, **kwargs))
        return iter(edit(steps) if prompt.size == 20 else steps)

    monkeypatch.setattr(runs, "dflash_generate_step", wrapped)


def test_a_flipped_token_is_one_divergence_at_its_position(pair, monkeypatch):
    target, tokenizer, drafter = pair
    reference = greedy_reference(target, encode(PROMPTS[1]), 24)
    assert 0 not in reference[:8]  # the tiny tokenizer's EOS would end the run early

    def flip(steps):
        steps[7] = ((steps[7][0] + 1) % 256,) + steps[7][1:]
        steps[9] = ((steps[9][0] + 1) % 256,) + steps[9][1:]  # only the first counts
        return steps

    corrupt_long_prompt(monkeypatch, flip)
    report = bench.run_bench(target, tokenizer, drafter, PROMPTS, max_tokens=24, **FAST)
    assert report["divergence_count"] == 1
    assert report["modes"]["plain"]["divergence_count"] == 0
    record = report["divergences"][0]
    assert record["prompt_index"] == 1 and record["position"] == 7
    assert record["expected"] == reference[7]
    assert record["got"] == (reference[7] + 1) % 256
    want = top2_margin(target, encode(PROMPTS[1]).tolist() + reference[:7])
    assert record["margin"] == pytest.approx(want, rel=1e-3, abs=1e-5)


def test_a_short_output_is_a_divergence(pair, monkeypatch):
    target, tokenizer, drafter = pair
    corrupt_long_prompt(monkeypatch, lambda steps: steps[:5])
    report = bench.run_bench(target, tokenizer, drafter, PROMPTS, max_tokens=24, **FAST)
    assert report["divergence_count"] == 1
    record = report["divergences"][0]
    assert (record["prompt_index"], record["position"], record["got"]) == (1, 5, None)
    assert isinstance(record["expected"], int) and record["margin"] > 0


@given(
    st.lists(st.integers(0, 3), max_size=12),
    st.lists(st.integers(0, 3), max_size=12),
)
def test_first_divergence_is_the_first_mismatch_or_length_end(reference, output):
    margins = [float(i) for i in range(len(reference))]
    found = bench.first_divergence(3, reference, margins, output)
    if reference == output:
        assert found is None
        return
    position = found["position"]
    assert reference[:position] == output[:position] and found["prompt_index"] == 3
    if position < min(len(reference), len(output)):
        assert reference[position] != output[position]
        assert found["margin"] == margins[position]
    else:
        assert position == min(len(reference), len(output))
        assert None in (found["expected"], found["got"])


@given(st.lists(st.booleans(), max_size=40))
def test_rounds_from_draft_flags_add_up(drafted):
    accepted = runs.accepted_per_round(drafted)
    assert sum(accepted) == sum(drafted)
    trailing = bool(drafted) and drafted[-1]
    assert len(accepted) == drafted.count(False) + trailing


@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(0, 20),
    st.lists(st.integers(0, 9), min_size=30, max_size=30),
)
def test_replay_tokens_accept_exactly_tau_minus_one(tau, block, position, sequence):
    count = block - 1
    drafts = scale_target.replay_tokens(sequence, position, count, tau, 10)
    assert len(drafts) == count
    for i, token in enumerate(drafts, start=1):
        assert (token == sequence[position + i]) == (i < tau)
        assert 0 <= token < 10


@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(0, 1))
def test_replay_logits_pick_the_replayed_tokens_whatever_the_drafter_says(
    seed, rows, first
):
    key = mx.random.key(seed)
    # Soft-capped logits: |x| <= 30, well under the boost.
    real = mx.clip(mx.random.normal((1, rows + first, 50), key=key) * 20, -30, 30)
    tokens = mx.random.randint(0, 50, (rows,), key=mx.random.split(key)[0]).tolist()
    out = scale_target.replay_logits(real.astype(mx.bfloat16), tokens, first)
    assert out.dtype == mx.bfloat16 and out.shape == real.shape
    assert mx.argmax(out[0, first:], axis=-1).tolist() == tokens
    if first:
        assert mx.array_equal(out[0, 0], real[0, 0].astype(mx.bfloat16))


@given(st.integers(-3, 12))
def test_block_size_rule_is_one_to_the_drafters(block):
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=8))
    if 1 <= block <= 8:
        assert bench.check_block_size(block, drafter) == block
    else:
        with pytest.raises(ValueError, match=r"outside 1\.\.8 \(this drafter"):
            bench.check_block_size(block, drafter)


def test_the_replay_drafter_keeps_the_real_forward_and_refuses_bad_profiles(pair):
    target, _, drafter = pair
    with pytest.raises(ValueError, match="replay tau must be in 1..6"):
        ReplayDrafter(drafter, 7)
    replay = ReplayDrafter(drafter, 3)
    with pytest.raises(RuntimeError, match="sequence is not set"):
        replay(mx.zeros((1, BLOCK), mx.uint32), drafter.make_context())
    assert replay.config is drafter.config and replay.make_context is not None


def test_classic_modes_report_mlx_lm_and_our_draft_loops(pair):
    target, tokenizer, drafter = pair
    draft = tiny_model("muse_glimmer", seed=5, window=16)
    report = bench.run_bench(
        target,
        tokenizer,
        drafter,
        PROMPTS[1:],
        max_tokens=24,
        modes=("plain", "classic", "mlx-spec"),
        draft_model=draft,
        num_draft_tokens=3,
        **FAST,
    )
    classic, spec = report["modes"]["classic"], report["modes"]["mlx-spec"]
    assert classic["divergence_count"] == 0 and classic["error"] is None
    assert len(classic["histogram"]) == 4 and classic["tau"] >= 1
    # mlx-lm's trim is not exact on a wrapped ring: whatever it does is reported
    # against the same reference, with the reference's token and margin there.
    reference = greedy_reference(target, encode(PROMPTS[1]), 24)
    assert spec["error"] is None and spec["generated_tokens"] > 0
    for record in spec["divergences"]:
        assert record["expected"] == reference[record["position"]] != record["got"]
        assert record["margin"] is not None
    assert "tau" not in report  # no dflash mode ran


def test_run_bench_refuses_a_file_name_and_bad_settings(pair):
    target, tokenizer, drafter = pair
    with pytest.raises(TypeError, match="not str 'prompts.jsonl'.*read_prompts"):
        bench.run_bench(target, tokenizer, drafter, "prompts.jsonl", max_tokens=4)
    cases = [
        (dict(block_size=0), PROMPTS, "block size 0 is outside"),
        (dict(block_size=BLOCK + 1), PROMPTS, "is outside 1.."),
        (dict(max_tokens=0), PROMPTS, "max_tokens must be > 0"),
        ({}, [], "prompt set is empty"),
        ({}, ["w5", ""], "prompt 1 encodes to no tokens"),
        (dict(modes=("plain", "classic")), PROMPTS, "mode classic needs a draft model"),
        (dict(modes=("fast",)), PROMPTS, "modes must be distinct names"),
        (
            dict(replay_taus=(9,)),
            PROMPTS,
            "replay taus must be distinct values in 1..6",
        ),
    ]
    for kwargs, prompts, message in cases:
        kwargs = {"max_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=message):
            bench.run_bench(target, tokenizer, drafter, prompts, **kwargs)


def test_read_prompts_ignores_other_fields_blank_lines_and_limits(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "a", "x": 1}\n\n{"id": 2, "prompt": "b"}\n{"prompt": "c"}\n'
    )
    assert bench.read_prompts(path) == ["a", "b", "c"]
    assert bench.read_prompts(path, limit=2) == ["a", "b"]


def test_default_prompts_path_prefers_the_packaged_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path)
    repo_copy = bench.default_prompts_path()
    assert repo_copy.parts[-3:] == ("configs", "bench", "heldout.jsonl")
    (tmp_path / "bench-prompts.jsonl").write_text('{"prompt": "w5"}\n')
    assert bench.default_prompts_path() == tmp_path / "bench-prompts.jsonl"


def test_the_bench_bookkeeping_costs_microseconds_per_token():
    from dflash.bench.measure import bookkeeping_us_per_token

    # A GPU decode step is milliseconds; < 20 us a token is < 2 % of a 1 ms step.
    assert bookkeeping_us_per_token(tokens=5000) < 20


def test_cli_writes_the_json_report(saved, tmp_path, capsys):
    out = tmp_path / "report.json"
    bench.main(
        [
            "--model", str(saved / "target"),
            "--drafter", str(saved / "drafter"),
            "--prompts", str(saved / "prompts.jsonl"),
            "--max-tokens", "10",
            "--block-size", "4",
            "--passes", "2",
            "--split-reps", "1",
            "--json", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    stdout, stderr = capsys.readouterr()
    assert "divergences from the target's greedy output (dflash): 0" in stdout
    assert "NOTE: the backend is the CPU" in stdout and "round split" in stdout
    assert stderr == ""  # --quiet: no progress bar
    report = json.loads(out.read_text())
    assert report["block_size"] == 4 and len(report["position_acceptance"]) == 3
    assert report["prompts"] == 2 and report["max_tokens"] == 10
    assert report["divergence_count"] == 0 and report["generated_tokens"] == 20
    assert report["model"] == str(saved / "target") and report["kind"] == "pair"
    env = report["environment"]
    assert "--json" in env["command"] and env["backend"] == "cpu"
    for key in ("mlx", "mlx_lm", "date", "machine", "device"):
        assert env[key], key
    assert report["geometry"]["layer_types"] == {
        "full_attention": 2,
        "sliding_attention": 6,
    }
    assert len(report["modes"]["dflash"]["tokens_per_s"]["per_pass"]) == 2
    assert report["split"]["verify_ms"] > 0 and report["bandwidth"]["bound_ms"] > 0


def test_cli_without_model_uses_the_demo_pair(saved, monkeypatch, capsys):
    monkeypatch.setattr(demo, "DEMO_DIR", saved)
    (saved / "bench-prompts.jsonl").write_text('{"prompt": "w5 w6 w7"}\n')
    try:
        bench.main(["--max-tokens", "6", "--passes", "1", "--split-reps", "0"])
    finally:
        (saved / "bench-prompts.jsonl").unlink()
    stdout, stderr = capsys.readouterr()
    assert "dflash-bench: no --model given; using the bundled demo pair" in stderr
    assert "1 prompts" in stdout


def test_scale_tiny_end_to_end(tmp_path, capsys):
    out = tmp_path / "scale.json"
    argv = "--scale tiny --max-tokens 16 --passes 1 --split-reps 1 --overhead-reps 1"
    argv += " --modes plain,dflash"
    argv += f" --replay-tau 2,4,8 --json {out} --quiet"
    if _has_matplotlib():
        argv += f" --plot {tmp_path / 'plots'}"
    bench.main(argv.split())
    stdout = capsys.readouterr().out
    assert "REPLAY tau=4" in stdout and "plain step: 1-token forward" in stdout
    report = json.loads(out.read_text())
    assert report["kind"] == "scale" and report["context"] == 64
    for tau in (2, 4, 8):
        mode = report["modes"][f"replay-tau{tau}"]
        # 16 tokens is a whole number of rounds: every round commits exactly tau.
        assert mode["tau"] == tau and mode["divergence_count"] == 0
        assert mode["histogram"][tau - 1] == mode["rounds"] == 16 // tau
    assert report["modes"]["dflash"]["divergence_count"] == 0
    assert report["split"]["drafter_replay_ms"] > 0
    assert set(report["overhead"]["ab"]) == {"plain", "dflash"}
    assert report["geometry"]["quantization"] is None
    if _has_matplotlib():
        assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
            plots.PLOT_FILES
        )


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def test_scale_targets_are_seeded_and_quantized_by_mlx_lm():
    from mlx.utils import tree_flatten

    def params(model):
        return dict(tree_flatten(model.parameters()))

    a, b = scale_target.build_target("tiny", seed=3), scale_target.build_target(
        "tiny", seed=3
    )
    c = scale_target.build_target("tiny", seed=4)
    pa, pb, pc = params(a), params(b), params(c)
    assert all(mx.array_equal(pa[k], pb[k]) for k in pa)
    assert not mx.array_equal(
        pa["model.layers.0.mlp.up_proj.weight"], pc["model.layers.0.mlp.up_proj.weight"]
    )
    assert all(v.dtype == mx.bfloat16 for v in pa.values())
    quantized = scale_target.build_target("tiny", "4bit", seed=3)
    layers = [
        m for _, m in quantized.named_modules() if isinstance(m, nn.QuantizedLinear)
    ]
    assert layers and all((m.bits, m.group_size) == (4, 64) for m in layers)
    assert scale_target.parameter_bytes(quantized) < scale_target.parameter_bytes(a) / 2
    eight = scale_target.build_target("tiny", "8bit", seed=3)
    layers = [m for _, m in eight.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all((m.bits, m.group_size) == (8, 64) for m in layers)
    sizes = [scale_target.parameter_bytes(m) for m in (quantized, eight, a)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
    with pytest.raises(ValueError, match="quant must be one of"):
        scale_target.build_target("tiny", "3bit")


@pytest.mark.parametrize("name", ["4bit-g32", "4bit-g128", "8bit-g32", "8bit-g128"])
def test_scale_targets_take_the_named_group_size(name):
    """``-gN`` names quantize every projection at its bits in groups of ``N`` (what a
    lease measures before a form joins the kernels' table)."""
    bits, group = int(name[0]), int(name.split("-g")[1])
    model = scale_target.build_target("tiny", name, seed=3)
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all((m.bits, m.group_size) == (bits, group) for m in layers)
    assert scale.geometry_summary(model)["quantization"] == {
        "bits": bits,
        "group_size": group,
    }


def test_the_full_geometry_is_muse_glimmer_as_designed():
    args = scale_target.target_args("full")
    assert args.num_hidden_layers == 52 and args.hidden_size == 6656
    assert args.layer_types.count("sliding_attention") == 39
    assert args.layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"]
    assert (args.num_key_value_heads, args.head_dim) == (2, 128)
    assert (args.vocab_size, args.sliding_window) == (202048, 2048)
    # Bytes from shapes alone (nothing is evaluated): 55.7 GB in bf16 (DESIGN §6).
    from mlx_lm.models import muse_glimmer

    lazy = muse_glimmer.Model(args)
    assert scale_target.parameter_bytes(lazy) / 2 == pytest.approx(55.7e9, rel=2e-3)
    config = scale.drafter_config("full", SimpleNamespace(args=args))
    assert (config.num_hidden_layers, config.block_size) == (5, 16)
    assert config.target_layer_ids == (1, 13, 25, 37, 49)
    assert config.vocab_size == 202048 and config.num_target_layers == 52
    assert config.output_multiplier == args.output_multiplier


def test_the_packaged_assistant_config_is_the_shared_fixture():
    shared = [
        p / "fixtures" / "muse-glimmer-drafters" / "assistant-config.json"
        for p in (
            REPO.parent / "shared",
            REPO.parents[1] / "shared",
            Path("/work/shared"),
        )
    ]
    found = [p for p in shared if p.is_file()]
    if not found:
        pytest.skip("no shared/ fixtures beside this checkout")
    assert json.loads(found[0].read_text()) == json.loads(
        scale.ASSISTANT_CONFIG.read_text()
    )


def test_step_read_bytes_count_one_embedding_row():
    model = scale_target.build_target("tiny", seed=0)
    table = model.model.embed_tokens.weight
    want = (
        scale_target.parameter_bytes(model)
        - table.nbytes
        + table.nbytes // table.shape[0]
    )
    assert scale_target.step_read_bytes(model, kv_bytes=100) == want + 100


def test_plot_without_matplotlib_fails_in_one_line(saved, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--scale", "tiny", "--plot", str(saved / "plots")])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"dflash-bench: error: {plots.MISSING}"]


BAD_FILES = {
    "bad-json.jsonl": '{"prompt": "a"}\n{oops\n',
    "no-prompt.jsonl": '{"text": "a"}\n',
    "empty.jsonl": "\n\n",
}
PAIR = "--model {d}/target --drafter {d}/drafter"


@pytest.mark.parametrize(
    "argv, code, message",
    [
        ("--max-tokens 0", 2, "argument --max-tokens: expected an integer >= 1, got 0"),
        ("--max-tokens ten", 2, "expected an integer >= 1, got 'ten'"),
        ("--block-size 0", 2, "expected an integer >= 1, got 0"),
        ("--limit x", 2, "argument --limit: expected an integer >= 1, got 'x'"),
        ("--bandwidth-tbs fast", 2, "expected a number > 0, got 'fast'"),
        ("--replay-tau 2,x", 2, "expected comma-separated integers"),
        ("--modes plain,fast", 2, "expected comma-separated modes among"),
        ("--scale huge", 2, "invalid choice: 'huge'"),
        ("--bogus", 2, "unrecognized arguments"),
        (PAIR + " --block-size 100000", 1, "block size 100000 is outside 1..6 (this drafter serves blocks of at most 6 tokens)"),
        ("--scale tiny --block-size 9", 1, "block size 9 is outside 1..8 (this drafter serves blocks of at most 8 tokens)"),
        (PAIR + " --prompts {t}/none.jsonl", 1, "prompts file not found"),
        (PAIR + " --prompts {t}/bad-json.jsonl", 1, "bad-json.jsonl:2: not valid JSON"),
        (PAIR + " --prompts {t}/no-prompt.jsonl", 1, "no-prompt.jsonl:1: no 'prompt'"),
        (PAIR + " --prompts {t}/empty.jsonl", 1, "holds no prompts"),
        (PAIR + " --modes plain,classic", 1, "mode classic needs --draft-model"),
        ("--model {d}/target", 1, "--drafter is required with --model"),
        ("--drafter {d}/drafter", 1, "--drafter needs --model"),
        ("--model {t}/nowhere --drafter {d}/drafter", 1, "--model path does not exist"),
        ("--scale tiny --model {d}/target", 1, "--model does not apply to --scale"),
        ("--quant 4bit", 1, "--quant needs --scale"),
        ("--prompts {d}/prompts.jsonl", 1, "the bundled demo pair is not installed"),
        (PAIR + " --prompts {d}/prompts.jsonl --json {t}/no/r.json", 1, "--json folder does not exist"),
    ],
)  # fmt: skip
def test_cli_failures_are_one_line(
    saved, tmp_path, monkeypatch, capsys, argv, code, message
):
    for name, text in BAD_FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "no-demo")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv.format(d=saved, t=tmp_path).split())
    assert exit_info.value.code == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-bench: error: "), lines
    assert message in lines[0], lines


def test_python_m_dflash_bench_fails_in_one_line(tmp_path):
    missing = tmp_path / "none.jsonl"
    argv = ["--model", "t", "--drafter", "d", "--prompts", str(missing)]
    result = subprocess.run(
        [sys.executable, "-m", "dflash.bench", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [f"dflash-bench: error: prompts file not found: {missing}"]


@pytest.mark.skipif(
    not (PEER_SRC / "dflash" / "model_mlx.py").is_file(),
    reason=f"the public dflash 0.1.0 package is not at {PEER_SRC} (set DFLASH_PEER_SRC)",
)
def test_the_public_loop_runs_side_by_side_on_the_tiny_scale_pair(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import side_by_side
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    flags = "--scale tiny --max-tokens 16 --passes 1 --split-reps 0 --replay-tau 2,8"
    merged = side_by_side.side_by_side(
        flags.split() + ["--quiet"], tmp_path, PEER_SRC, sys.executable
    )
    peer = merged["peer"]["modes"]
    assert (
        set(peer)
        == set(merged["ours"]["modes"])
        == {"plain", "replay-tau2", "replay-tau8"}
    )
    # The public loop's budget includes its prefill token: 15 tokens in rounds.
    assert peer["replay-tau2"]["histogram"][1] == 7
    assert peer["replay-tau8"]["histogram"][7] == 1
    assert all(m["divergence_count"] == 0 for m in peer.values())
    rows = {row["mode"]: row for row in merged["comparison"]}
    assert rows["replay-tau2"]["ours_tau"] == 2 and rows["plain"]["ours_over_peer"] > 0
    assert (tmp_path / "side-by-side.md").read_text().count("| replay-tau") == 2


def test_environment_records_the_switches_that_change_what_runs(monkeypatch):
    from dflash.bench.report import environment

    monkeypatch.setenv("DFLASH_COMPILE", "1")
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    env = environment("cmd")["env"]
    assert env["DFLASH_COMPILE"] == "1" and env["MLX_USE_CUDA_GRAPHS"] == "0"
    assert "UNRELATED_SETTING" not in env


@pytest.mark.parametrize(
    "value, state", [(None, "on"), ("1", "on"), ("0", "off"), ("off", "off")]
)
def test_the_record_names_the_launch_mode_a_cuda_run_had(monkeypatch, value, state):
    """Unset means mlx's default, graphs on: a benchmark does not choose, the commands
    do, so a run's record must say which mode it ran in."""
    from dflash.bench.report import cuda_graphs, environment

    if value is None:
        monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", value)
    assert cuda_graphs("cuda") == state
    assert cuda_graphs("metal") is None and cuda_graphs("cpu") is None
    assert environment("cmd")["cuda_graphs"] is None  # this machine's CPU backend


def test_scale_target_loads_as_a_standalone_file() -> None:
    """The side by side hands ``scale_target.py`` to the public loop's process as a plain
    file (no package around it), so it may import only mlx and mlx-lm; its targets and
    replay boost are then the ones our bench uses."""
    spec = importlib.util.spec_from_file_location(
        "standalone_scale_target", Path(scale_target.__file__)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.REPLAY_BOOST == scale_target.REPLAY_BOOST
    assert module.GEOMETRIES == scale_target.GEOMETRIES
