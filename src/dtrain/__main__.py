import sys

from dtrain.cli import main

sys.exit(main())
