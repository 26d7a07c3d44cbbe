"""Host memory as importing specrl sets it (specrl/host_memory.py), seen in fresh processes."""

import os
import platform
import subprocess
import sys

import pytest

# 40 MB blocks aligned as torch aligns its tensors on huge pages, allocated, written and freed
# four times, through glibc itself: the page faults of the last three
REALLOCATE = """
import ctypes, resource
import specrl

libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = ctypes.c_void_p()
    assert libc.posix_memalign(ctypes.byref(block), 2 << 20, 40 << 20) == 0
    libc.memset(block, 1, 40 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.parametrize(
    "environment, kept",
    [({}, True), ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False)],
    ids=["specrl's", "glibc's own setting"],
)
def test_freed_memory_is_reused_without_page_faults(environment, kept):
    """A block allocated again after one of its size was freed lands in the memory the first
    had, already faulted in (a SmolLM2 trie pass spent half its time faulting its [nodes,
    vocabulary] tensors in, benchmarks/cpu-hf-smollm2-trie-pass-memory), unless glibc was told
    otherwise in the environment: then each 40 MB block is faulted in anew (10,240 faults on
    4 kB pages)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    result = subprocess.run(
        [sys.executable, "-c", REALLOCATE],
        env=env | environment,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (int(result.stdout) < 100) == kept, result.stdout
