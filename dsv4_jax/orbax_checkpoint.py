"""Saving and restoring the module's state with Orbax, every stored format bit for bit.

A directory written by `save` holds `config.json` (the official config, so the directory describes its model like
an official checkpoint does), `dsv4_jax_formats.json` (the stored formats that differ from the description's
defaults: NVFP4 expert stacks, an NVFP4 head) and `state/`, Orbax's checkpoint of `nnx.state(module)`. `restore`
builds the abstract module from those two files (nothing allocated), then lets Orbax read each array into it.
`dsv4_jax.load` accepts such a directory as well as an official safetensors one.
"""

from __future__ import annotations

import json
import os

from flax import nnx

from .config import ModelConfig, load_hf_config, to_hf_config
from .module import DeepseekV4, stored_formats_of

FORMATS_FILE = "dsv4_jax_formats.json"
STATE_DIR = "state"


def is_orbax_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, FORMATS_FILE)) and os.path.isdir(os.path.join(directory, STATE_DIR))


def save(module: DeepseekV4, directory: str) -> None:
    """Write the module's config, stored formats and state to `directory` (which must not exist yet)."""
    import orbax.checkpoint as ocp
    directory = os.path.abspath(directory)
    if os.path.exists(directory):
        raise FileExistsError(f"{directory}: already exists (save writes a new directory)")
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(to_hf_config(module.config), f, indent=2)
    with open(os.path.join(directory, FORMATS_FILE), "w") as f:
        json.dump(stored_formats_of(module), f, indent=2, sort_keys=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, STATE_DIR), nnx.state(module))
    checkpointer.wait_until_finished()


def restore(directory: str) -> tuple[ModelConfig, DeepseekV4]:
    """(config, the module) of a directory written by `save`."""
    import orbax.checkpoint as ocp
    directory = os.path.abspath(directory)
    cfg = load_hf_config(directory)
    with open(os.path.join(directory, FORMATS_FILE)) as f:
        stored = json.load(f)
    abstract = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), stored=stored))
    graphdef, abstract_state = nnx.split(abstract)
    state = ocp.StandardCheckpointer().restore(os.path.join(directory, STATE_DIR), abstract_state)
    return cfg, nnx.merge(graphdef, state)
