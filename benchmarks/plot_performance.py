"""The figures of docs/performance.md, drawn from the raw benchmark results kept under docs/bench/.

    python benchmarks/plot_performance.py            # writes docs/perf_decode_batch.png, docs/perf_long_context.png,
                                                     # docs/perf_prefill.png

Each figure plots exactly the rows of the page's tables: the SOURCES below name, for every point, the JSON file
(written by `python -m dsv4_jax.bench --out`) that holds it. Nothing is measured here; needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BENCH = os.path.join(ROOT, "docs", "bench")

# (batch, context) -> the latest raw file that measured that decode case on an H200 (4 Flash layers, bf16 caches)
DECODE = {
    (1, 4096): "h200_2026-12-05_query_ready_flash4_baseline.json",
    (8, 4096): "h200_2026-12-05_query_ready_flash4_baseline.json",
    (32, 4096): "h200_2026-12-04_launches_ab_new.json",
    (64, 4096): "h200_2026-12-03_s9_wide_gemv_flash4_new.json",
    (1, 65536): "h200_2026-12-04_flash4_64k.json",
    (8, 65536): "h200_2026-12-04_flash4_64k.json",
    (32, 65536): "h200_2026-12-03_s8_flash4.json",
    (64, 65536): "h200_2026-12-03_s8_flash4.json",
}
REFERENCE = "h200_2026-12-02_model_flash4.json"        # kernels="reference" (XLA only), every case above

# (cache kind, batch, context) -> raw file, decode against context (4 Flash layers)
LONG_CONTEXT = {
    ("bf16", 1, 4096): DECODE[(1, 4096)],
    ("bf16", 8, 4096): DECODE[(8, 4096)],
    ("bf16", 1, 65536): DECODE[(1, 65536)],
    ("bf16", 8, 65536): DECODE[(8, 65536)],
    ("bf16", 1, 131072): "h200_2026-12-03_s9_decode_attention_split_flash4_baseline.json",
    ("bf16", 8, 131072): "h200_2026-12-03_s9_decode_attention_split_flash4_baseline.json",
    ("fp8", 1, 4096): "h200_2026-12-02_s5_flash4_longctx_fp8.json",
    ("fp8", 8, 4096): "h200_2026-12-02_s5_flash4_longctx_fp8.json",
    ("fp8", 1, 131072): "h200_2026-12-02_s5_flash4_longctx_fp8_onepass.json",
    ("fp8", 8, 131072): "h200_2026-12-02_s5_flash4_longctx_fp8_onepass.json",
    ("fp8", 1, 524288): "h200_2026-12-02_s5_flash4_longctx_fp8_onepass.json",
    ("fp8", 8, 524288): "h200_2026-12-02_s5_flash4_longctx_fp8_onepass.json",
}

# prefill chunk size -> raw file of the time-to-first-token sweep (default XLA flags)
TTFT = {
    512: "h200_2026-12-03_s10_flash4_prefill_default_chunk512.json",
    2048: "h200_2026-12-03_s10_flash4_prefill_default_chunk2048.json",
    4096: "h200_2026-12-03_s10_flash4_prefill_default_chunk4096.json",
}
TTFT_512_32K = "h200_2026-12-03_s9_flash4_prefill32k.json"    # the 32K prompt in 512-token chunks

# prefill chunk size -> raw file with a traced chunk by op family ("profile_prefill")
PREFILL_PROFILE = {
    512: "h200_2026-12-03_s10_flash4_profile.json",
    2048: "h200_2026-12-03_s10_flash4_window_blocks_chunk2048.json",
    8192: "h200_2026-12-03_s10_flash4_window_blocks_chunk8192.json",
}
FAMILIES = [("fp4 matmul", "FP4 matmul (routed experts)"), ("attention", "attention"), ("indexer", "indexer"),
            ("fp8 matmul", "FP8 matmul (projections)"), ("moe dispatch/combine", "MoE dispatch / combine"),
            ("mhc", "mHC")]


def load(name: str) -> dict:
    with open(os.path.join(BENCH, name)) as f:
        return json.load(f)


def decode_row(name: str, batch: int, context: int, kernels: str = "auto") -> dict:
    for row in load(name)["decode"]:
        if row["batch"] == batch and row["context"] == context and row.get("kernels", "auto") == kernels:
            return row
    raise KeyError(f"{name}: no decode row for batch {batch}, context {context}, kernels {kernels}")


def prefill_row(name: str, tokens: int) -> dict:
    for row in load(name)["prefill"]:
        if row["prompt_tokens"] == tokens and row.get("kernels", "auto") == "auto":
            return row
    raise KeyError(f"{name}: no prefill row for {tokens} tokens")


def _save(plt, fig, path: str, title: str | None = None) -> None:
    """Every figure's ending: its title over the panels, the layout, the PNG, the figure closed."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decode(plt, path: str) -> None:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = [1, 8, 32, 64]
    for context, colour in ((4096, "tab:blue"), (65536, "tab:orange")):
        rows = [decode_row(DECODE[(b, context)], b, context) for b in batches]
        label = f"{context // 1024}K context"
        ax.plot(batches, [r["ms_per_step"] for r in rows], "o-", color=colour, label=f"measured, {label}")
        ax.plot(batches, [r["floor_ms"] for r in rows], "--", color=colour, alpha=0.6, label=f"memory floor, {label}")
        ax2.plot(batches, [r["tokens_per_s"] for r in rows], "o-", color=colour, label=label)
        for b, r in zip(batches, rows):
            ax2.annotate(f"{r['fraction_of_floor']:.0%}", (b, r["tokens_per_s"]), textcoords="offset points",
                         xytext=(9, -12 if context == 65536 else 4), fontsize=8, color=colour)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlim(0.7, 100)
        a.set_xticks(batches, [str(b) for b in batches])
        a.set_xlabel("batch (sequences decoded together)")
        a.grid(alpha=0.3)
    ax.set_ylabel("ms per decode step")
    ax.set_title("Decode step against batch")
    ax.legend(fontsize=8)
    ax2.set_ylim(0, 6800)
    ax2.set_ylabel("tokens / s (all sequences)")
    ax2.set_title("Throughput (labels: fraction of the floor)")
    ax2.legend(fontsize=8)
    _save(plt, fig, path, "DeepSeek-V4-Flash geometry, first 4 of 43 layers, random weights, one H200 "
                          "(2026-12-03 to 12-05)")


