"""What every engine's refit shares, whatever the engine: the handshake before a byte moves (`handshake`), the
client -> replica -> refit-rank arithmetic of a fleet (`replicas`), and the fleet's membership, drop-and-resume,
catch-up and telling members what they hold (`members`). Imports no engine: an engine's room
(`engines/vllm/`) builds on it."""
