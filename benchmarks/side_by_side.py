"""dflash-bench and the public DFlash MLX loop, side by side, in one run.

Runs ``python -m dflash.bench <flags>`` (saving its drafter in the public DFlash layout),
then ``benchmarks/peer_dflash.py`` in a separate process on the same target (the same
folder, or the same random scale target from the same seed), the same drafter, the same
prompts, the same token budget and REPLAY profiles. Each process measures plain decoding
itself, so every speculative mode is a ratio to plain decoding in its own process; the table
also gives the direct ratio of decode tokens/s (ours / public).

Run (from the repository root)::

    python benchmarks/side_by_side.py --out results/demo -- --limit 16 --passes 3
    python benchmarks/side_by_side.py --out results/scale-bf16-4k -- --scale full \\
        --quant bf16 --context 4096 --max-tokens 256 --passes 3

Writes ``ours.json``, ``peer.json`` (raw runs), ``side-by-side.json`` and
``side-by-side.md`` into ``--out``. Any failure prints one line and exits non-zero.
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
PEER_RUNNER = REPO / "benchmarks" / "peer_dflash.py"
SCALE_TARGET = REPO / "dflash" / "bench" / "scale_target.py"
DEFAULT_PEER_SRC = Path("/work/peer/src")
PROG = "side_by_side.py"


def peer_job(ours: Dict[str, Any], drafter_dir: Path) -> Dict[str, Any]:
    """What the peer runner must run to match a dflash-bench report.

    Args:
        ours: dflash-bench's JSON report.
        drafter_dir: The drafter saved in the public layout.

    Returns:
        The job (JSON-serialisable).
    """
    replay = [
        int(name[len("replay-tau") :])
        for name in ours["mode_order"]
        if name.startswith("replay-tau")
    ]
    job: Dict[str, Any] = {
        "drafter": str(drafter_dir),
        "scale_target_file": str(SCALE_TARGET),
        "max_tokens": ours["max_tokens"],
        "block_size": ours["block_size"],
        "passes": ours["passes"],
        "replay_taus": replay,
        "dflash": "dflash" in ours["mode_order"],
        "eos": ours.get("stop_tokens", []),
    }
    if ours["kind"] == "scale":
        job["target"] = {
            "scale": ours["scale"],
            "quant": ours["quant"],
            "seed": ours["seed"],
        }
        job["prompts"] = {
            "context": ours["context"],
            "count": ours["prompts"],
            "seed": ours["seed"],
        }
    else:
        job["target"] = {"path": str(Path(ours["model"]).resolve())}
        job["prompts"] = ours["prompt_token_ids"]
    return job


def summarize_peer(raw: Dict[str, Any]) -> Dict[str, Any]:
    """The peer's raw runs summarised by dflash-bench's own code.

    Args:
        raw: The peer runner's output.

    Returns:
        A report shaped like dflash-bench's (``modes`` with tokens/s, speed-up, τ, ...).
    """
    from types import SimpleNamespace

    from dflash.bench.passes import summarize_runs
    from dflash.bench.runs import Mode, RunRecord

    modes = [
        Mode(m["name"], m["label"], None, m["drafts_per_round"]) for m in raw["modes"]
    ]
    records = {
        name: [[RunRecord(**run) for run in runs] for runs in passes]
        for name, passes in raw["records"].items()
    }
    state = SimpleNamespace(
        modes=modes,
        records=records,
        errors=raw.get("errors", {}),
        refs=raw["refs"],
        margins=raw["margins"],
        prompt_sizes=raw["prompt_sizes"],
        reference_seconds=raw["reference_seconds"],
    )
    report = summarize_runs(
        state, raw["block_size"], raw["max_tokens"], raw["passes"], 0
    )
    report["peer"] = raw["peer"]
    return report


def _get(mode: Optional[Dict[str, Any]], *keys: str) -> Optional[float]:
    value: Any = mode
    for key in keys:
        if value is None:
            return None
        value = value.get(key)
    return value


def comparison(ours: Dict[str, Any], peer: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per mode both ran: speeds, speed-ups, τ, rounds, divergences.

    Args:
        ours: dflash-bench's report.
        peer: :func:`summarize_peer`'s report.

    Returns:
        The rows.
    """
    rows = []
    for name, mine in ours["modes"].items():
        theirs = peer["modes"].get(name)
        if theirs is None:
            continue
        tps_ours = _get(mine, "tokens_per_s", "median")
        tps_peer = _get(theirs, "tokens_per_s", "median")
        rows.append(
            {
                "mode": name,
                "ours_tokens_per_s": tps_ours,
                "peer_tokens_per_s": tps_peer,
                "ours_over_peer": (
                    tps_ours / tps_peer if tps_ours and tps_peer else None
                ),
                "ours_speedup": _get(mine, "speedup", "ratio_of_medians"),
                "ours_speedup_min": _get(mine, "speedup", "min"),
                "ours_speedup_max": _get(mine, "speedup", "max"),
                "peer_speedup": _get(theirs, "speedup", "ratio_of_medians"),
                "peer_speedup_min": _get(theirs, "speedup", "min"),
                "peer_speedup_max": _get(theirs, "speedup", "max"),
                "ours_tau": mine.get("tau"),
                "peer_tau": theirs.get("tau"),
                "ours_round_ms": _get(mine, "round_ms", "median"),
                "peer_round_ms": _get(theirs, "round_ms", "median"),
                "ours_divergences": mine["divergence_count"],
                "peer_divergences": theirs["divergence_count"],
            }
        )
    return rows


