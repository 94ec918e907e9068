"""The wire contract: message schema, topic names, Kafka settings and the typed config loader.

Leaf package: it imports nothing else of the project; every other package may import it.
"""
