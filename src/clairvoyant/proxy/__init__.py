"""The HTTP side: the app (routes, lifespan), the responses that relay the backend's answer, the
upstream client, the closed loop's wiring, and ``clairvoyant serve``.
"""
