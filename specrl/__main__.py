import sys

from specrl.cli import main

sys.exit(main())
