"""The engine: runs speculative rounds (draft → schedule → verify → accept) and plain decoding."""
