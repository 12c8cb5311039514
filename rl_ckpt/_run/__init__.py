"""The run folder: its layout and JSON records, catalog, commit strategies, maintenance after a commit, retention,
garbage collection, quarantine, dedup objects, patrol."""
