import sys

from prefixroute.edges.cli.main import main

sys.exit(main())
