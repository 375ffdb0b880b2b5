"""``python -m supervisor.tools.bench NAME``: see :mod:`supervisor.tools.bench`."""

from supervisor.tools.bench import main

raise SystemExit(main())
