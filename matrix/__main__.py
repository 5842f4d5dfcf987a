import sys

from matrix.cli import main

sys.exit(main())
