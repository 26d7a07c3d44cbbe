"""Host memory as importing specrl sets it (specrl/host_memory.py), seen in fresh processes."""

import os
import platform
import subprocess
import sys

import pytest

REALLOCATE = """
import resource
import specrl, torch

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

x = torch.ones(40 << 20, dtype=torch.uint8)  # 40 MB, every page touched
del x
before = faults()
for _ in range(5):
    y = torch.ones(40 << 20, dtype=torch.uint8)
    del y
print(faults() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.parametrize(
    "environment, kept",
    [({}, True), ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False)],
    ids=["specrl's", "glibc's own setting"],
)
def test_a_freed_tensors_memory_is_reused_without_page_faults(environment, kept):
    """A large tensor allocated again after one was freed lands in the memory the first had,
    already faulted in (a SmolLM2 trie pass spent a quarter of its time faulting its [nodes,
    vocabulary] tensors in), unless glibc was told otherwise in the environment. 5 x 40 MB
    faulted in anew are 100 faults on huge pages and 51,200 on 4 kB ones."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    result = subprocess.run(
        [sys.executable, "-c", REALLOCATE],
        env=env | environment,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (int(result.stdout) < 50) == kept, result.stdout
