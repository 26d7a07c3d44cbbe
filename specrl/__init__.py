"""specrl: on-policy RL for language models with speculative rollouts.

Importing specrl before torch turns on PyTorch's transparent huge pages for its CPU tensors of
2 MB and more (`THP_MEM_ALLOC_ENABLE`, read once by torch's allocator; set it to 0 beforehand to
keep torch's default). On a 2-core CPU decode forwards of SmolLM2 took 113-151 ms with them and
130-320 ms without, depending on where a model's weights happened to lie (docs/performance.md).
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
