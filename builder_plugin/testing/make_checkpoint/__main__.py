import sys

from builder_plugin.testing.make_checkpoint.cli import main

sys.exit(main())
