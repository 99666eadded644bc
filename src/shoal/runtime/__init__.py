"""The process-group runtime: init, ranks, collectives, spawn, info."""
