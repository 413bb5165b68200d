"""Compare the model with the float64 reference where a rounding tie cannot decide the outcome.

The model's fake-quant roundings (FP8 e4m3, FP4 e2m1) and its top-k selections (indexer, router) are
discontinuous: a float32 value within an ulp of a rounding boundary or of a tie rounds one way on one CPU and the
other way on another (XLA:CPU's float32 code differs by instruction set), and one flipped element moves the
logits after it by far more than float32 noise. So a whole-model comparison is made in two steps that no such
flip can break:

1. `DecisionRecorder` compiles a model program (once; `run_recording_decisions` for a single call) that also
   returns the value that reached each decision site and what the model decided there (the rounded values, the
   selected entries); `join_chunks` lays the records of prefill chunks and decode steps out as one forward's.
2. `ModelDecisions` is handed to the reference (`tests/reference_np.py`'s `decisions` argument). At each site it
   checks, strictly, that
   - the model's value before the site equals the reference's float64 value within float32 noise (the model
     computed the right thing up to there),
   - the model's rounding of its own value is exactly the spec's rounding of that value (bit-exact), and
   - where the model selected other entries than the reference would, those entries are tied with the k-th best
     within float32 noise,
   and then lets the reference continue from the model's decision. Everything else the reference computes in
   float64 as before, so the final logits can be compared tightly.
3. With activation quantization (act_quant), each quantized linear's input rounding is a decision too: it is
   recorded under the weight's official name ('layers.3.attn.wo_b.weight'; routed experts under their stack,
   'layers.3.ffn.experts.w1.weight', whose rows each expert's share of the reference takes) and checked the same
   way by `ModelDecisions.activation`.

Sites are named as in the reference ('layers.1.attn.kv', 'mtp.0.ffn.gate', ...); the model's calls are matched to
them by order: the program traces its layers in order, and each layer calls each site function at most once.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import numpy as np
import pytest

import reference_np as R
from dsv4_jax.numerics import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from dsv4_jax.ops.matmul import activation_quantizer

# (module, function) of the model -> site of the reference (after the layer prefix). Each is called at most once
# per layer: attention's FP8 rounding is the window KV, its FP4 rounding the indexer query; the compressor's FP8
# rounding is the main compressor, its FP4 rounding the indexer's.
SITE_FUNCTIONS = {
    ("dsv4_jax.ops.norm_rope", "fp8_fake_quant"): "attn.kv",
    ("dsv4_jax.ops.norm_rope", "fp4_fake_quant"): "attn.indexer.q",
    ("dsv4_jax.ops.compressor_step", "fp8_fake_quant"): "attn.compressor",
    ("dsv4_jax.ops.compressor_step", "fp4_fake_quant"): "attn.indexer.compressor",
    ("dsv4_jax.ops.indexer", "indexer_select"): "attn.indexer",
    ("dsv4_jax.ops.moe_ffn", "route"): "ffn.gate",
}

# Float32 noise allowed between the model's and the reference's values at a site, relative to the size of the
# values there (the quantization block's largest |value|, or the row's largest |score|). Measured on the tiny
# model with shared decisions: up to 2.4e-6 (XLA_FLAGS=--xla_cpu_max_isa=AVX2 and SSE4_2 alike), 1.1e-5 with every
# float32 weight nudged by 128 ulps (test_model); a wrong computation is off by O(1e-2) or more.
NOISE = 1e-4


def layer_sites(cfg, prefix: str, layer_id: int, parts=("attn", "ffn")) -> list[str]:
    """The decision sites one block of the model visits with simulate_quant on, limited to those under `parts`
    (('attn',): its attention only; ('attn.indexer',): the indexer and its compressor)."""
    ratio = cfg.compress_ratios[layer_id]
    sites = ["attn.kv", "ffn.gate"]
    if ratio > 0:
        sites.append("attn.compressor")
    if ratio == 4:
        sites += ["attn.indexer", "attn.indexer.q", "attn.indexer.compressor"]
    return [prefix + s for s in sites if any(s == part or s.startswith(part + ".") for part in parts)]


def model_layers(cfg, mtp: bool = False) -> list[tuple[str, int]]:
    """(site prefix, layer id) of the blocks a forward runs, in order; `mtp` adds the MTP block."""
    layers = [(f"layers.{i}.", i) for i in range(cfg.n_layers)]
    return layers + ([("mtp.0.", cfg.n_layers)] if mtp else [])


ACTIVATION = "activation of "   # marks a recorded activation quantization (then the weight's name)


def official_name(path) -> str:
    """The checkpoint name of a parameter tree path: ['layers'][3]['attn']['wo_b']['weight'] ->
    'layers.3.attn.wo_b.weight'."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


