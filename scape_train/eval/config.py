"""Downstream evaluation's typed config (Hydra group ``eval``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class EvalConfig:
    enabled: bool = False             # run lm-eval at the end of training
    # lm-eval task/group names or presets (scape_train/eval/tasks.py: "paper" = 16 tasks)
    tasks: List[str] = field(default_factory=lambda: ["lambada_openai"])
    num_fewshot: int = 0              # 0 = each task's own default (0 for most tasks)
    limit: Optional[float] = None     # examples per task (int) or fraction (<1); None = all
    batch_size: int = 8               # sequences per lm-eval forward
    max_length: int = 0               # 0 = the model's max_seq_len
    # task name -> local data file, so a task runs offline from the same task definition
    local_data: Dict[str, str] = field(default_factory=dict)
    include_path: Optional[str] = None    # extra lm-eval task YAML directory
    seed: int = 1234                  # lm-eval's seed (few-shot sampling)
    max_gen_toks: int = 256           # generate_until: default cap on new tokens
    precision: str = "fp32"           # fp32 | bf16 (autocast) for the evaluation forwards
    bootstrap_iters: int = 1000       # lm-eval's bootstrap for stderr (0 = none; 100000 = lm-eval's default)
    log_samples: bool = False         # also write per-example records next to the results
