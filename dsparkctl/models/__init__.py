"""The models: the DSpark draft, its config and files, the target adapter, loading, packed linears."""