class DecisionRecorder:
    """`fn(*args, **static)` (a model function, not yet jitted; simulate_quant on) compiled once into a program that
    also returns what reached each decision site and what the model decided there. `layers`: (prefix, layer id) of
    the blocks `fn` runs, in order (`model_layers`); `parts`: which parts of each block it runs. Calling it
    returns (fn's result, {site: (value, decision)} as numpy); later calls reuse the program (same shapes)."""

    def __init__(self, cfg, layers, fn, /, parts=("attn", "ffn"), **static):
        self.cfg, self.layers, self.parts, self.fn, self.static = cfg, layers, parts, fn, static
        self.compiled, self.suffixes = None, None

    def _compile(self, args):
        calls = []   # (site suffix, first array argument, result) in trace order

        def recording(function, suffix):
            def wrapper(*a, **kw):
                out = function(*a, **kw)
                calls.append((suffix, next(x for x in a if isinstance(x, jax.Array)), out))
                return out
            return wrapper

        weight_names = {}   # id of a weight in the traced params -> its official name

        def recording_activation(function):
            def wrapper(x, weight, ctx, *a):
                out = function(x, weight, ctx, *a)
                if activation_quantizer(weight, ctx.act_quant) != "none":
                    calls.append((ACTIVATION + weight_names[id(weight)], x, out))
                return out
            return wrapper

        def program(*a):
            calls.clear()
            weight_names.clear()
            is_weight = lambda v: isinstance(v, (Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight))  # noqa: E731
            for path, leaf in jax.tree_util.tree_leaves_with_path(a[0], is_leaf=is_weight):
                weight_names[id(leaf)] = official_name(path)
            result = self.fn(*a, **self.static)
            return result, [(value, out) for _, value, out in calls]

        with pytest.MonkeyPatch.context() as patch:      # only while tracing: the compiled program keeps them
            for (module, name), suffix in SITE_FUNCTIONS.items():
                module = importlib.import_module(module)
                patch.setattr(module, name, recording(getattr(module, name), suffix))
            linear_module = importlib.import_module("dsv4_jax.ops.matmul")
            patch.setattr(linear_module, "_quantize_input", recording_activation(linear_module._quantize_input))
            self.compiled = jax.jit(program).lower(*args).compile()
        self.suffixes = [suffix for suffix, _, _ in calls]

    def __call__(self, *args):
        if self.compiled is None:
            self._compile(args)
        result, recorded = self.compiled(*args)
        found, records = {}, {}
        for suffix, record in zip(self.suffixes, recorded):
            record = jax.tree.map(np.asarray, record)
            if suffix.startswith(ACTIVATION):
                name = suffix[len(ACTIVATION):]
                assert name not in records, f"the input of {name} was quantized twice"
                records[name] = record
            else:
                found.setdefault(suffix, []).append(record)
        for suffix in SITE_FUNCTIONS.values():
            prefixes = [p for p, layer in self.layers if p + suffix in layer_sites(self.cfg, p, layer, self.parts)]
            got = found.get(suffix, [])
            assert len(got) == len(prefixes), (f"the program visited site {suffix} {len(got)} times, the layers "
                                               f"{[p for p, _ in self.layers]} have it {len(prefixes)} times")
            records.update({p + suffix: r for p, r in zip(prefixes, got)})
        return result, records


def run_recording_decisions(cfg, layers, fn, /, *args, **static):
    """One call of a `DecisionRecorder`."""
    return DecisionRecorder(cfg, layers, fn, **static)(*args)


