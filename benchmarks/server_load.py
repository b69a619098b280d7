"""dflash-server under load: N concurrent chat clients x M turns, DFlash on and off.

Starts a real server (``python -m dflash.server``) per mode on a loopback port, runs N client
threads that each hold an M-turn conversation (streamed, so the time to the first token is
measured), and reports requests/s, time to first token, tokens/s per client, p50/p95 latency
and the prompt tokens served from the session cache.

Run from the repository root, e.g.::

    python -m benchmarks.server_load --clients 4 --turns 3 --max-tokens 32 \
        --out docs/benchmarks/server-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional

from tests.support.server_process import ServerProcess

MODES = ("dflash", "plain")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.server_load", description=__doc__
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (N)")
    parser.add_argument("--turns", type=int, default=3, help="turns per client (M)")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="max_tokens per request"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated: dflash, plain (default both)",
    )
    parser.add_argument(
        "--model", help="--model for the server (default: the demo pair)"
    )
    parser.add_argument("--drafter", help="--drafter for the server (with --model)")
    parser.add_argument(
        "--block-size", type=int, help="DFlash block size (default: drafter's)"
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra server flag (repeatable)",
    )
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    parser.add_argument("--note", help="a line about the code measured, for the report")
    return parser.parse_args(argv)


def stream_chat(client, url: str, messages, max_tokens: int) -> dict:
    """One streamed chat request; returns its timings and token counts."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, text, usage = None, [], None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first if first is not None else time.perf_counter()
                    text.append(content)
    end = time.perf_counter()
    return {
        "ttft": (first or end) - start,
        "latency": end - start,
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "text": "".join(text),
    }


def client_run(
    url: str, index: int, turns: int, max_tokens: int, results: list
) -> None:
    import httpx

    messages = [{"role": "system", "content": "You write Python."}]
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            messages.append(
                {"role": "user", "content": f"def task_{index}_{turn}(items):"}
            )
            record = stream_chat(client, url, messages, max_tokens)
            record.update(client=index, turn=turn)
            results.append(record)
            messages.append({"role": "assistant", "content": record.pop("text")})


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    flags = list(args.server_arg)
    if args.model:
        flags += ["--model", args.model]
    if args.drafter and mode == "dflash":
        flags += ["--drafter", args.drafter]
    if mode == "plain":
        flags.append("--no-drafter")
    elif args.block_size:
        flags += ["--block-size", str(args.block_size)]
    # No start-up limit: a large --model may take long to load.
    server = ServerProcess(*flags, timeout=float("inf"))
    try:
        import httpx

        with httpx.Client(timeout=600) as client:  # warm-up: first-call compilation
            stream_chat(
                client, server.url, [{"role": "user", "content": "def f():"}], 4
            )
        results: list = []
        threads = [
            threading.Thread(
                target=client_run,
                args=(server.url, i, args.turns, args.max_tokens, results),
            )
            for i in range(args.clients)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    finally:
        server.close()
    return summarize(mode, server.banner, results, wall, args)


def summarize(mode, banner, results, wall, args) -> dict:
    per_client = []
    for index in range(args.clients):
        mine = [r for r in results if r["client"] == index]
        busy = sum(r["latency"] for r in mine)
        per_client.append(
            sum(r["completion_tokens"] for r in mine) / busy if busy else 0.0
        )
    later = [r for r in results if r["turn"] > 0]
    return {
        "mode": mode,
        "server": banner,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "completion_tokens": sum(r["completion_tokens"] for r in results),
        "tokens_per_s_total": sum(r["completion_tokens"] for r in results) / wall,
        "tokens_per_s_per_client_mean": statistics.mean(per_client),
        "ttft_p50_s": percentile([r["ttft"] for r in results], 0.5),
        "ttft_p95_s": percentile([r["ttft"] for r in results], 0.95),
        "latency_p50_s": percentile([r["latency"] for r in results], 0.5),
        "latency_p95_s": percentile([r["latency"] for r in results], 0.95),
        "later_turns_cached_fraction": (
            sum(r["cached_tokens"] for r in later)
            / sum(r["prompt_tokens"] for r in later)
            if later
            else 0.0
        ),
        "records": results,
    }


def machine() -> dict:
    import mlx.core as mx

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "python": platform.python_version(),
    }


def markdown(report: dict) -> str:
    meta = report["meta"]
    device = meta["machine"]["device"]
    lines = [
        "# dflash-server under load",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}`",
        f"- Machine: {meta['machine']['cpu']} ({meta['machine']['cpu_count']} cores), "
        f"{meta['machine']['platform']}, mlx {meta['machine']['mlx']}, device {device}; "
        f"load average at the start {meta['machine']['load_average']}",
        f"- Load: {meta['clients']} concurrent clients x {meta['turns']} chat turns, "
        f"max_tokens {meta['max_tokens']}, temperature 0, streamed",
    ]
    if meta.get("note"):
        lines.append(f"- Code: {meta['note']}")
    if "cpu" in device.lower():
        lines.append(
            "- These are CPU numbers (mlx's CPU backend, a machine shared with other jobs): "
            "they show the server's behaviour, not accelerator speed."
        )
    lines += [
        "",
        "| mode | requests/s | tokens/s total | tokens/s per client | TTFT p50 / p95 (s) | "
        "latency p50 / p95 (s) | cached prompt share, turns 2+ |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["modes"]:
        lines.append(
            f"| {row['mode']} | {row['requests_per_s']:.2f} | {row['tokens_per_s_total']:.1f} "
            f"| {row['tokens_per_s_per_client_mean']:.1f} | {row['ttft_p50_s']:.2f} / "
            f"{row['ttft_p95_s']:.2f} | {row['latency_p50_s']:.2f} / "
            f"{row['latency_p95_s']:.2f} | {row['later_turns_cached_fraction']:.0%} |"
        )
    lines += ["", "Servers:", ""] + [
        f"- {row['mode']}: `{row['server']}`" for row in report["modes"]
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; use {MODES}")
    report = {
        "meta": {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(
                ["python -m benchmarks.server_load"]
                + (sys.argv[1:] if argv is None else argv)
            ),
            "machine": machine(),
            "clients": args.clients,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "note": args.note,
        },
        "modes": [run_mode(mode, args) for mode in modes],
    }
    text = markdown(report)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
        Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()
