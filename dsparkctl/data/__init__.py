"""Prompt sets: built-in, local files and hub datasets, with presets and chat templates."""
