"""The OpenAI-compatible server (`dspark serve`): `runner` (the engine thread), `protocol` (request checking),
`metrics` (Prometheus), `app` (the FastAPI routes), `cli` (the subcommand). Import from the submodules."""
