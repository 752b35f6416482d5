"""The commands, one module each: the spec, its checks before any work, opening the models, writing the
outputs together, and the report returned. Everything below this floor takes values and returns values."""
