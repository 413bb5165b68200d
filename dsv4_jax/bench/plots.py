"""PNG figures of a benchmark result (matplotlib, the optional `bench` extra): decode ms per step against batch with
the memory-roofline floor, and one decode step's kernel time by op family."""

from __future__ import annotations

import os


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'dsv4_jax[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def decode_plot(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = sorted({case["context"] for case in result["decode"]})
    main_side = result["model"]["kernels"]
    for context in contexts:
        for mode, style in ((main_side, "o-"), ("reference", "s--")):
            cases = sorted((c for c in result["decode"] if c["context"] == context and c["kernels"] == mode),
                           key=lambda c: c["batch"])
            if cases:
                ax.plot([c["batch"] for c in cases], [c["ms_per_step"] for c in cases], style,
                        label=f"{mode}, context {context}")
        floor = sorted((c for c in result["decode"] if c["context"] == context and c["kernels"] == main_side),
                       key=lambda c: c["batch"])
        if floor:
            ax.plot([c["batch"] for c in floor], [c["floor_ms"] for c in floor], ":", color="gray",
                    label=f"memory floor, context {context}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    batches = sorted({case["batch"] for case in result["decode"]})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("ms per decode step")
    model = result["model"]
    ax.set_title(f"{model['preset']} geometry, {model['layers']} layers, {result['machine']['device_kind']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def profile_plot(result: dict, path: str) -> None:
    plt = _pyplot()
    rows = result["profile"]["by_family"]
    fig, ax = plt.subplots(figsize=(9, 2.2))
    left = 0.0
    for family, row in rows.items():
        ax.barh([0], [row["ms"]], left=left, label=f"{family} {row['percent']:.0f}%")
        left += row["ms"]
    ax.set_yticks([])
    ax.set_xlabel("ms of kernel time in one decode step")
    ax.set_title(f"batch-{result['profile']['batch']} decode step by op ({result['machine']['device_kind']})")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_plots(result: dict, directory: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    stem = f"{result['model']['preset']}_{result['model']['layers']}l"
    paths = []
    if result.get("decode"):
        paths.append(os.path.join(directory, f"{stem}_decode.png"))
        decode_plot(result, paths[-1])
    if result.get("profile"):
        paths.append(os.path.join(directory, f"{stem}_decode_profile.png"))
        profile_plot(result, paths[-1])
    return paths
