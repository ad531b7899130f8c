"""Process policies: threads, malloc, the collector, RSS, the runtime's log, dependency noise."""
