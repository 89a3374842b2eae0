"""Replicas that share one queue, one set of slots and one set of limits through Redis.

    shared.py    the types a replica and the shared store exchange (entries, grants, messages)
    store.py     ``RedisSlotStore``: every decision one Lua script on Redis's clock (grant.lua)
    observations.py  ``SharedObservations``: every replica learns from every answer (a Redis stream)

Only metadata is shared: ids, tenant, band, model, predicted seconds, times. The prompt and the
answer stay on the replica that holds the client, which calls the backend itself.
"""
