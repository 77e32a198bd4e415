import sys

from bench.packing import main

raise SystemExit(main(sys.argv[1:]))
