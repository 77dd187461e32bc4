"""The OpenMP thread pool of a thread that hands its torch work to another thread.

torch on a CPU runs its parallel kernels (matrix products over several rows, attention) through OpenMP, and OpenMP
keeps one pool of worker threads per thread that started parallel work. A server or `generate_batch` loads the model
on one thread (the main thread: loading, warm-up) and then decodes on another (transformers' continuous batching runs
its loop on a thread of its own), so two pools exist. GNU OpenMP (libgomp, the runtime of torch's Linux wheels)
counts the workers of every pool, idle ones included; once they outnumber the CPUs, workers stop spinning between
parallel regions and sleep at once, and each region then pays to wake its team. On a 2-core EPYC that made SmolLM2's
7-query forwards cost 91 ms instead of about 63 ms on the decoding thread (one-token forwards, whose products are not
parallel, were unchanged); see CB-17 in docs/experiments/continuous-batching.md.

`release_thread_pool()` frees the calling thread's pool (OpenMP 5.0 `omp_pause_resource_all`), which the runtime
builds again if that thread runs parallel work later: it costs nothing but that rebuild.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: frees the threads too (a soft pause may keep them)
_RUNTIME_NAMES = ("libgomp", "libiomp5", "libomp")


@functools.lru_cache(maxsize=1)
def _openmp_runtime():
    """torch's OpenMP runtime, loaded with ctypes (the copy torch itself uses), or None where it has none."""
    import torch

    if not torch.backends.openmp.is_available():
        return None
    candidates = []
    try:  # the runtime this process has loaded (Linux), wherever it lives (torch's folder, a conda libiomp5, ...)
        with open("/proc/self/maps") as maps:
            candidates += [Path(line.split()[-1]) for line in maps if "/" in line
                           and os.path.basename(line.split()[-1]).startswith(_RUNTIME_NAMES)]
    except OSError:
        pass
    candidates += sorted(p for p in (Path(torch.__file__).parent / "lib").glob("lib*omp*")
                         if p.name.startswith(_RUNTIME_NAMES))
    for path in candidates:
        try:
            library = ctypes.CDLL(str(path))
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return library
        except (OSError, AttributeError):
            continue
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP pool, for a thread whose torch work now runs on another thread. False where
    there is nothing to free (no OpenMP, one torch thread, a runtime without `omp_pause_resource_all`) or the
    runtime refused (inside a parallel region)."""
    import torch

    if torch.get_num_threads() < 2:
        return False
    runtime = _openmp_runtime()
    if runtime is None:
        return False
    freed = runtime.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
    logger.debug("OpenMP pool of this thread %s", "freed" if freed else "kept (the runtime refused)")
    return freed


__all__ = ["release_thread_pool"]
