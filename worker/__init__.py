"""One worker process: placement, model loading, the serving loop."""
