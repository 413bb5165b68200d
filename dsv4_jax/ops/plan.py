"""The kernel plan: which kernel backend a compiled program uses, decided once for the device it will run on.

    plan = plan_kernels("auto")                    # JAX's default device; builds the ffi/ kernels on a CUDA GPU
    plan = plan_kernels("pallas", device=h200)     # a jax Device or jax.sharding.AbstractDevice to compile for

A plan is a frozen, hashable value: it travels inside the run context (dsv4_jax/run_context.py) as a static
argument of every jitted program, so tracing never probes the devices and never builds a library. Which call takes
which kernel under a plan: ops/choice.py, and for the matmuls ops/matmul_kernels.py.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax

from .. import ffi
from ..ffi.build import device_arch
from .choice import OPS, OVERRIDES

KERNEL_MODES = ("auto", "reference", "pallas", "interpret")
BACKENDS = (None, "cuda", "pallas", "interpret")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """mode: what was asked ("auto", "reference", "pallas", "interpret"); backend: what runs, None (the pure-jnp
    reference everywhere), "cuda" (the dsv4_jax/ffi/ CUDA GEMVs where they apply when `ffi`, the Pallas kernels for the
    rest), "pallas" (the Pallas kernels only) or "interpret" (the Pallas kernels in interpret mode); ffi: the ffi/
    kernels are built and registered in this process; target: the device kind planned for; overrides: (op, "kernel"
    or "reference") pairs, sorted, that change an op's choice (ops/choice.py): "kernel" switches an opt-in kernel
    on (the decode attention kernel on GPUs: ("attention_core", "kernel")), "reference" keeps the op off its
    kernels. Being part of the plan they are part of every program's jit cache key."""
    mode: str
    backend: str | None
    ffi: bool = False
    target: str = ""
    overrides: tuple = ()

    def __post_init__(self):
        check_kernel_mode(self.mode)
        if self.backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.ffi and self.backend != "cuda":
            raise ValueError(f"the dsv4_jax/ffi/ kernels run only on the 'cuda' backend, not {self.backend!r}")
        if self.overrides != parse_overrides(self.overrides):
            raise ValueError(f"KernelPlan.overrides must be sorted (op, choice) pairs (parse_overrides), got "
                             f"{self.overrides!r}")

    def override(self, op: str) -> str | None:
        """What the plan's overrides say of `op`: "kernel", "reference" or None (the default choice)."""
        return dict(self.overrides).get(op)

    def with_overrides(self, overrides) -> KernelPlan:
        """This plan with `overrides` (parse_overrides' forms) in place of its own."""
        return dataclasses.replace(self, overrides=parse_overrides(overrides))

    @property
    def on_gpu(self) -> bool:
        """Whether the programs run on a GPU (a GPU kernel backend; "interpret" emulates the kernels on a CPU)."""
        return self.backend in ("cuda", "pallas")

    @property
    def interpret(self) -> bool:
        """Whether the Pallas kernels run in interpret mode (the "interpret" plan: the kernels on a CPU)."""
        return self.backend == "interpret"


def check_kernel_mode(mode) -> None:
    """A one-line error unless `mode` is one of KERNEL_MODES (KernelPlan, plan_kernels and settings.Settings ask
    it)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")


def parse_overrides(overrides) -> tuple:
    """Per-op overrides as sorted (op, choice) pairs, from a dict, pairs, or "op=choice" strings (the command
    lines' form); an unknown op or choice is an error."""
    if overrides is None:
        return ()
    items = overrides.items() if isinstance(overrides, dict) else overrides
    pairs = {}
    for item in items:
        op, sep, value = item.partition("=") if isinstance(item, str) else (item[0], "=", item[1])
        if not sep or op not in OPS or value not in OVERRIDES:
            raise ValueError(f"kernel override {item!r}: expected OP=CHOICE with OP one of {', '.join(OPS)} and "
                             f"CHOICE one of {', '.join(OVERRIDES)}")
        pairs[op] = value
    return tuple(sorted(pairs.items()))


REFERENCE = KernelPlan("reference", None)


def is_nvidia_gpu(device) -> bool:
    """Whether `device` (a jax Device or AbstractDevice) is an NVIDIA GPU (the Pallas kernels here are CUDA-only)."""
    return device.platform == "gpu" and "nvidia" in device.device_kind.lower()


@functools.cache
def ffi_available(arch: str | None = None) -> bool:
    """Whether the CUDA kernels of ffi/ are built and registered (building them now if needed) for `arch` (default:
    this process's GPU); warns once and returns False when nvcc is missing or the build or the library load fails
    (the Pallas kernels then take their calls)."""
    try:
        ffi.register_all(arch)
    except (ffi.FfiBuildError, OSError) as err:
        warnings.warn(f"CUDA decode kernels of ffi/ unavailable, using the Pallas kernels: {err}", stacklevel=2)
        return False
    return True


def plan_kernels(mode: str, device=None, overrides=None) -> KernelPlan:
    """The plan for a `kernels` mode on `device` (default: JAX's default device). "auto": the CUDA kernels on an
    NVIDIA GPU (ffi/ built now, once per process; on an AbstractDevice, which has no GPU to build for, the Pallas
    kernels), the reference elsewhere. "pallas" needs an NVIDIA GPU as the device (or as the compile target).
    `overrides`: per-op overrides (KernelPlan.overrides, parse_overrides)."""
    return _plan_backend(mode, device).with_overrides(overrides)


def _plan_backend(mode: str, device) -> KernelPlan:
    check_kernel_mode(mode)
    device = jax.devices()[0] if device is None else device
    target = device.device_kind
    nvidia = is_nvidia_gpu(device)
    if mode == "reference" or (mode == "auto" and not nvidia):
        return KernelPlan(mode, None, target=target)
    if mode == "interpret":
        return KernelPlan(mode, "interpret", target=target)
    if not nvidia:
        raise ValueError(f"kernels='pallas' needs an NVIDIA GPU, and the device is {target!r} "
                         f"({device.platform}); use 'interpret' to run the Pallas kernels here, or 'reference'")
    if mode == "pallas":
        return KernelPlan(mode, "pallas", target=target)
    if not isinstance(device, jax.Device):              # an AbstractDevice: no architecture to build for
        return KernelPlan(mode, "cuda", ffi=False, target=target)
    # A real GPU, or a compile-only one of a jax.experimental.topologies topology: build for its architecture.
    return KernelPlan(mode, "cuda", ffi=ffi_available(device_arch(device)), target=target)
