"""Command-line interface: parses, calls library functions, prints. No tensor math here."""
