"""The [rows] vectors the kernels take (slots, temperatures, seeds, steps, positions, sequence
lengths, cache slots): dense, one entry a row.

The Triton kernels read such a vector at base + row. A strided or stride-0 view (an expand left
as a view, which torch returns for some sizes only, e.g. one row) would hand them other rows'
values, silently. The PyTorch references index correctly with any view, so they check the
contract too: a caller that breaks it fails on the CPU, not only on a GPU.
"""
from __future__ import annotations

import torch


def check_dense(*rows: torch.Tensor) -> None:
    for x in rows:
        if not x.is_contiguous():
            raise ValueError(f"a [rows] vector must be dense, got strides {x.stride()}")
