"""How the process's CPU memory is allocated, set when specrl is imported (before torch).

- **Tensors on huge pages.** `THP_MEM_ALLOC_ENABLE=1` makes torch's CPU allocator put tensors of
  2 MB and more on transparent huge pages (read once, when torch is imported). On a 2-core CPU
  decode forwards of SmolLM2 took 113-151 ms with them and 130-320 ms without, depending on where
  a model's weights happened to lie (docs/performance.md). Set it to 0 beforehand to keep torch's
  default.
- **Freed memory kept for reuse** (Linux, glibc). glibc's malloc serves a large allocation with
  pages mapped for it alone and unmaps them when it is freed (above 32 MB always, and smaller ones
  until one of their size has been freed), so each new large tensor's pages are faulted in and
  zeroed by the kernel again. A trie pass over SmolLM2's 49k-token vocabulary allocates several
  [nodes, vocabulary] tensors: a pass over 4 tries of 60 nodes took 1.88-2.09 s with glibc's
  defaults and 0.92-1.02 s with the memory kept, a prefill of the 4 prompts 0.72-0.77 s and
  0.47-0.56 s (benchmarks/cpu-hf-smollm2-trie-pass-memory); a SmolLM2 training step with LoRA
  took 22 s against 37-40 s, its update half the time (benchmarks/cpu-hf-smollm2-host-memory-steps).
  Allocations of up to 1 GB are therefore served from the heap (`M_MMAP_THRESHOLD`), and the heap
  is not trimmed below 2 GB of free memory (`M_TRIM_THRESHOLD`): the process keeps its peak memory
  resident and reuses it. glibc's own settings win: with `MALLOC_MMAP_THRESHOLD_`,
  `MALLOC_TRIM_THRESHOLD_` or `GLIBC_TUNABLES` in the environment nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
GLIBC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def configure() -> None:
    """Huge pages for torch's tensors, and glibc's malloc keeping freed memory (see above)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if platform.libc_ver()[0] == "glibc" and not any(v in os.environ for v in GLIBC_SETTINGS):
        keep_freed_memory()


def keep_freed_memory() -> None:
    """Serve allocations of up to 1 GB from glibc's heap and keep what is freed there (versions
    that cap the mmap threshold at 32 MB refuse 1 GB: then 32 MB)."""
    mallopt = ctypes.CDLL(None).mallopt
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
