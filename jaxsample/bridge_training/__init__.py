"""Training Bridge blocks."""
