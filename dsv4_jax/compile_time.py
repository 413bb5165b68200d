"""How long a block of work spent preparing programs: JAX's own compile events, summed.

    with compile_time.CompileTimer() as timer:
        model.generate(...)
    timer.seconds, timer.compiled, timer.cache_hits

JAX reports, for every new program, its trace, its lowering and either its backend compile or its read from the
persistent compilation cache (`jax.monitoring` duration events; the backend-compile event of a program read from the
cache includes the read). A timer sums the lowering and backend-compile times that happen while it is active (not
the traces: a jitted function called inside another reports a trace nested in its caller's, which a sum would
count twice); `on_first` is called once, at the first event of any of
them, trace included, e.g. to say "compiling" before the long part.
"""

from __future__ import annotations

import jax

_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_READ_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"
_active: list["CompileTimer"] = []
_listening = False


def _listener(event: str, duration: float, **_) -> None:
    for timer in _active:
        timer._record(event, duration)


class CompileTimer:
    def __init__(self, on_first=None):
        self.seconds = 0.0       # lowering + compiling or reading from the cache
        self.cache_hits = 0      # programs read from the persistent compilation cache
        self._backend = 0        # backend-compile events: compiled or read
        self._on_first = on_first

    def _record(self, event: str, duration: float) -> None:
        if event not in (_TRACE_EVENT, _LOWER_EVENT, _COMPILE_EVENT, _CACHE_READ_EVENT):
            return
        if self._on_first is not None:
            on_first, self._on_first = self._on_first, None
            on_first()
        if event in (_LOWER_EVENT, _COMPILE_EVENT):
            self.seconds += duration
        self._backend += event == _COMPILE_EVENT
        self.cache_hits += event == _CACHE_READ_EVENT

    @property
    def compiled(self) -> int:
        """Programs the backend compiled (not read from the cache)."""
        return max(self._backend - self.cache_hits, 0)

    def __enter__(self) -> "CompileTimer":
        global _listening
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _listening = True
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
