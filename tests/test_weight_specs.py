"""The weight description's logical axes: declared beside each shape, of its rank, naming known axes, and such
that splitting Flash and Pro over 2, 4 or 8 devices cuts every split weight into equal whole pieces (whole
128 x 128 blocks for FP8 weights, whole experts)."""

from __future__ import annotations

import pytest

from dsv4_jax import presets
from dsv4_jax.params import LOGICAL_AXES, WeightSpec, weight_specs
from dsv4_jax.numerics.formats import FP8_BLOCK


def _by_name(cfg):
    return {spec.name: spec for spec in weight_specs(cfg)}


def test_axes_are_declared_for_every_weight():
    for spec in weight_specs(presets.tiny()):
        assert len(spec.axes) == len(spec.shape), spec.name
        assert set(spec.axes) <= set(LOGICAL_AXES) | {None}, spec.name
    with pytest.raises(ValueError, match=r"x: axes \('rows',\) must name one of"):
        WeightSpec("x", (4,), "f32", axes=("rows",))
    with pytest.raises(ValueError, match="for each of its 2 dims"):
        WeightSpec("y", (4, 4), "f32", axes=("heads",))


def test_axes_follow_the_layout_peers_shard():
    specs = _by_name(presets.flash())
    assert specs["layers.3.ffn.experts.w1.weight"].axes == ("experts", None, None)
    assert specs["layers.3.ffn.experts.w2.weight"].axes == ("experts", None, None)
    assert specs["layers.3.attn.wq_b.weight"].axes == ("heads", None)
    assert specs["layers.3.attn.attn_sink"].axes == ("heads",)
    assert specs["layers.3.attn.wo_a.weight"].axes == ("o_groups", None)
    assert specs["layers.3.attn.wo_b.weight"].axes == (None, "o_groups")          # row-parallel: its inputs
    assert specs["layers.3.ffn.shared_experts.w2.weight"].axes == (None, "mlp")
    assert specs["layers.3.attn.wq_a.weight"].axes == (None, None)               # replicated, read by every head
    assert specs["layers.3.ffn.gate.weight"].axes == (None, None)                # every expert's score everywhere
    assert specs["embed.weight"].axes == ("vocab", None)


@pytest.mark.parametrize("preset", [presets.flash, presets.pro])
@pytest.mark.parametrize("devices", [2, 4, 8])
def test_split_weights_cut_into_whole_blocks(preset, devices):
    for spec in weight_specs(preset()):
        for dim, axis in zip(spec.shape, spec.axes):
            if axis is None:
                continue
            assert dim % devices == 0, f"{spec.name}: {axis} dim {dim} does not split over {devices} devices"
            if spec.fmt == "fp8":
                assert (dim // devices) % FP8_BLOCK == 0, \
                    f"{spec.name}: a 1/{devices} share of {dim} cuts its {FP8_BLOCK}-wide scale blocks"
