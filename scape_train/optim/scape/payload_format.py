"""The payload's formats on the wire (:mod:`.payload` describes them): their names, the fp8
scale block and exponent bounds; shared by the torch path and the Triton kernels."""

from __future__ import annotations

import torch

PAYLOAD_DTYPES = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2")
SCALE_BLOCK = 128      # fp8: one power-of-two scale per this many consecutive values

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}
EXP_HEADROOM = {"fp8_e4m3": 8, "fp8_e5m2": 15}   # scaled |value| < 2^E <= the type's max
E_MIN, E_MAX = -110, 120
