"""Model location and preparation."""
