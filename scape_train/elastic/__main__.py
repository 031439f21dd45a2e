"""``python -m scape_train.elastic lighthouse [--port 29510 ...]`` (see ``lighthouse.py``)."""

from __future__ import annotations

import argparse

from scape_train.elastic import lighthouse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scape_train.elastic",
                                     description="Services of elastic DiLoCo / GASLoC runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    lighthouse.add_arguments(sub.add_parser("lighthouse", help="run the torchft lighthouse"))
    args = parser.parse_args(argv)
    lighthouse.serve(args)


if __name__ == "__main__":
    main()
