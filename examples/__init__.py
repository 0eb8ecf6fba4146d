"""Example models and configuration for modelwarden."""
