from k3tui.cli import main

raise SystemExit(main())
