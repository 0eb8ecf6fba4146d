"""The KServe v2 (Open Inference Protocol) gateway: its own process, a client of the daemon."""
