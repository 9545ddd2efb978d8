"""``python -m cpumoe``: the command line, in cpumoe.cli."""
from cpumoe.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
