"""``python -m titan_dmuon.sizing``: see ``command.py``."""

import sys

from titan_dmuon.sizing.command import main

main(sys.argv[1:])
