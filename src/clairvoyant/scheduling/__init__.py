"""New scheduling parts (issue 9): the gamma-boost table and the service-time model.

The queue interface and its implementations live in ``clairvoyant.job_queue``, the policies and
their registry in ``clairvoyant.policy``; the lead's package re-layout moves them here.
"""
