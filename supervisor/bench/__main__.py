"""``python -m supervisor.bench NAME``: see :mod:`supervisor.bench`."""

from supervisor.bench import main

raise SystemExit(main())
