"""elastic-hvd-run, the launcher."""
