"""Read-only views of a plan (pure functions: Plan -> text), shared by the CLI and the TUI."""
