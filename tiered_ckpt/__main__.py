from tiered_ckpt.cli import main

raise SystemExit(main())
