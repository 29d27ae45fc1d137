"""`python -m mleng` entry point."""

import sys

from mleng.cli.main import main

sys.exit(main())
