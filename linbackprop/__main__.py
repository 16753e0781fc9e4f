"""``python -m linbackprop``: the demo (for now the seed's example)."""

import argparse

from ._seed import main as seed_main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linbackprop", description=__doc__)
    parser.add_argument("--seed", type=int, default=42, help="random seed of the seed network's data")
    args = parser.parse_args(argv)
    seed_main(args.seed)


if __name__ == "__main__":
    main()
