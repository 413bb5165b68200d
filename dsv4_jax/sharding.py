"""Where every array lives on a device mesh: the mesh, and the rules from logical axes to mesh axes.

    mesh = dsv4_jax.make_mesh()                  # every local device on the "expert" axis
    model = dsv4_jax.load(path, mesh=mesh)       # weights and decode state placed by the rules below

Mesh axes:
    "data"    will split the batch (each group of devices along it serving its own rows); size 1 for now.
    "expert"  splits the routed experts: each device holds E / n experts of every stacked expert weight, computes
              the routed rows that chose them, and one psum over the axis sums the partial outputs per MoE layer
              (ops/moe_ffn.py). At 4 devices and more it also splits the attention heads and the shared expert
              (tensor parallel, below).

The rules (`rules(cfg, n)`) map the logical axes of the weight description (params.LOGICAL_AXES) to mesh axes:
    "experts"             always (expert parallel);
    "heads", "o_groups"   from TENSOR_PARALLEL_FROM devices, where they split evenly into FP8 blocks: each device
                          computes its heads' queries, attention, wo_a groups and wo_b inputs, and one more psum
                          per layer adds the attention outputs (layers/attention.py);
    "mlp"                 with them, where it splits evenly: the shared expert's partial output joins the MoE psum
                          (no collective of its own).
The indexer (its top-k needs every head's score), the compressors, wq_a / wkv (read by everything after them), the
embedding and the head stay replicated, and so does the decode state: DeepSeek-V4's single KV head is read by every
head. Why from 4 devices: at decode a collective costs ~10-25 us whatever its size, and the second all-reduce per
layer must buy more than it costs. By the bytes-read arithmetic (docs/sharding.md, benchmarks/sharding_arithmetic.py,
20 us per all-reduce assumed) splitting at 2 devices would make a Flash step slower (3.36 against 3.17 ms); from 4
it is faster (2.87 against 3.03 ms at 4, 2.56 against 2.88 at 8; Pro at 8, the first count it fits: 4.82 against
8.28 ms).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig
from .layer_scan import StackedLayers
from .params import LOGICAL_AXES, tree_get, tree_set, weight_specs

DATA, EXPERT = "data", "expert"
MESH_AXES = (DATA, EXPERT)
# logical axis (params.LOGICAL_AXES) -> mesh axis; a logical axis not listed is replicated
RULES = {"experts": EXPERT}
TENSOR_PARALLEL_FROM = 4       # devices on the "expert" axis from which attention heads and the shared expert split
SPLIT_BLOCK = 128              # a split must keep whole FP8 weight blocks (128 x 128) on each device
assert set(RULES) <= set(LOGICAL_AXES)


def splits_heads(cfg: ModelConfig, n: int) -> bool:
    """Whether `n` devices split the attention heads: from TENSOR_PARALLEL_FROM devices, when the heads, the output
    groups, wq_b's rows and wo_b's inputs all divide into n parts of whole FP8 blocks."""
    return (n >= TENSOR_PARALLEL_FROM and cfg.n_heads % n == 0 and cfg.o_groups % n == 0
            and cfg.n_heads * cfg.head_dim // n % SPLIT_BLOCK == 0
            and cfg.o_groups * cfg.o_lora_rank // n % SPLIT_BLOCK == 0)


def splits_shared_expert(cfg: ModelConfig, n: int) -> bool:
    """Whether `n` devices split the shared expert's hidden units (with the heads, into whole FP8 blocks)."""
    inter = cfg.moe_inter_dim            # the shared expert's hidden units (params.weight_specs)
    return splits_heads(cfg, n) and inter % n == 0 and inter // n % SPLIT_BLOCK == 0


def rules(cfg: ModelConfig, n: int) -> dict[str, str]:
    """The logical-axis -> mesh-axis rules of `cfg` on n devices along "expert" (module docstring)."""
    out = dict(RULES)
    if splits_heads(cfg, n):
        out.update(heads=EXPERT, o_groups=EXPERT)
    if splits_shared_expert(cfg, n):
        out["mlp"] = EXPERT
    return out


def split_along(tree, dim: int):
    """shard_map specs splitting every array of a weight (or a tree of them) along `dim` over "expert": its rows
    (dim 0) or inputs (dim 1); an array with no such dim (a scalar global scale) whole on every device."""
    return jax.tree.map(lambda a: P(*([None] * dim), EXPERT) if a.ndim > dim else P(), tree)


