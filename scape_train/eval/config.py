"""Downstream evaluation's typed config (Hydra group ``eval``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class EvalConfig:
    enabled: bool = False             # run lm-eval at the end of training
    tasks: List[str] = field(default_factory=lambda: ["lambada_openai"])
    num_fewshot: int = 0
    limit: Optional[float] = None     # examples per task (int) or fraction (<1); None = all
    batch_size: int = 8
    max_length: int = 0               # 0 = the model's max_seq_len
    # task name -> local data file, so a task runs offline from the same task definition
    local_data: Dict[str, str] = field(default_factory=dict)
    include_path: Optional[str] = None    # extra lm-eval task YAML directory
    seed: int = 1234
