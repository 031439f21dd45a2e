"""``scape_train.step_flags.StepFlags``: a step's agreed flags posted, then taken once."""

from __future__ import annotations

import pytest
import torch

from scape_train.profiling import DeviceOpCounter
from scape_train.step_flags import StepFlags


def test_post_then_take_once_without_a_device_read():
    flags = StepFlags(torch.device("cpu"))
    assert flags.take() is None and flags.pending is None
    device_flags = torch.tensor([3.5, 0.0, 1.0], dtype=torch.float64)
    flags.post(7, device_flags)
    device_flags.fill_(-1)          # the next step's values: the posted copy is what is taken
    assert flags.pending == 7
    with DeviceOpCounter() as ops:
        assert flags.take() == (7, [3.5, 0.0, 1.0])
    assert ops.host_syncs == 0 and ops.host_tables == 1
    assert flags.take() is None


def test_a_step_posted_over_an_untaken_one_is_refused():
    flags = StepFlags(torch.device("cpu"))
    flags.post(1, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="step 1's flags were not taken before step 2's"):
        flags.post(2, torch.zeros(3, dtype=torch.float64))
