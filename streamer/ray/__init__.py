"""Ray scale-out: the role actor (`actor.py`); the launcher side is `streamer.ray_launch`."""
