"""Argument checks shared by both kernel paths (:mod:`.kernels`, the seam and torch path, and
:mod:`.triton_kernels`); a leaf module, so neither path imports the other."""

from __future__ import annotations


def check_payload_count(numel: int, count: int) -> None:
    if numel != count:
        raise ValueError(f"payload has {numel} values but the mask has {count} ones; "
                         f"the payload length must equal the mask's popcount")
