"""``python -m scape_train.elastic lighthouse [--port 29510 ...]`` (see ``lighthouse.py``)."""

from __future__ import annotations

import argparse

from scape_train.elastic import lighthouse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scape_train.elastic",
                                     description="Services of elastic DiLoCo / GASLoC / SparseLoCo runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    lighthouse.add_arguments(sub.add_parser("lighthouse", help="run the torchft lighthouse"))
    return parser


def main(argv: list[str] | None = None) -> None:
    lighthouse.serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
