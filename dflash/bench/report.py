"""The environment a run records, and the printed summary of a report."""

import datetime
import importlib.metadata
import os
import platform
from typing import Any, Dict, List, Optional

import mlx.core as mx

from ..metal.backend import cuda_graphs_off

CPU_NOTE = (
    "NOTE: the backend is the CPU, which is slow at multi-token forwards: tokens/s and "
    "speed-ups here say nothing about GPU speed; tau, acceptance and divergences hold."
)


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def backend() -> str:
    """``"cuda"``, ``"metal"`` or ``"cpu"``: where the default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        return "cuda"
    return "metal" if mx.metal.is_available() else "gpu"


def cuda_graphs(backend_name: Optional[str] = None) -> Optional[str]:
    """Whether mlx records CUDA graphs in this process, as ``MLX_USE_CUDA_GRAPHS`` says.

    A benchmark leaves the variable as it finds it (only the ``dflash`` commands choose a
    launch mode), so a run's own record names the mode it ran in.

    Args:
        backend_name: As :func:`backend` gives it (default: asked now).

    Returns:
        ``"on"`` (mlx's default, the variable unset or not an off word) or ``"off"`` on
        the CUDA backend; None elsewhere, where the variable means nothing.
    """
    if (backend_name or backend()) != "cuda":
        return None
    return "off" if cuda_graphs_off(os.environ.get("MLX_USE_CUDA_GRAPHS")) else "on"


def _device_info() -> Dict[str, Any]:
    try:
        info = (
            mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        )
    except Exception:  # noqa: BLE001 (informational only; the CPU backend has none)
        return {}
    return {
        k: v if isinstance(v, (int, float, str)) else str(v) for k, v in info.items()
    }


def environment(command: str) -> Dict[str, Any]:
    """What a benchmark result needs to be read later: versions, device, machine, date.

    Args:
        command: The command line that produced the result.

    Returns:
        A JSON-serialisable dict.
    """
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "command": command,
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "mlx_dflash": _version("mlx-dflash"),
        "python": platform.python_version(),
        "backend": backend(),
        "cuda_graphs": cuda_graphs(),
        "device": str(mx.default_device()),
        "device_info": _device_info(),
        "machine": f"{platform.platform()} ({platform.machine()}), {os.cpu_count()} CPUs",
        # mlx's switches and ours (verify kernels, compile, layouts) change what runs.
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(("MLX_", "DFLASH_"))
        },
    }


def _num(value: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def _range(spread: Dict[str, Any], fmt: str) -> str:
    if spread.get("min") is None:
        return ""
    return f" ({fmt.format(spread['min'])}-{fmt.format(spread['max'])})"


def mode_table(report: Dict[str, Any]) -> List[str]:
    """One line per mode: tokens/s, speed-up over plain, τ, peak memory, divergences.

    Args:
        report: A :func:`dflash.bench.run_bench` report.

    Returns:
        The lines, header first.
    """
    lines = [
        f"{'mode':<14}{'tokens/s (min-max)':<26}{'vs plain (min-max)':<24}"
        f"{'tau':>6}{'peak GB':>10}{'diverged':>10}"
    ]
    for name, mode in report["modes"].items():
        tps = mode["tokens_per_s"]
        speed = mode.get("speedup")
        ratio = "1.00x" if speed is None else _num(speed["ratio_of_medians"], "{:.2f}x")
        if speed is not None:
            ratio += _range(speed, "{:.2f}")
        tau = _num(mode.get("tau"), "{:.2f}")
        lines.append(
            f"{name:<14}{_num(tps['median']) + _range(tps, '{:.1f}'):<26}{ratio:<24}"
            f"{tau:>6}{mode['peak_memory_gb']:>10.3g}{mode['divergence_count']:>10}"
        )
        if mode.get("error"):
            lines.append(f"  {name} failed: {mode['error']}")
    return lines


def _mode_details(name: str, mode: Dict[str, Any]) -> List[str]:
    lines = [f"{name}: {mode['label']}"]
    if "tau" in mode:
        histogram = " ".join(f"{n}:{c}" for n, c in enumerate(mode["histogram"]) if c)
        curve = " ".join(f"{rate:.2f}" for rate in mode["position_acceptance"])
        lines += [
            f"  tau {mode['tau']:.3f} tokens/round over {mode['rounds']} rounds",
            f"  accepted drafts per round (n:rounds): {histogram}",
            f"  acceptance by draft position 1..{len(mode['position_acceptance'])}: "
            f"{curve}",
        ]
    rounds = mode["round_ms"]
    if rounds["median"] is not None:
        lines.append(
            f"  round (inside the loop) median {rounds['median']:.2f} ms; first 20 "
            f"{_num(rounds['first_20'], '{:.2f}')} ms, last 20 "
            f"{_num(rounds['last_20'], '{:.2f}')} ms"
        )
    lines += [_divergence_line(record) for record in mode["divergences"][:10]]
    return lines


def _divergence_line(record: Dict[str, Any]) -> str:
    margin = record["margin"]
    shown = "n/a" if margin is None else f"{margin:.3g}"
    return (
        f"  divergence: pass {record.get('pass_index', 0)}, prompt "
        f"{record['prompt_index']}, position {record['position']}: expected "
        f"{record['expected']}, got {record['got']} (top-2 margin {shown})"
    )


def _split_lines(report: Dict[str, Any]) -> List[str]:
    split = report.get("split")
    if not split:
        return []
    lines = [
        f"round split (each part eval-timed alone, context {split['context']}): drafter "
        f"{split['drafter_ms']:.2f} ms, verify {split['verify_ms']:.2f} ms"
    ]
    for name, row in split["rounds"].items():
        if row["round_ms"] is not None:
            lines.append(
                f"  {name}: round in the loop {row['round_ms']:.2f} ms = drafter + verify "
                f"+ {row['rest_ms']:.2f} ms everything else"
            )
    bandwidth = report["bandwidth"]
    lines.append(
        f"plain step: 1-token forward (synchronised) {split['plain_step_ms']:.2f} ms, "
        f"decode per token (mlx-lm pipelined) {_num(bandwidth.get('plain_decode_ms'), '{:.2f}')}"
        f" ms; bandwidth bound {bandwidth['bound_ms']:.3g} ms "
        f"({_bytes(bandwidth['step_read_bytes'])} read per step / "
        f"{bandwidth['bandwidth_tbs']} TB/s; weights {_bytes(bandwidth['weight_bytes'])})"
    )
    return lines


def _overhead_lines(report: Dict[str, Any]) -> List[str]:
    over = report["overhead"]
    parts = [
        f"bench overhead: bookkeeping {over['bookkeeping_us_per_token']:.2f} us/token "
        f"= {_num(over['bookkeeping_fraction'] and 100 * over['bookkeeping_fraction'], '{:.4f}')}"
        "% of the fastest mode's time per token"
    ]
    if over.get("replay_ms_per_round") is not None:
        parts.append(
            f"REPLAY adds {over['replay_ms_per_round']:.3f} ms/round = "
            f"{_num(over['replay_fraction'] and 100 * over['replay_fraction'], '{:.2f}')}"
            "% of the shortest replay round"
        )
    lines = ["; ".join(parts)]
    for name, ab in (over.get("ab") or {}).items():
        lines.append(
            f"  A/B {name}: drained bare {ab['bare_s']:.3f} s, through the bench "
            f"{ab['bench_s']:.3f} s ({100 * ab['overhead']:+.2f}%)"
        )
    return lines


def format_summary(report: Dict[str, Any]) -> str:
    """A human-readable summary of a report (no trailing newline).

    Args:
        report: A :func:`dflash.bench.run_bench` report, possibly with ``environment``
            and ``pair`` added by the CLI.

    Returns:
        The text.
    """
    lines = []
    env = report.get("environment")
    if env is not None and env["backend"] == "cpu":
        lines.append(CPU_NOTE)
    if report.get("pair"):
        lines.append(f"pair: {report['pair']}")
    lines.append(
        f"{report['prompts']} prompts (mean {report['mean_prompt_tokens']:.1f} prompt "
        f"tokens), up to {report['max_tokens']} tokens, block {report['block_size']}, "
        f"{report['passes']} passes after a warm-up; decode tokens/s = tokens after the "
        "first round / time after it"
    )
    lines += mode_table(report)
    for name, mode in report["modes"].items():
        lines += _mode_details(name, mode)
    if "divergence_count" in report:
        lines.append(
            "divergences from the target's greedy output (dflash): "
            f"{report['divergence_count']}"
        )
    lines += _split_lines(report)
    lines += _overhead_lines(report)
    return "\n".join(lines)
