import sys

from trainscale.cli import main

sys.exit(main())
