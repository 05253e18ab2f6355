import sys

from fd_cudagraph_plugin.tools.cli import main

sys.exit(main())
