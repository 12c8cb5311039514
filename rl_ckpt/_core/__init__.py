"""The engine: save pipeline (staging, async writer, writer, scheduler) and restore path (reader)."""
