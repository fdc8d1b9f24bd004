"""The `partitioner` command line (also `python -m partitioner`): trace, compile, show, run, autotune, reshard.

One module per subcommand (`trace.py`, `compile.py` with show, `run.py`, `autotune.py`, `reshard.py`), each
a function from the parsed arguments to an exit code; `parser.py` builds the argparse parser (its text is
the usage and docs/cli.md), `entry.py` runs it (`main`), `common.py` is what they share. Read `parser.py`
first for what the command accepts.
"""

from partitioner.cli.entry import main
from partitioner.cli.parser import build_parser

__all__ = ["build_parser", "main"]
