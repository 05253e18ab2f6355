import sys

from fd_cudagraph_plugin.cli import main

sys.exit(main())
