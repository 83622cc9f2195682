"""The top-k after a kernel's scores (issue 16 item 2): the same picks as `ops.scoring.topk`
without its sort.

`api.py` is the entry point (`implementation=`, `method=`, `supports`); `blocks.py` the
selection through the best blocks and `radix.py` the radix select and compaction it runs for
the kernel routes; `kernel_triton.py` the radix select as one Pallas program per row; `bench.py`
times them against the sort on the GPU.
"""

from pallas_kernels.topk.api import supports, topk

__all__ = ["supports", "topk"]
