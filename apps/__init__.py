"""Applications built on polyaccel's engines, each behind a ``polyaccel`` subcommand (``polyaccel train``)."""
