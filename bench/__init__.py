"""Reverie's benchmarks: ``python -m bench`` runs every measure and prints one table."""
