"""``python -m scape_train.export CHECKPOINT OUT_DIR``: a Hugging Face ``transformers`` model.

CHECKPOINT is a checkpoint directory or a run directory (its newest valid checkpoint). OUT_DIR
becomes a ``save_pretrained`` directory (safetensors weights, config, the run's tokenizer) that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load: a
``GPT2LMHeadModel`` for GPT models, a ``LlamaForCausalLM`` for Llama models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scape_train.checkpoint import CheckpointError


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    from scape_train.eval.loading import load_checkpoint
    from scape_train.models import export_hf

    model, tokenizer, _, _ = load_checkpoint(checkpoint, device="cpu")
    return export_hf(model, Path(out_dir), tokenizer=tokenizer.hf)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scape_train.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint directory or run directory")
    parser.add_argument("out_dir", help="where to write the transformers model")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir)
    except (CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"scape_train.export: error: {exc}", file=sys.stderr)
        return 1
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
