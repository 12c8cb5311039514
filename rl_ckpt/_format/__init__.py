"""The snapshot format: manifest, state codec, safetensors reader/writer, untrusted JSON, checksums."""
