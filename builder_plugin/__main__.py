import sys

from builder_plugin.cli import main

sys.exit(main())
