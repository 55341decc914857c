"""Reverie's process-level pieces: settings, errors, the CLI, and (lazily) Celery.

Importing this package is cheap: nothing here imports Celery or litellm.
"""
