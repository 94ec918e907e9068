"""Transport: the Kafka bus, the embedded broker, task sinks with back-pressure, and the weight store.

Imports only `streamer.wire`.
"""
