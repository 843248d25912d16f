"""Tooling around the runner, apart from its runtime: the demo, default-model preparation,
and the spawned-runner helper shared by tests, bench and demo. Run from the repository root
(`python -m tools.demo`, `python -m tools.default_model`); not installed with the package."""
