"""The options of a Model, listed and validated once: `load`, `init_random`, `Model`, the command line, the server
and the benchmark all build a `Settings`, and the run context (run_context.RunContext: what changes a compiled
program) is made from it.

    settings = Settings(dtype="float32", max_seq_len=8192, kv_cache_dtype="fp8")   # a bad value: one-line error
    model = dsv4_jax.load(path, **options)          # the same names as keywords; Settings(**options) checks them
"""

from __future__ import annotations

import dataclasses

from .engine import PREFILL_CHUNK
from .numerics.kv_cache import check_kv_cache_dtype
from .ops.plan import KernelPlan, check_kernel_mode, parse_overrides
from .run_context import RunContext, check_numerics


@dataclasses.dataclass(frozen=True)
class Settings:
    """dtype: activations ("bfloat16" | "float32"); simulate_quant: the model's trained fake-quant roundings;
    act_quant: "none" | "fp8" | "nvfp4" (ops/matmul.py); kernels: "auto" | "reference" | "pallas" | "interpret" or a
    KernelPlan, planned for `target` (a jax Device or AbstractDevice; default the mesh's first device, else JAX's
    default device); kernel_overrides: per-op overrides of the plan ({"attention_core": "kernel"} or
    "op=choice" strings, ops/choice.py); max_seq_len and max_batch: the decode state's capacity; prefill_chunk:
    prompt tokens per prefill program; track_mtp: keep the MTP block's window current in every step (for drafts);
    scan_layers: run the repeated layer pattern under lax.scan; kv_cache_dtype: None (entries in `dtype`) or
    "fp8" (compact entries, numerics/kv_cache.py); quantize_head: quantize a bf16 head to NVFP4 when the weights
    are loaded or made (load, init_random); prefix_cache: bytes of decode-state snapshots Model.generate keeps to
    continue later prompts from (prefix_cache.py; 0: off); allow_long_context: let max_seq_len exceed the checkpoint's
    max_position_embeddings (`check_context`)."""
    dtype: str = "bfloat16"
    simulate_quant: bool = True
    act_quant: str = "none"
    kernels: str | KernelPlan = "auto"
    kernel_overrides: tuple = ()
    target: object = None
    max_seq_len: int = 4096
    max_batch: int = 1
    prefill_chunk: int = PREFILL_CHUNK
    track_mtp: bool = False
    scan_layers: bool = False
    kv_cache_dtype: str | None = None
    quantize_head: bool = False
    prefix_cache: int = 0
    allow_long_context: bool = False

    def __post_init__(self):
        check_numerics(self.dtype, self.act_quant)
        if not isinstance(self.kernels, KernelPlan):
            check_kernel_mode(self.kernels)
        for name in ("max_seq_len", "max_batch", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("simulate_quant", "track_mtp", "scan_layers", "quantize_head", "allow_long_context"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.prefix_cache, int) or isinstance(self.prefix_cache, bool) or self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be a number of bytes >= 0 (0: off), got {self.prefix_cache!r}")
        object.__setattr__(self, "kernel_overrides", parse_overrides(self.kernel_overrides or None))

    @classmethod
    def of(cls, settings: Settings | None = None, **options) -> Settings:
        """`settings` (default: the defaults) with `options` in place of its values; an unknown option is an
        error that names it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (options: "
                            f"{', '.join(sorted(names))})")
        return dataclasses.replace(settings or cls(), **options)

    def check_context(self, cfg) -> None:
        """The one rule for max_seq_len (Model applies it, so load, init_random and the command lines all do): at most
        the checkpoint's max_position_embeddings, the positions it was trained for, unless allow_long_context (the
        state and RoPE take any position, e.g. to measure a long context's cost; what the model says past its
        trained length is not known). A one-line error names the way out."""
        if self.max_seq_len > cfg.max_position_embeddings and not self.allow_long_context:
            raise ValueError(f"max_seq_len={self.max_seq_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings} (the positions it was trained for); "
                             f"allow_long_context=True (--allow-long-context) runs past them")

    def run_context(self, mesh=None) -> RunContext:
        """The run context these settings make (the kernel plan resolved now, for `target` or the mesh)."""
        return RunContext.create(self.dtype, self.simulate_quant, self.act_quant, self.kernels, device=self.target,
                                 mesh=mesh, kernel_overrides=self.kernel_overrides or None)
