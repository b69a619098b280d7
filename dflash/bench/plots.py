"""``--plot DIR``: acceptance by position, τ histogram, tokens/s per mode (matplotlib PNGs).

matplotlib is an optional dependency (the ``bench`` extra: ``pip install
'mlx-dflash[bench]'``); without it the CLI fails in one line before running anything.
"""

from pathlib import Path
from typing import Any, Dict, List

PLOT_FILES = ("acceptance_by_position.png", "tau_histogram.png", "tokens_per_s.png")
MISSING = "--plot needs matplotlib: pip install 'mlx-dflash[bench]' (or matplotlib)"


def require_matplotlib() -> None:
    """Fail early, in one line, when matplotlib is not installed.

    Raises:
        ModuleNotFoundError: matplotlib is missing (the message says how to install it).
    """
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise ModuleNotFoundError(MISSING) from None


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: Dict[str, Any], folder: Path) -> List[Path]:
    """Write the three PNGs of ``report`` into ``folder`` (created if needed).

    Args:
        report: A ``dflash-bench`` report.
        folder: Output folder.

    Returns:
        The files written.
    """
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    speculative = {n: m for n, m in report["modes"].items() if "tau" in m}
    paths = [folder / name for name in PLOT_FILES]
    plots = [
        (_acceptance, speculative),
        (_histogram, speculative),
        (_speed, report["modes"]),
    ]
    for (draw, modes), path in zip(plots, paths):
        figure, axis = plt.subplots(figsize=(7, 4))
        draw(axis, modes)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
    return paths


def _acceptance(axis, modes: Dict[str, Any]) -> None:
    for name, mode in modes.items():
        curve = mode["position_acceptance"]
        axis.plot(range(1, len(curve) + 1), curve, marker="o", label=name)
    axis.set(
        xlabel="draft position in the block",
        ylabel="fraction of rounds accepted",
        ylim=(0, 1.05),
        title="Acceptance by draft position",
    )
    if modes:
        axis.legend()


def _histogram(axis, modes: Dict[str, Any]) -> None:
    width = 0.8 / max(len(modes), 1)
    for slot, (name, mode) in enumerate(modes.items()):
        counts = mode["histogram"]
        rounds = max(sum(counts), 1)
        xs = [n + 1 + (slot - (len(modes) - 1) / 2) * width for n in range(len(counts))]
        axis.bar(xs, [c / rounds for c in counts], width=width, label=name)
    axis.set(
        xlabel="tokens committed in a round (accepted drafts + 1)",
        ylabel="fraction of rounds",
        title="Tokens per round (tau) histogram",
    )
    if modes:
        axis.legend()


def _speed(axis, modes: Dict[str, Any]) -> None:
    names = list(modes)
    for slot, name in enumerate(names):
        values = [v for v in modes[name]["tokens_per_s"]["per_pass"] if v is not None]
        axis.scatter([slot] * len(values), values, color="tab:gray", s=12, zorder=3)
        median = modes[name]["tokens_per_s"]["median"]
        if median is not None:
            axis.bar(slot, median, color="tab:blue", alpha=0.6)
    axis.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axis.set(
        ylabel="decode tokens/s", title="Tokens/s per mode (bar: median; dots: passes)"
    )
