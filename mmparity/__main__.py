from mmparity.cli.main import main

raise SystemExit(main())
