"""dsv4_jax: DeepSeek-V4 (Flash / Pro) inference in JAX.

    model = dsv4_jax.load(path)                                   # official checkpoint directory
    model = dsv4_jax.load()                                       # the small packaged default model
    model = dsv4_jax.init_random(dsv4_jax.presets.tiny(), seed=0) # random weights, same object
    logits = model.forward(tokens)                                # [B, S] -> float32 [B, S, V]
"""

from __future__ import annotations

import os

import jax

from . import compile_cache, presets  # noqa: F401
from .api import GenerationResult, Model  # noqa: F401
from .checkpoint import CheckpointError, load_params
from .config import ModelConfig, from_hf_config, load_hf_config  # noqa: F401
from .settings import Settings  # noqa: F401
from .module import DeepseekV4  # noqa: F401
from .memory_plan import memory_plan  # noqa: F401
from .layer_scan import scan_plan
from .orbax_checkpoint import is_orbax_checkpoint, restore
from .orbax_checkpoint import save as save_module
from .params import init_params
from .sharding import check_mesh, make_mesh, param_shardings  # noqa: F401


compile_cache.enable()        # on by default (DSV4_JAX_CACHE=off turns it off); a user's own JAX setting wins

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def init_random(config: ModelConfig, seed: int = 0, mesh=None, settings: Settings | None = None, tokenizer=None,
                **options) -> Model:
    """A model with random weights in the stored formats (an NVFP4 head with the option `quantize_head`), generated
    on the device (on a `mesh`: each device generates its own shards, no host copy); options as for `load`;
    `tokenizer` (a Tokenizer or a tokenizer.json path) becomes `model.tokenizer`."""
    settings = Settings.of(settings, **options)
    stored = {"head.weight": "nvfp4"} if settings.quantize_head else None
    key = jax.random.PRNGKey(seed)
    shardings = None
    if mesh is not None:
        check_mesh(config, mesh)
        shardings = param_shardings(config, mesh, jax.eval_shape(lambda: init_params(config, key, stored)))
    # A scanned model's layers are generated stacked (no per-layer copy to stack afterwards); on a mesh, Model
    # places the per-layer weights and stacks them.
    plan = scan_plan(config) if settings.scan_layers and mesh is None else None
    params = init_params(config, key, stored, shardings, scan_plan=plan)
    return Model(config, params, settings, mesh=mesh, consume_params=True, tokenizer=tokenizer)


def save(model, directory: str) -> None:
    """Save a Model's (or a DeepseekV4 module's) weights, every stored format bit for bit, as an Orbax checkpoint
    directory that `load` reads back."""
    save_module(getattr(model, "module", model), directory)


def load(path=None, *, mesh=None, progress=None, settings: Settings | None = None, **options) -> Model:
    """Load an official DeepSeek-V4 checkpoint directory (config.json + safetensors), weights kept as stored
    (MXFP4 or NVFP4 routed experts), or a directory written by `save` (Orbax); without `path`, the small model
    packaged in dsv4_jax/default_model (DEFAULT_MODEL_DIR). A `tokenizer.json` in the directory becomes
    `model.tokenizer` (dsv4_jax.tokenizer.Tokenizer, read on first use; None without one). The options (dtype,
    max_seq_len, max_batch, kernels, kv_cache_dtype, ...: settings.Settings lists and checks them, before any
    weight is read) may come as keywords, as `settings`, or both. `quantize_head=True` quantizes the bf16 lm_head
    to NVFP4 once at load (standard recipe, on device) and frees the bf16 copy; the router gate is never
    quantized. `kernels` is planned once, here, for `target` (default: JAX's default device). `mesh` (make_mesh):
    each tensor goes from its memory map straight to the devices that hold its shards (sharding.rules: the routed
    experts split on the "expert" axis, from 4 devices the attention heads and the shared expert too, the rest
    replicated). `progress(bytes)` is called as the weights are read."""
    settings = Settings.of(settings, **options)
    quantize_head = settings.quantize_head
    path = DEFAULT_MODEL_DIR if path is None else os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (expected an official DeepSeek-V4 checkpoint)")
    if is_orbax_checkpoint(path):
        if quantize_head:
            raise ValueError(f"{path}: quantize_head applies to official checkpoints; this one was saved with its "
                             f"head as it is")
        cfg, module = restore(path)           # on the default device; Model places it on a mesh
        params = module.params()
    else:
        cfg, params = load_params(path, progress=progress, quantize_head=quantize_head, mesh=mesh)
    tokenizer_file = os.path.join(path, "tokenizer.json")
    tokenizer = tokenizer_file if os.path.isfile(tokenizer_file) else None      # read on first use
    return Model(cfg, params, settings, mesh=mesh, tokenizer=tokenizer, consume_params=True)