def expert_devices(mesh: Mesh | None) -> int:
    """Devices along the mesh's "expert" axis (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape[EXPERT]


def make_mesh(n_devices: int | None = None, data: int = 1, devices=None) -> Mesh:
    """A (data, expert) mesh over the first `n_devices` of `devices` (default: all local devices of the default
    backend), all along the experts (`data` > 1 is not implemented yet)."""
    devices = list(jax.local_devices() if devices is None else devices)
    n_devices = len(devices) if n_devices is None else n_devices
    if not isinstance(n_devices, int) or not 1 <= n_devices <= len(devices):
        raise ValueError(f"n_devices must be an integer in [1, {len(devices)}] (the devices there are), "
                         f"got {n_devices!r}")
    if not isinstance(data, int) or data < 1 or n_devices % data:
        raise ValueError(f"data must be a positive divisor of n_devices={n_devices}, got {data!r}")
    if data > 1:
        # With the batch split, XLA's partitioner gathers the decode state around the ring and cache scatters
        # (measured: 20 all-gathers and 16 collective-permutes in a 4-layer decode step): the per-row work needs
        # a shard_map over "data" first.
        raise NotImplementedError("a data axis > 1 (batch split across devices) is not implemented yet")
    grid = np.array(devices[:n_devices], dtype=object).reshape(data, n_devices // data)
    return Mesh(grid, MESH_AXES)


def check_mesh(cfg: ModelConfig, mesh: Mesh, max_batch: int | None = None) -> None:
    """One-line errors for a mesh this model cannot use."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"the mesh must have axes {MESH_AXES} (dsv4_jax.make_mesh), got {tuple(mesh.axis_names)}")
    experts = mesh.shape[EXPERT]
    if cfg.n_routed_experts % experts:
        raise ValueError(f"{cfg.n_routed_experts} routed experts do not split over {experts} devices of the "
                         f"'{EXPERT}' axis")
    if max_batch is not None and max_batch % mesh.shape[DATA]:
        raise ValueError(f"max_batch={max_batch} does not split over the {mesh.shape[DATA]} devices of the "
                         f"'{DATA}' axis")


def partition_spec(axes, ndim: int, axis_rules: dict | None = None) -> P:
    """The PartitionSpec of an array of `ndim` dims whose leading dims carry logical `axes` (a stack's per-matrix
    scalars carry the stack's leading axes only), under `axis_rules` (default RULES: only the experts split)."""
    axis_rules = RULES if axis_rules is None else axis_rules
    axes = tuple(axes or ())[:ndim]
    return P(*(axis_rules.get(a) for a in axes), *([None] * (ndim - len(axes))))


def param_shardings(cfg: ModelConfig, mesh: Mesh, params) -> dict:
    """NamedShardings in the layout of `params` (a parameter tree or its shapes, e.g. checkpoint.abstract_params),
    from each weight's logical axes: every stored array of a weight (FP8 bytes and scales, FP4 codes, block and
    global scales) follows the weight's axes over its own leading dims."""
    tree: dict = {}
    axis_rules = rules(cfg, mesh.shape[EXPERT])
    for spec in weight_specs(cfg):
        tree_set(tree, spec.name, jax.tree.map(
            lambda leaf, axes=spec.axes: NamedSharding(mesh, partition_spec(axes, leaf.ndim, axis_rules)),
            tree_get(params, spec.name)))
    return tree


def state_shardings(state, mesh: Mesh):
    """NamedShardings of a DecodeState (or its abstract shape): every buffer's batch dim on "data" (the leading
    one; in the stacked caches of a scanned model, the one after the layer axis)."""
    shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, P(DATA, *([None] * (leaf.ndim - 1)))), state)
    if isinstance(state.layers, StackedLayers):
        phases = jax.tree.map(lambda leaf: NamedSharding(mesh, P(None, DATA, *([None] * (leaf.ndim - 2)))),
                              state.layers.phases)
        shardings = shardings.replace(layers=shardings.layers.replace(phases=phases))
    return shardings


def expert_slice(index: tuple, n_experts: int) -> range:
    """The experts a device's shard of a stacked expert array holds, from its index (make_array_from_callback)."""
    first = index[0] if index else slice(None)
    return range(*first.indices(n_experts))