def plot_long_context(plt, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = {("bf16", 1): ("o-", "tab:blue"), ("bf16", 8): ("o-", "tab:orange"),
              ("fp8", 1): ("s--", "tab:blue"), ("fp8", 8): ("s--", "tab:orange")}
    for (kind, batch), (style, colour) in styles.items():
        contexts = sorted(c for (k, b, c) in LONG_CONTEXT if k == kind and b == batch)
        rows = [decode_row(LONG_CONTEXT[(kind, batch, c)], batch, c) for c in contexts]
        ax.plot(contexts, [r["ms_per_step"] for r in rows], style, color=colour,
                label=f"batch {batch}, {'bf16' if kind == 'bf16' else 'FP8'} caches")
        if kind == "fp8":          # the floor hardly moves with context: draw it once per batch
            ax.plot(contexts, [r["floor_ms"] for r in rows], ":", color=colour, alpha=0.7,
                    label=f"memory floor, batch {batch}")
    ax.set_xscale("log", base=2)
    ticks = [4096, 16384, 65536, 131072, 524288]
    ax.set_xticks(ticks, ["4K", "16K", "64K", "128K", "512K"])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens in each sequence's state)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("Decode against context: Flash geometry, 4 layers, one H200 (2026-12-02 to 12-05)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(0, 4.3)
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    _save(plt, fig, path)


def plot_prefill(plt, path: str) -> None:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    prompts = [1024, 8192, 32768]
    for chunk, colour in zip(TTFT, ("tab:gray", "tab:blue", "tab:green")):
        ttft = []
        for n in prompts:
            name = TTFT_512_32K if (chunk == 512 and n == 32768) else TTFT[chunk]
            ttft.append(prefill_row(name, n)["ttft_ms"])
        ax.plot(prompts, ttft, "o-", color=colour, label=f"{chunk}-token chunks" + (" (default)" if chunk == 2048
                                                                                      else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(prompts, ["1K", "8K", "32K"])
    ax.set_xlabel("prompt tokens (batch 1)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title("Time to first token against prompt")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)

    chunks = list(PREFILL_PROFILE)
    bottom = [0.0] * len(chunks)
    profiles = [load(PREFILL_PROFILE[c])["profile_prefill"] for c in chunks]
    for key, label in FAMILIES + [(None, "everything else")]:
        vals = []
        for chunk, prof in zip(chunks, profiles):
            fams = prof["by_family"]
            if key is None:
                ms = prof["kernel_ms_per_step"] - sum(fams.get(k, {"ms": 0.0})["ms"] for k, _ in FAMILIES)
            else:
                ms = fams.get(key, {"ms": 0.0})["ms"]
            vals.append(1000.0 * ms / chunk)
        ax2.bar([str(c) for c in chunks], vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xlabel("prefill chunk, tokens")
    ax2.set_ylabel("kernel time per prompt token, us")
    ax2.set_title("One prefill chunk by op family")
    ax2.legend(fontsize=7)
    _save(plt, fig, path, "DeepSeek-V4-Flash geometry, first 4 of 43 layers, random weights, one H200 (2026-12-03)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs"))
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for name, fn in (("perf_decode_batch.png", plot_decode), ("perf_long_context.png", plot_long_context),
                     ("perf_prefill.png", plot_prefill)):
        fn(plt, os.path.join(args.out_dir, name))
        print("wrote", os.path.join(args.out_dir, name))


if __name__ == "__main__":
    main()
