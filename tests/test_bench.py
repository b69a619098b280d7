"""dflash-bench: τ and the losslessness check on a tiny target + drafter; failures."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import (
    greedy_reference,
    save_target,
    tiny_model,
    tiny_tokenizer,
    top2_margin,
)
from test_dflash_loop import OracleDrafter, random_drafter

from dflash import bench, demo
from dflash.loader import save_drafter

BLOCK = 6
PROMPTS = [
    "w5 w6 w7 w8 w9 w22 w23 w24",  # (w1x would split on the special token w1)
    "w30 w31 w32 w33 w34 w35 w36 w37 w38 w39 w40 w41 w42 w43 w44 w45 w46 w47 w48 w49",
]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("muse_glimmer", seed=0, window=16)
    return target, tiny_tokenizer(), random_drafter(target, block_size=BLOCK)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pair):
    """A demo-layout folder (target/, drafter/) plus a prompts file."""
    root = tmp_path_factory.mktemp("bench")
    target, _, drafter = pair
    save_target(target, root / "target")
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
    report = bench.run_bench(target, tokenizer, drafter, PROMPTS, max_tokens=24)
    assert report["divergence_count"] == 0 and report["divergences"] == []
    assert report["prompts"] == 2 and report["block_size"] == BLOCK
    assert report["generated_tokens"] == report["reference_tokens"] == 48
    assert report["tau"] >= 1.0
    assert (
        sum(report["histogram"]) == report["rounds"]
        and len(report["histogram"]) == BLOCK
    )
    assert len(report["position_acceptance"]) == BLOCK - 1
    assert report["mean_prompt_tokens"] == (8 + 20) / 2
    json.dumps(report)  # serialisable as is


def test_a_drafter_that_is_always_right_gives_full_acceptance(pair):
    target, tokenizer, _ = pair
    prompt = encode(PROMPTS[1])
    sequence = prompt.tolist() + greedy_reference(target, prompt, 30)
    oracle = OracleDrafter(sequence, BLOCK, (1, 4, 7))
    report = bench.run_bench(target, tokenizer, oracle, PROMPTS[1:], max_tokens=24)
    assert report["divergence_count"] == 0
    assert report["rounds"] == 24 // BLOCK and report["tau"] == BLOCK
    assert report["histogram"][-1] == report["rounds"]
    assert report["position_acceptance"] == [1.0] * (BLOCK - 1)


def corrupt_second_call(monkeypatch, edit):
    """Make ``bench.dflash_generate_step`` yield ``edit(tokens)`` on its second call."""
    real = bench.dflash_generate_step
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        steps = list(real(*args, **kwargs))
        if len(calls) != 2:
            return iter(steps)
        return iter(edit(steps))

    monkeypatch.setattr(bench, "dflash_generate_step", wrapped)


def test_a_flipped_token_is_one_divergence_at_its_position(pair, monkeypatch):
    target, tokenizer, drafter = pair
    reference = greedy_reference(target, encode(PROMPTS[1]), 24)
    assert 0 not in reference[:8]  # the tiny tokenizer's EOS would end the run early

    def flip(steps):
        steps[7] = ((steps[7][0] + 1) % 256,) + steps[7][1:]
        steps[9] = ((steps[9][0] + 1) % 256,) + steps[9][1:]  # only the first counts
        return steps

    corrupt_second_call(monkeypatch, flip)
    report = bench.run_bench(target, tokenizer, drafter, PROMPTS, max_tokens=24)
    assert report["divergence_count"] == 1
    record = report["divergences"][0]
    assert record["prompt_index"] == 1 and record["position"] == 7
    assert (
        record["expected"] == reference[7] and record["got"] == (reference[7] + 1) % 256
    )
    want = top2_margin(target, encode(PROMPTS[1]).tolist() + reference[:7])
    assert record["margin"] == pytest.approx(want, rel=1e-3, abs=1e-5)


def test_a_short_output_is_a_divergence(pair, monkeypatch):
    target, tokenizer, drafter = pair
    corrupt_second_call(monkeypatch, lambda steps: steps[:5])
    report = bench.run_bench(target, tokenizer, drafter, PROMPTS, max_tokens=24)
    assert report["divergence_count"] == 1
    record = report["divergences"][0]
    assert (record["prompt_index"], record["position"], record["got"]) == (1, 5, None)
    assert isinstance(record["expected"], int) and record["margin"] > 0


def test_first_divergence_rules():
    margins = [1.0, 2.0, 3.0]
    assert bench.first_divergence(0, [1, 2, 3], margins, [1, 2, 3]) is None
    assert bench.first_divergence(4, [1, 2, 3], margins, [1, 9, 8]) == {
        "prompt_index": 4,
        "position": 1,
        "expected": 2,
        "got": 9,
        "margin": 2.0,
    }
    longer = bench.first_divergence(0, [1, 2], margins[:2], [1, 2, 3])
    assert (
        longer["position"],
        longer["expected"],
        longer["got"],
        longer["margin"],
    ) == (2, None, 3, None)


def test_both_runs_stop_after_the_end_of_sequence_token(pair):
    target, tokenizer, drafter = pair
    prompt = encode(PROMPTS[0])
    reference = greedy_reference(target, prompt, 12)
    stop = {reference[3]}
    stats = bench.GenerationStats(BLOCK)
    got = bench.dflash_tokens(
        target, drafter, prompt, max_tokens=12, block_size=BLOCK, stats=stats, stop=stop
    )
    assert got == reference[: reference.index(reference[3]) + 1]


@pytest.mark.parametrize(
    "kwargs, prompts, message",
    [
        (dict(block_size=1), PROMPTS, "block_size must be >= 2"),
        (dict(max_tokens=0), PROMPTS, "max_tokens must be > 0"),
        ({}, [], "prompt set is empty"),
        ({}, ["w5", ""], "prompt 1 encodes to no tokens"),
    ],
)
def test_run_bench_refuses_bad_settings(pair, kwargs, prompts, message):
    target, tokenizer, drafter = pair
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


def test_cli_writes_the_json_report(saved, tmp_path, capsys):
    out = tmp_path / "report.json"
    bench.main(
        [
            "--model",
            str(saved / "target"),
            "--drafter",
            str(saved / "drafter"),
            "--prompts",
            str(saved / "prompts.jsonl"),
            "--max-tokens",
            "10",
            "--block-size",
            "4",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    stdout, stderr = capsys.readouterr()
    assert (
        "tau" in stdout and "divergences from the target's greedy output: 0" in stdout
    )
    assert stderr == ""  # --quiet: no progress bar
    report = json.loads(out.read_text())
    for key in (
        "tau",
        "divergences",
        "divergence_count",
        "position_acceptance",
        "histogram",
        "prompts",
        "generated_tokens",
        "rounds",
        "block_size",
        "max_tokens",
        "date",
        "command",
        "machine",
        "model",
        "drafter",
    ):
        assert key in report, key
    assert report["block_size"] == 4 and len(report["position_acceptance"]) == 3
    assert report["prompts"] == 2 and report["max_tokens"] == 10
    assert report["divergence_count"] == 0 and report["generated_tokens"] == 20
    assert report["model"] == str(saved / "target") and "--json" in report["command"]


def test_cli_without_model_uses_the_demo_pair(saved, monkeypatch, capsys):
    monkeypatch.setattr(demo, "DEMO_DIR", saved)
    (saved / "bench-prompts.jsonl").write_text('{"prompt": "w5 w6 w7"}\n')
    try:
        bench.main(["--max-tokens", "6"])
    finally:
        (saved / "bench-prompts.jsonl").unlink()
    stdout, stderr = capsys.readouterr()
    assert "dflash-bench: no --model given; using the bundled demo pair" in stderr
    assert "1 prompts" in stdout


BAD_FILES = {
    "bad-json.jsonl": '{"prompt": "a"}\n{oops\n',
    "no-prompt.jsonl": '{"text": "a"}\n',
    "empty.jsonl": "\n\n",
}
PAIR = "--model {d}/target --drafter {d}/drafter"


@pytest.mark.parametrize(
    "argv, code, message",
    [
        ("--max-tokens 0", 2, "must be >= 1"),
        ("--block-size 1", 2, "must be >= 2"),
        ("--limit x", 2, "not an integer"),
        ("--bogus", 2, "unrecognized arguments"),
        (PAIR + " --prompts {t}/none.jsonl", 1, "prompts file not found"),
        (PAIR + " --prompts {t}/bad-json.jsonl", 1, "bad-json.jsonl:2: not valid JSON"),
        (PAIR + " --prompts {t}/no-prompt.jsonl", 1, "no-prompt.jsonl:1: no 'prompt'"),
        (PAIR + " --prompts {t}/empty.jsonl", 1, "holds no prompts"),
        ("--model {d}/target", 1, "--drafter is required with --model"),
        ("--drafter {d}/drafter", 1, "--drafter needs --model"),
        ("--prompts {d}/prompts.jsonl", 1, "the bundled demo pair is not installed"),
        (
            PAIR + " --prompts {d}/prompts.jsonl --json {t}/no/r.json",
            1,
            "--json folder does not exist",
        ),
    ],
)
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
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [f"dflash-bench: error: prompts file not found: {missing}"]
