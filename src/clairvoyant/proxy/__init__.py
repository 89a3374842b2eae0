"""The HTTP side: the app, the relay, the backend client, the closed loop, ``clairvoyant serve``."""
