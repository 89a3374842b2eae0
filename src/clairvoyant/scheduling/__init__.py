"""Scheduling: the queue record and queues (job_queue), the policies and their registry (policy),
the gamma-boost table, the service-time model, the adaptive slowdown, and the dispatcher with its
slot lease. Synchronous and clock-free below the dispatcher, so the simulator drives the same code.
"""
