"""The modelwarden daemon: one poll loop supervising pinned, probed worker processes."""