def _f(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def markdown(
    rows: Sequence[Dict[str, Any]], ours: Dict[str, Any], peer_version: str
) -> str:
    """The side-by-side table as Markdown.

    Args:
        rows: :func:`comparison` rows.
        ours: dflash-bench's report (its pair, command and environment head the table).
        peer_version: The public package's version.

    Returns:
        The Markdown text.
    """
    env = ours["environment"]
    head = [
        f"# Side by side: mlx-dflash vs public DFlash MLX loop (dflash {peer_version})",
        "",
        f"- pair: {ours['pair']}",
        f"- command: `{env['command']}`",
        f"- date {env['date']}; mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, backend "
        f"{env['backend']} ({env['device']}); {env['machine']}",
        f"- {ours['prompts']} prompts, up to {ours['max_tokens']} tokens, block "
        f"{ours['block_size']}, {ours['passes']} passes after a warm-up; speed-up = decode "
        "tokens/s over plain decoding measured in the same process (ratio of medians, "
        "min-max over passes)",
        "",
        "| mode | ours tok/s | public tok/s | ours / public | ours vs plain | public vs plain "
        "| tau ours / public | round ms ours / public | diverged ours / public |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speed = (
            f"{_f(r['ours_speedup'], '{:.2f}')}x ({_f(r['ours_speedup_min'], '{:.2f}')}-"
            f"{_f(r['ours_speedup_max'], '{:.2f}')})"
        )
        peer_speed = (
            f"{_f(r['peer_speedup'], '{:.2f}')}x ({_f(r['peer_speedup_min'], '{:.2f}')}-"
            f"{_f(r['peer_speedup_max'], '{:.2f}')})"
        )
        head.append(
            f"| {r['mode']} | {_f(r['ours_tokens_per_s'], '{:.1f}')} | "
            f"{_f(r['peer_tokens_per_s'], '{:.1f}')} | {_f(r['ours_over_peer'], '{:.2f}')} | "
            f"{speed if r['mode'] != 'plain' else '1'} | "
            f"{peer_speed if r['mode'] != 'plain' else '1'} | "
            f"{_f(r['ours_tau'], '{:.2f}')} / {_f(r['peer_tau'], '{:.2f}')} | "
            f"{_f(r['ours_round_ms'], '{:.1f}')} / {_f(r['peer_round_ms'], '{:.1f}')} | "
            f"{r['ours_divergences']} / {r['peer_divergences']} |"
        )
    return "\n".join(head) + "\n"


def _run(command: List[str], cwd: Path, what: str) -> None:
    print(f"{PROG}: running {what}: {shlex.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode})")


def side_by_side(
    bench_flags: Sequence[str], out: Path, peer_src: Path, python: str
) -> Dict[str, Any]:
    """Run both, write the four files, return the merged report.

    Args:
        bench_flags: dflash-bench flags (not ``--json`` / ``--save-drafter``).
        out: Output folder (created).
        peer_src: Folder holding the public ``dflash`` package.
        python: Interpreter for both processes.

    Returns:
        ``{"ours", "peer", "comparison"}``.
    """
    for flag in ("--json", "--save-drafter"):
        if flag in bench_flags:
            raise ValueError(
                f"{flag} is set by {PROG}; leave it out of the bench flags"
            )
    if not (peer_src / "dflash" / "model_mlx.py").is_file():
        raise FileNotFoundError(f"no public dflash package under {peer_src}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dflash-peer-") as scratch:
        scratch_dir = Path(scratch)
        drafter_dir = scratch_dir / "drafter"
        ours_file = out / "ours.json"
        bench = [python, "-m", "dflash.bench", *bench_flags, "--json", str(ours_file)]
        _run(bench + ["--save-drafter", str(drafter_dir)], REPO, "dflash-bench")
        ours = json.loads(ours_file.read_text())
        job_file = scratch_dir / "job.json"
        job_file.write_text(json.dumps(peer_job(ours, drafter_dir)))
        raw_file = out / "peer.json"
        # Not -I: mlx may be reachable only through PYTHONPATH (as on the GPU host). The runner
        # puts the peer first on sys.path and refuses any other dflash it would import.
        runner = [python, "-s", str(PEER_RUNNER), "--peer-src", str(peer_src.resolve())]
        runner += ["--job", str(job_file), "--out", str(raw_file.resolve())]
        # A working folder outside the checkout: nothing there is importable as dflash.
        _run(runner, scratch_dir, "the public DFlash loop")
    peer = summarize_peer(json.loads(raw_file.read_text()))
    rows = comparison(ours, peer)
    merged = {"ours": ours, "peer": peer, "comparison": rows}
    (out / "side-by-side.json").write_text(json.dumps(merged, indent=2) + "\n")
    text = markdown(rows, ours, peer["peer"])
    (out / "side-by-side.md").write_text(text)
    print(text)
    return merged


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command line: ``side_by_side.py --out DIR [--peer-src DIR] -- <bench flags>``.

    Args:
        argv: The arguments (default ``sys.argv[1:]``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--peer-src", type=Path, default=DEFAULT_PEER_SRC)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv[:split])
    try:
        side_by_side(argv[split + 1 :], args.out, args.peer_src, args.python)
    except Exception as error:  # one line, no traceback
        text = str(error).strip().splitlines()
        print(
            f"{PROG}: error: {text[0] if text else type(error).__name__}",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
