"""The layer statistics on the host: a table per layer, with the layers whose numbers look wrong flagged.

    logits, summary = model.forward(tokens, stats=True)        # device arrays (ops/layer_stats.py)
    rep = stats_report.report(summary, model.config)          # one jax.device_get
    print(rep.table()); rep.flags; rep.to_json()

`Model.generate(..., stats=True)` and `python -m dsv4_jax.generate --stats` give the same report. A summary covers one
or more calls (a forward, a prefill's chunks, a generation's decode steps): a value's mean is over the calls, its max
and min likewise, counts are summed.

A layer is flagged, with the sub-layer ("attention" or "moe") and the reason, when
- its streams hold NaN or inf after a sub-layer, or any of its measured sizes is not finite;
- the residual streams' RMS grows by more than JUMP_FACTOR across one sub-layer (the mean RMS after it against the
  mean before it: the layer's input for its attention, the streams after the attention for its MoE), or their
  max |x| (the max over calls) by more than PEAK_FACTOR. A healthy model's sub-layers change the RMS by a few
  tens of percent, up to ~5x where an early layer writes a "massive activation" for some tokens (its max |x|
  then grows ~20x: seen in the default model's layer 0); a scale read wrongly or a race multiplies them by orders
  of magnitude;
- a sub-layer's output RMS is zero (or under VANISHED times the RMS of the streams it adds to) in any call;
- more than SATURATED_SHARE of the activation block scales into its matmuls saturate (NVFP4: block amax / (6 x
  global scale) past e4m3's 448, as when a checkpoint's FP8-calibrated `input_scale` is used as the global scale),
  or more than UNDERFLOW_SHARE underflow (below e4m3's smallest subnormal, or FP8 blocks under the 1e-4 amax floor).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .config import ModelConfig
from .model import layer_kind
from .ops.layer_stats import COUNT_KEYS, VALUE_KEYS

JUMP_FACTOR = 16.0
PEAK_FACTOR = 1000.0
VANISHED = 1e-6
SATURATED_SHARE = 0.01
UNDERFLOW_SHARE = 0.01
SUBLAYERS = (("attn", "attention"), ("moe", "moe"))


@dataclasses.dataclass(frozen=True)
class Flag:
    layer: int
    sublayer: str          # "attention" or "moe"
    reason: str


@dataclasses.dataclass
class StatsReport:
    """Per layer (`layers`: one dict per layer, the summary's values aggregated, see `to_json`) and the flags."""
    calls: int
    tokens: int
    layers: list
    flags: list

    @property
    def flagged(self) -> set:
        """(layer, sublayer) pairs that carry a flag."""
        return {(f.layer, f.sublayer) for f in self.flags}

    def to_json(self) -> dict:
        return {"calls": self.calls, "tokens": self.tokens, "layers": self.layers,
                "flags": [dataclasses.asdict(f) for f in self.flags],
                "thresholds": {"jump_factor": JUMP_FACTOR, "peak_factor": PEAK_FACTOR, "vanished": VANISHED,
                               "saturated_share": SATURATED_SHARE,
                               "underflow_share": UNDERFLOW_SHARE}}

    def table(self) -> str:
        """The per-layer table: residual-stream RMS entering the layer, after its attention and after its MoE
        (means over calls), their max |x| (max over calls), the sub-layers' output RMS, the mHC mixing weights'
        range, router entropy, expert load max / mean, compressed entries per query, the shares of activation
        block scales that saturate / underflow, the NVFP4 global scales' range, and the flags."""
        by_layer: dict = {}
        for f in self.flags:
            by_layer.setdefault(f.layer, []).append(f"{f.sublayer}: {f.reason}")
        header = ("layer", "kind", "rms in", "attn", "moe", "max|x|", "out attn", "out moe", "mHC mix", "router H",
                  "load max/mean", "entries", "sat", "uflow", "global scale", "flags")
        rows = [header]
        for row in self.layers:
            v, hi, lo = row["mean"], row["max"], row["min"]
            blocks = row["attn_quant_blocks"] + row["moe_quant_blocks"]
            sat = (row["attn_quant_saturated"] + row["moe_quant_saturated"]) / blocks if blocks else None
            uflow = (row["attn_quant_underflow"] + row["moe_quant_underflow"]) / blocks if blocks else None
            scale_lo = min(lo["attn_scale_min"], lo["moe_scale_min"])
            scale_hi = max(hi["attn_scale_max"], hi["moe_scale_max"])
            rows.append((str(row["layer"]), row["kind"], _num(v["in_resid_rms"]), _num(v["attn_resid_rms"]),
                         _num(v["moe_resid_rms"]), _num(max(hi["attn_resid_max"], hi["moe_resid_max"])),
                         _num(v["attn_out_rms"]), _num(v["moe_out_rms"]),
                         f"{_num(lo['mix_min'])}..{_num(hi['mix_max'])}", _num(v["router_entropy"]),
                         _num(row["load_imbalance"]), _num(v["entries_attended"]),
                         "-" if sat is None else _pct(sat), "-" if uflow is None else _pct(uflow),
                         f"{scale_lo:.2e}..{scale_hi:.2e}" if np.isfinite(scale_lo) else "-",
                         "; ".join(by_layer.get(row["layer"], []))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        lines = [f"layer statistics over {self.calls} call{'s' if self.calls != 1 else ''}, {self.tokens} tokens"]
        for r in rows:
            cells = [r[i].ljust(widths[i]) if i < 2 else r[i].rjust(widths[i]) for i in range(len(widths))]
            lines.append(("  ".join(cells) + "  " + r[-1]).rstrip())
        if not self.flags:
            lines.append("no layer flagged")
        return "\n".join(lines)


def _num(x: float) -> str:
    if not np.isfinite(x):
        return str(x)
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 or x == 0 else f"{x:.1e}"


def _pct(share: float) -> str:
    return f"{100 * share:.2g}%"


def report(summary, cfg: ModelConfig) -> StatsReport:
    """The report of an ops/layer_stats.py summary (device arrays are read here, in one jax.device_get)."""
    s = jax.device_get(summary)
    calls = float(s["calls"])
    mean = {k: np.asarray(s["sum"][k], np.float64) / max(calls, 1.0) for k in VALUE_KEYS}
    rows, flags = [], []
    for layer in range(cfg.n_layers):
        row = {"layer": layer, "kind": layer_kind(cfg, layer),
               "mean": {k: float(mean[k][layer]) for k in VALUE_KEYS},
               "max": {k: float(s["max"][k][layer]) for k in VALUE_KEYS},
               "min": {k: float(s["min"][k][layer]) for k in VALUE_KEYS}}
        for k in COUNT_KEYS:
            count = np.asarray(s["count"][k][layer], np.float64)
            row[k] = count.tolist() if count.ndim else float(count)
        load = np.asarray(row["expert_load"])
        row["load_imbalance"] = float(load.max() / load.mean()) if load.sum() else 0.0
        for prefix, _ in SUBLAYERS:
            blocks = row[f"{prefix}_quant_blocks"]
            row[f"{prefix}_saturated_share"] = row[f"{prefix}_quant_saturated"] / blocks if blocks else 0.0
            row[f"{prefix}_underflow_share"] = row[f"{prefix}_quant_underflow"] / blocks if blocks else 0.0
        rows.append(row)
        if calls:
            flags += [Flag(layer, name, reason) for prefix, name in SUBLAYERS for reason in _reasons(row, prefix)]
    return StatsReport(int(calls), int(s["tokens"]), rows, flags)


def _reasons(row: dict, prefix: str) -> list:
    """Why sub-layer `prefix` ("attn" / "moe") of a layer's row looks wrong (empty: it does not)."""
    before = "in" if prefix == "attn" else "attn"
    mean, high, low = row["mean"], row["max"], row["min"]
    sizes = (mean[f"{prefix}_resid_rms"], high[f"{prefix}_resid_max"], mean[f"{prefix}_out_rms"])
    if row[f"{prefix}_nonfinite"] or not all(np.isfinite(v) for v in sizes):
        return [f"non-finite values ({int(row[f'{prefix}_nonfinite'])} stream elements NaN / inf)"]
    reasons = []
    grown = mean[f"{prefix}_resid_rms"] / max(mean[f"{before}_resid_rms"], 1e-30)
    peak = high[f"{prefix}_resid_max"] / max(high[f"{before}_resid_max"], 1e-30)
    if grown > JUMP_FACTOR or peak > PEAK_FACTOR:
        reasons.append(f"residual jump: RMS x{grown:.3g}, max |x| x{peak:.3g} across the sub-layer")
    if low[f"{prefix}_out_rms"] <= VANISHED * low[f"{before}_resid_rms"]:
        reasons.append(f"output vanished: RMS {low[f'{prefix}_out_rms']:.3g}")
    if row[f"{prefix}_saturated_share"] > SATURATED_SHARE:
        reasons.append(f"{_pct(row[f'{prefix}_saturated_share'])} of activation block scales saturate")
    if row[f"{prefix}_underflow_share"] > UNDERFLOW_SHARE:
        reasons.append(f"{_pct(row[f'{prefix}_underflow_share'])} of activation block scales underflow")
    return reasons
