"""The ranks' agreement: one verdict per point for every tensor-parallel rank (docs/design.md)."""
