"""Recipes: the structured schema, loading with overrides, and the capability/parallelism rule registry."""
