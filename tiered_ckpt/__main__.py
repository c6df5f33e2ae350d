from tiered_ckpt.entry import main

raise SystemExit(main())
