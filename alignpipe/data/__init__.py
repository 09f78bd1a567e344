"""Datasets: reading raw sources, canonical formats, and the synthetic tasks the project makes itself."""
