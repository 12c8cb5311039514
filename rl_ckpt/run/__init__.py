"""The run folder: catalog, commit strategies, retention, garbage collection, quarantine, dedup objects, patrol."""
