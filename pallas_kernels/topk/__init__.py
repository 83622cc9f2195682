"""The top-k after a kernel's scores (issue 16 item 2): the same picks as `ops.scoring.topk`
without its sort.

`api.py` is the entry point (`implementation=`, `supports`); `radix.py` the radix select and
compaction it runs for the kernel routes; `bench.py` times it against the sort on the GPU.
"""

from pallas_kernels.topk.api import supports, topk

__all__ = ["supports", "topk"]
