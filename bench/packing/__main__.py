from bench.packing import main

raise SystemExit(main())
