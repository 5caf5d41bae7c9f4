from clipcli.cli import main

raise SystemExit(main())