def join_chunks(chunks: list[tuple[int, int, dict]], ratios: dict[str, int]) -> dict:
    """The records of one sequence fed in chunks (prefill chunks, decode steps), laid out as one teacher-forced
    forward over the whole sequence would record them. `chunks`: (start position, tokens, records) in order, batch
    1; `ratios`: the compression ratio of each site prefix. Per-token sites are concatenated along the sequence;
    a compressor site keeps the entries completed in each chunk (its first rows: entry start // c onwards)."""
    joined = {}
    for site in chunks[0][2]:
        prefix = site[:site.index("attn.") if "attn." in site else site.index("ffn.")]
        parts = []
        for start, n, records in chunks:
            value, out = records[site]
            if site.endswith("compressor"):
                c = ratios[prefix]
                done = (start + n) // c - start // c
                parts.append(jax.tree.map(lambda a: a[:, :done], (value, out)))
            elif site.endswith("ffn.gate"):          # [T, ...] rows of the flattened batch-1 chunk
                parts.append(jax.tree.map(lambda a: a[:n], (value, out)))
            else:
                parts.append(jax.tree.map(lambda a: a[:, :n], (value, out)))
        axis = 0 if site.endswith("ffn.gate") else 1
        joined[site] = jax.tree.map(lambda *a: np.concatenate(a, axis=axis), *parts)
    return joined


@dataclasses.dataclass
class SiteStats:
    elements: int = 0          # values rounded (fake quant) or rows selected (top-k)
    taken: int = 0             # where the model decided otherwise than the reference would have, within noise
    worst_noise: float = 0.0   # largest |model - reference| before the site, relative to the site's scale


