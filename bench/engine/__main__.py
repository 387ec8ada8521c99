import sys

from bench.engine.cli import main

sys.exit(main())
