"""Files on disk: written atomically, never replacing what is not ours, under the cache root."""
