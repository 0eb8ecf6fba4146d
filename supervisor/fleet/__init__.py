"""The fleet: the worker processes of every model, from plan to verdict.

``fleet`` (every pool, and what is done to all of them: restart, stop, a reload's plan), ``pool`` (one model's slots, restarts, backoff, FATAL, replacement), ``slot`` (a place for one
worker), ``handle`` (one running worker as the supervisor sees it), ``standby`` (warm standbys),
``placement`` (which cores and device each slot gets), ``devices`` (do the configured CUDA devices
exist), ``versions`` (which build a worker runs), ``reload`` (what a new configuration changes),
``workerauth`` (only the incarnation we spawned speaks on its link), ``probes`` (a probe from due time to
verdict), ``health`` (the daemon's health as the service manager sees it).
"""
