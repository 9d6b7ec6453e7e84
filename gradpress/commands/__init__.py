"""Subcommands of the ``gradpress`` CLI; one module each, exposing ``register(subparsers)``."""
