"""specrl: on-policy RL for language models with speculative rollouts.

Importing specrl before torch puts torch's CPU tensors of 2 MB and more on transparent huge pages
and, with glibc, has malloc keep freed memory for reuse instead of returning it to the kernel
(specrl/host_memory.py: why, and how to keep the defaults).
"""

from specrl import host_memory

host_memory.configure()