class ModelDecisions(R.SpecDecisions):
    """Decisions for the reference taken from the model's `records` (run_recording_decisions), each checked to be
    one the spec allows at the reference's own float64 value up to float32 noise. `stats` counts, per site, how
    often the model's decision differed from the reference's own (a rounding tie decided by float32 noise)."""

    def __init__(self, records: dict, noise: float = NOISE):
        self.records = records
        self.noise = noise
        self.stats: dict[str, SiteStats] = {}

    def _record(self, site):
        assert site in self.records, f"the model recorded no decision for site {site} (it has {sorted(self.records)})"
        return self.records[site]

    def _round(self, site, x, block, spec_round):
        value, output = self._record(site)
        x_model, q_model = value.astype(np.float64), np.asarray(output, np.float64)
        # compressor sites also round the windows not yet complete (rows beyond the reference's entries)
        n = x.shape[-2]
        x_model, q_model = x_model[..., :n, :], q_model[..., :n, :]
        assert x_model.shape == x.shape, f"{site}: model rounds shape {x_model.shape}, reference {x.shape}"
        scale = np.abs(x.reshape(x.shape[:-1] + (-1, block))).max(-1, keepdims=True)
        scale = np.broadcast_to(scale, x.shape[:-1] + (x.shape[-1] // block, block)).reshape(x.shape)
        noise = np.abs(x_model - x) / np.maximum(scale, 1e-30)
        assert noise.max() <= self.noise, (
            f"{site}: the model's value before rounding differs from the reference by {noise.max():.3g} x the block's "
            f"largest |value| (allowed {self.noise:g}); {np.sum(noise > self.noise)} of {x.size} elements")
        spec_of_model = spec_round(x_model)
        wrong = q_model != spec_of_model
        assert not wrong.any(), (
            f"{site}: the model's rounding of its own values differs from the spec's in {wrong.sum()} of {x.size} "
            f"elements (e.g. {x_model[wrong][0]!r} -> {q_model[wrong][0]!r}, spec {spec_of_model[wrong][0]!r})")
        own = spec_round(x)
        self.stats[site] = SiteStats(x.size, int(np.sum(own != q_model)), float(noise.max()))
        return q_model

    def fp8(self, site, x):
        return self._round(site, x, 64, lambda v: R.fp8_fake_quant(v, 64))

    def fp4(self, site, x):
        return self._round(site, x, 32, lambda v: R.fp4_fake_quant(v, 32))

    def top_k(self, site, scores, k):
        own = super().top_k(site, scores, k)
        _, output = self._record(site)
        picked = model_selection(site, output, scores.shape)
        finite = np.isfinite(scores)
        assert not (picked & ~finite).any(), f"{site}: the model selected an entry the spec does not allow (-inf)"
        assert np.array_equal(picked.sum(-1), own.sum(-1)), (
            f"{site}: the model selected {picked.sum(-1).ravel()[:8]}... entries per row, the spec "
            f"{own.sum(-1).ravel()[:8]}...")
        differ = np.nonzero((picked != own).any(-1))
        worst = 0.0
        for row in zip(*differ):
            s, mine, theirs = scores[row], own[row], picked[row]
            kth = np.min(s[mine])
            scale = np.max(np.abs(s[finite[row]]))
            gap = np.max(np.abs(s[mine ^ theirs] - kth)) / scale
            worst = max(worst, gap)
            assert gap <= self.noise, (
                f"{site} row {row}: the model selected {np.nonzero(theirs)[0].tolist()}, the spec "
                f"{np.nonzero(mine)[0].tolist()}, and the differing entries are not tied with the k-th best score "
                f"(|score - kth| = {gap:.3g} x the row's largest |score|, allowed {self.noise:g})")
        self.stats[site] = SiteStats(int(np.prod(scores.shape[:-1])), len(differ[0]), worst)
        return picked

    def activation(self, name: str, x: np.ndarray, spec_quantize) -> tuple[np.ndarray, np.ndarray]:
        """The model's quantization of the input of weight `name` (official name; a routed expert
        'layers.L.ffn.experts.E.w1.weight' takes its rows of the stack's record, in token order, as the grouped
        matmul sorts them), checked like a rounding site: the model's input equals x within float32 noise of the
        row's largest |value|, and its quantization of its own input is exactly `spec_quantize` of it (values and
        per-row factor). Returns (values, per-row factor)."""
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            expert = int(parts[at + 1])
            stack = ".".join(parts[:at + 1] + parts[at + 2:])
            value, (values, row) = self._record(stack)
            _, (expert_ids, _) = self._record(".".join(parts[:at - 1]) + ".ffn.gate")
            counts = np.bincount(expert_ids.ravel(), minlength=expert + 1)
            rows = slice(int(counts[:expert].sum()), int(counts[:expert + 1].sum()))
            value, values = value[rows], values[rows]
            row = None if row is None else row[rows]
        else:
            value, (values, row) = self._record(name)
        value = value.astype(np.float64).reshape(x.shape)
        values = np.asarray(values, np.float64).reshape(x.shape)
        row = np.ones(x.shape[:-1] + (1,)) if row is None else np.asarray(row, np.float64).reshape(x.shape[:-1] + (1,))
        scale = np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30)
        noise = np.abs(value - x) / scale
        assert noise.max() <= self.noise, (
            f"input of {name}: the model's value differs from the reference by {noise.max():.3g} x the row's largest "
            f"|value| (allowed {self.noise:g})")
        spec_values, spec_row = spec_quantize(value.astype(np.float32))
        wrong = (values != spec_values).sum() + (row != spec_row).sum()
        assert not wrong, (f"input of {name}: the model's activation quantization of its own values differs from "
                           f"the spec's in {wrong} values / row factors")
        own_values, _ = spec_quantize(x)
        self.stats[name] = SiteStats(x.size, int(np.sum(own_values != values)), float(noise.max()))
        return values, row

    def summary(self) -> str:
        taken = {s: st.taken for s, st in self.stats.items() if st.taken}
        worst = max((st.worst_noise for st in self.stats.values()), default=0.0)
        return (f"{len(self.stats)} decision sites, the model's differing decisions taken at {taken or 'none'}; "
                f"largest pre-decision difference {worst:.2g} (allowed {self.noise:g})")


def model_selection(site: str, output, shape) -> np.ndarray:
    """The model's top-k picks as a bool mask of the reference's scores' shape [..., N]."""
    mask = np.zeros((int(np.prod(shape[:-1])), shape[-1]), bool)
    if site.endswith("attn.indexer"):
        idx, valid = output                                       # [B, S, k] each
        idx, valid = idx.reshape(mask.shape[0], -1), valid.reshape(mask.shape[0], -1)
        assert np.all(idx[valid] < shape[-1]), f"{site}: the model selected a compressed entry beyond the sequence"
        rows = np.broadcast_to(np.arange(mask.shape[0])[:, None], idx.shape)
        mask[rows[valid], idx[valid]] = True
    else:
        expert_ids, _ = output                                    # [T, K]
        np.put_along_axis(mask, expert_ids.reshape(mask.shape[0], -1).astype(np.int64), True, axis=-1)
    return mask.reshape(shape)
