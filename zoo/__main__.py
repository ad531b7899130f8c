"""`python -m zoo matrix ...`: measure zoo models x recipes on Ray and rewrite the zoo's results and README."""
from __future__ import annotations

import argparse
import sys

from models.errors import UserFacingError
from recipes.process import thread_policy


def main(argv: list[str] | None = None) -> int:
    thread_policy.limit_openmp_default()  # before anything loads torch; the matrix's workers inherit it
    parser = argparse.ArgumentParser(prog="python -m zoo", description="The zoo's models x recipes matrix.")
    sub = parser.add_subparsers(dest="command", required=True)
    # after the thread policy: the matrix's module loads torch
    from zoo.matrix import add_parser, run_from_args

    add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
