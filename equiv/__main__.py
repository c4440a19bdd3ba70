from equiv.cli import main

raise SystemExit(main())
