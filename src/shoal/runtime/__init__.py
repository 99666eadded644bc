"""The process-group runtime: init, ranks, collectives, heartbeat, info."""
