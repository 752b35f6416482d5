"""The arithmetic of speculation: sampling, verification, statistics, SPS tables, policies."""
